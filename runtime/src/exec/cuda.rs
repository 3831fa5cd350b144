//! Decode on the GPU with the generated PTX kernels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvcc_compiler::back::ptx;

use super::{Decoded, ExecError, Executor, JitExecutor};
use crate::cache::PagedCache;
use crate::cuda::{CudaError, DeviceCache, DeviceDecode, FormatKernels, Gpu};

/// Each `decode` uploads the cache and its tables; for repeated steps over one
/// cache keep it on the device with `cuda::DeviceCache` and `cuda::DeviceDecode`,
/// as `kvcc bench` does.
pub struct CudaExecutor {
    gpu: Gpu,
    options: ptx::Options,
    /// Loaded kernels per format (keyed by the spec, so an edited spec reloads).
    kernels: Mutex<HashMap<String, Arc<FormatKernels>>>,
}

impl CudaExecutor {
    /// GPU 0 with default kernel options for its architecture.
    pub fn open() -> Result<CudaExecutor, CudaError> {
        let gpu = Gpu::open()?;
        let options = ptx::Options::for_target(gpu.target());
        Ok(CudaExecutor {
            gpu,
            options,
            kernels: Mutex::new(HashMap::new()),
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Kernels specialized for the query group (q_heads / kv_heads) being served.
    fn kernels(&self, cache: &PagedCache, group: u32) -> Result<Arc<FormatKernels>, CudaError> {
        let key = format!("{group}:{:?}", cache.format().spec());
        let mut loaded = self.kernels.lock().expect("kernel cache lock");
        if let Some(k) = loaded.get(&key) {
            return Ok(k.clone());
        }
        let options = ptx::Options {
            query_group: Some(group),
            ..self.options
        };
        let k = Arc::new(FormatKernels::load(&self.gpu, cache.format(), options)?);
        loaded.insert(key, k.clone());
        Ok(k)
    }

    fn run(
        &self,
        cache: &PagedCache,
        queries: &[f32],
        q_heads: usize,
    ) -> Result<Vec<f32>, CudaError> {
        let kv_heads = cache.kv_heads().max(1);
        if q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return Err(CudaError::Shape(format!(
                "{q_heads} query heads is not a positive multiple of {kv_heads} kv heads"
            )));
        }
        let kernels = self.kernels(cache, (q_heads / kv_heads) as u32)?;
        let device = DeviceCache::upload(&self.gpu, &kernels, cache)?;
        let mut step = DeviceDecode::new(&self.gpu, &kernels, &device, q_heads, None)?;
        step.set_queries(&self.gpu, &kernels, &device, queries)?;
        step.poison(&self.gpu)?;
        step.launch(&self.gpu, &kernels, &device)?;
        step.output(&self.gpu, &device, cache.format().head_dim() as usize)
    }
}

impl Executor for CudaExecutor {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn decode(
        &self,
        cache: &PagedCache,
        queries: &[f32],
        q_heads: usize,
    ) -> Result<Vec<f32>, ExecError> {
        self.run(cache, queries, q_heads).map_err(|e| match e {
            CudaError::Decode(d) => ExecError::Decode(d),
            other => ExecError::Backend {
                executor: "cuda",
                format: cache.format().name().to_string(),
                tier: "all".into(),
                message: other.to_string(),
            },
        })
    }

    /// Outputs from the GPU. The kernels keep logits on chip, so the logits
    /// come from the JIT on the same pages (both backends equal the
    /// interpreter's logits within 1e-5 in the tests).
    fn decode_with_logits(
        &self,
        cache: &PagedCache,
        queries: &[f32],
        q_heads: usize,
    ) -> Result<Decoded, ExecError> {
        let outputs = self.decode(cache, queries, q_heads)?;
        let logits = JitExecutor::default()
            .decode_with_logits(cache, queries, q_heads)?
            .logits;
        Ok(Decoded { outputs, logits })
    }
}
