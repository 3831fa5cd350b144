//! A format's generated kernels, loaded into the GPU's context.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use kvcc_compiler::back::ptx::{self, abi};
use kvcc_compiler::Format;

use super::{CudaError, During, Gpu};

pub struct FormatKernels {
    pub format: Format,
    pub options: ptx::Options,
    pub(crate) decode: Vec<(CudaFunction, abi::DecodeKernel)>,
    pub(crate) merge: (CudaFunction, abi::MergeKernel),
    /// Keep modules alive as long as their functions.
    _modules: Vec<Arc<CudaModule>>,
}

impl FormatKernels {
    /// Generates PTX for `gpu`'s target with `options` and loads it.
    pub fn load(
        gpu: &Gpu,
        format: &Format,
        options: ptx::Options,
    ) -> Result<FormatKernels, CudaError> {
        let output = ptx::write(format, &options)?;
        let mut modules = Vec::new();
        let mut load = |source: &str, name: &str, what: &str| -> Result<CudaFunction, CudaError> {
            let module = gpu
                .context
                .load_module(Ptx::from_src(source))
                .during(|| format!("loading the PTX of {}/{what}", format.name()))?;
            let function = module
                .load_function(name)
                .during(|| format!("finding kernel {name}"))?;
            modules.push(module);
            Ok(function)
        };
        let mut decode = Vec::new();
        for tier in &output.tiers {
            let function = load(&tier.ptx, &tier.kernel.name, &tier.tier)?;
            let shared = tier.kernel.dynamic_shared_bytes();
            function
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared as i32,
                )
                .during(|| {
                    format!(
                        "allowing {} {shared} bytes of shared memory",
                        tier.kernel.name
                    )
                })?;
            decode.push((function, tier.kernel.clone()));
        }
        let merge = (
            load(&output.merge.ptx, &output.merge.kernel.name, "merge")?,
            output.merge.kernel.clone(),
        );
        Ok(FormatKernels {
            format: format.clone(),
            options,
            decode,
            merge,
            _modules: modules,
        })
    }
}
