//! Decode on the GPU with the generated PTX kernels.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{Decoded, ExecError, Executor, JitExecutor, Request};
use crate::cache::PagedCache;
use crate::cuda::{CudaError, DeviceCache, DeviceDecode, FormatKernels, Gpu};
use crate::tune::{lookup, KernelConfig, ShapeBucket};

/// Each `decode` uploads the cache and its tables; for repeated steps over one
/// cache keep it on the device with `cuda::DeviceCache` and `cuda::DeviceDecode`,
/// as `kvcc bench` does. Kernel configurations come from the tune cache for
/// the call's shape (see `tune::lookup`), else the defaults.
pub struct CudaExecutor {
    gpu: Gpu,
    loaded: Mutex<Loaded>,
}

/// What earlier calls resolved and loaded, so a decode only generates or
/// hashes code for a spec and shape bucket it has not seen.
#[derive(Default)]
struct Loaded {
    /// Per spec and shape bucket: each tier's configuration (a tune-cache
    /// lookup hashes every tier's generated code).
    configs: HashMap<(String, ShapeBucket), Vec<KernelConfig>>,
    /// Per spec, query group and configurations: the loaded kernels.
    kernels: HashMap<(String, u32, Vec<KernelConfig>), Arc<FormatKernels>>,
}

impl CudaExecutor {
    /// GPU 0.
    pub fn open() -> Result<CudaExecutor, CudaError> {
        Ok(CudaExecutor {
            gpu: Gpu::open()?,
            loaded: Mutex::new(Loaded::default()),
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Kernels for the cache's format at this shape: tuned where the tune
    /// cache has an entry for the pages' page size, else the defaults.
    fn kernels(&self, cache: &PagedCache, q_heads: usize) -> Result<Arc<FormatKernels>, CudaError> {
        let kv_heads = cache.kv_heads();
        let group = (q_heads / kv_heads) as u32;
        let shape = ShapeBucket::of(
            cache.sequences(),
            q_heads,
            kv_heads,
            cache.longest_sequence(),
        );
        let spec = format!("{:?}", cache.format().spec());
        let mut loaded = self.loaded.lock().expect("kernel cache lock");
        let configs = loaded
            .configs
            .entry((spec.clone(), shape))
            .or_insert_with(|| {
                lookup::resolve_default(&self.gpu.id(), self.gpu.machine(), cache.format(), shape)
                    .configs
            })
            .clone();
        let key = (spec, group, configs);
        if let Some(k) = loaded.kernels.get(&key) {
            return Ok(k.clone());
        }
        let k = Arc::new(FormatKernels::load_configs(
            &self.gpu,
            cache.format(),
            &key.2,
            group,
        )?);
        loaded.kernels.insert(key, k.clone());
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
        let kernels = self.kernels(cache, q_heads)?;
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

    /// The kernels keep logits on chip, so asked-for logits come from the JIT
    /// on the same pages (both backends equal the interpreter's logits within
    /// 1e-5 in the tests).
    fn execute(&self, r: Request<'_>) -> Result<Decoded, ExecError> {
        if r.rows.is_some() {
            // Selected pages on the GPU are the device live cache's.
            return Err(ExecError::Backend {
                executor: "cuda",
                format: r.cache.format().name().to_string(),
                tier: "all".into(),
                message: "this executor reads every page of its cache; a selection of \
                          pages runs on the interp or jit executors"
                    .into(),
            });
        }
        let outputs = self
            .run(r.cache, r.queries, r.q_heads)
            .map_err(|e| match e {
                CudaError::Decode(d) => ExecError::Decode(d),
                other => ExecError::Backend {
                    executor: "cuda",
                    format: r.cache.format().name().to_string(),
                    tier: "all".into(),
                    message: other.to_string(),
                },
            })?;
        let logits = if r.logits {
            JitExecutor::default().execute(r)?.logits
        } else {
            Vec::new()
        };
        Ok(Decoded { outputs, logits })
    }
}
