//! A format's generated kernels, loaded into the GPU's context.

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use kvcc_compiler::back::ptx::{self, abi};
use kvcc_compiler::Format;

use super::{CudaError, During, Gpu};
use crate::tune::KernelConfig;

pub struct FormatKernels {
    pub format: Format,
    /// Per tier: the options its kernel was generated with.
    pub options: Vec<ptx::Options>,
    /// Per tier: the CTAs per row to launch (`None`: one full wave).
    pub splits: Vec<Option<u32>>,
    pub(crate) decode: Vec<(CudaFunction, abi::DecodeKernel)>,
    pub(crate) merge: (CudaFunction, abi::MergeKernel),
    /// Keep modules alive as long as their functions.
    _modules: Vec<Arc<CudaModule>>,
}

impl FormatKernels {
    /// Generates PTX for `gpu`'s target with `options` for every tier and loads it.
    pub fn load(
        gpu: &Gpu,
        format: &Format,
        options: ptx::Options,
    ) -> Result<FormatKernels, CudaError> {
        let tiers = format.tiers().len();
        FormatKernels::load_tiers(gpu, format, vec![options; tiers], vec![None; tiers])
    }

    /// Whether some tier's kernel loads a stream by tensor copies (its decode
    /// steps then hold tensor maps over their cache's pools).
    pub fn tensor_copies(&self) -> bool {
        (self.decode.iter()).any(|(_, kernel)| !kernel.tensor_maps.is_empty())
    }

    /// Kernels with one configuration per tier (tuned or default) for a query
    /// group. Refuses configurations for another page size than the format's:
    /// pages written with one page size cannot be read by kernels for another.
    pub fn load_configs(
        gpu: &Gpu,
        format: &Format,
        configs: &[KernelConfig],
        query_group: u32,
    ) -> Result<FormatKernels, CudaError> {
        if configs.len() != format.tiers().len() {
            return Err(CudaError::Shape(format!(
                "{} kernel configurations for the {} tiers of {}",
                configs.len(),
                format.tiers().len(),
                format.name()
            )));
        }
        for config in configs {
            config.check_pages(format.spec().page.items)?;
        }
        let options = configs
            .iter()
            .map(|c| c.options(gpu.target(), query_group))
            .collect();
        let splits = configs.iter().map(|c| c.splits).collect();
        FormatKernels::load_tiers(gpu, format, options, splits)
    }

    fn load_tiers(
        gpu: &Gpu,
        format: &Format,
        options: Vec<ptx::Options>,
        splits: Vec<Option<u32>>,
    ) -> Result<FormatKernels, CudaError> {
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
        for (module, tier_options) in format.tiers().iter().zip(&options) {
            let group = ptx::group_max(format, tier_options)?;
            let tier = ptx::write_tier(module, group, tier_options)?;
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
            decode.push((function, tier.kernel));
        }
        // The merge kernel reads partials of every tier: one block size for all.
        let merge_output = ptx::write_merge(format, &ptx::Options::for_target(gpu.target()));
        let merge = (
            load(&merge_output.ptx, &merge_output.kernel.name, "merge")?,
            merge_output.kernel,
        );
        Ok(FormatKernels {
            format: format.clone(),
            options,
            splits,
            decode,
            merge,
            _modules: modules,
        })
    }
}
