//! A paged cache on the device, and a decode step over it: one launch per tier
//! with pages, then the merge (see `kvcc_compiler::back::ptx::abi`).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{
    sys, CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, DriverError, LaunchConfig, PushKernelArg,
};
use kvcc_compiler::back::interp::{Interpreter, Options as InterpOptions};
use kvcc_compiler::back::ptx::abi;

use super::{CudaError, During, FormatKernels, Gpu};
use crate::cache::PagedCache;

/// Pools, page lists and tables of every tier, uploaded once.
pub struct DeviceCache {
    /// This upload among the process's: a decode step serves only the cache
    /// it was prepared for (its buffers' sizes and tensor maps are that
    /// cache's).
    id: u64,
    pub sequences: usize,
    pub kv_heads: usize,
    pools: Vec<CudaSlice<u8>>,
    page_offsets: Vec<CudaSlice<u32>>,
    page_ids: Vec<CudaSlice<u32>>,
    tables: Vec<CudaSlice<f32>>,
    /// Per tier: pages in its pool.
    pool_pages: Vec<usize>,
    /// Per tier: the most pages any (sequence, kv head) row has in it.
    row_pages_max: Vec<u32>,
    /// Bytes a decode step must read: every referenced page and every table once.
    pub bytes_per_step: u64,
}

impl DeviceCache {
    /// Checks the cache on the host (page tables, tables) and uploads it.
    pub fn upload(
        gpu: &Gpu,
        kernels: &FormatKernels,
        cache: &PagedCache,
    ) -> Result<DeviceCache, CudaError> {
        let (format, pages) = (cache.format(), cache.format().spec().page.items);
        let kernel_pages = kernels.format.spec().page.items;
        if format.name() != kernels.format.name() {
            return Err(CudaError::Shape(format!(
                "the cache holds {} pages but the kernels are for {}",
                format.name(),
                kernels.format.name()
            )));
        }
        if pages != kernel_pages {
            return Err(crate::tune::TuneError::PageSize {
                tuned: kernel_pages,
                pages,
            }
            .into());
        }
        let view = cache.view();
        Interpreter::new(kernels.format.tiers(), InterpOptions::default()).check_cache(&view)?;
        let stream = &gpu.stream;
        let mut pools = Vec::new();
        let mut page_offsets = Vec::new();
        let mut page_ids = Vec::new();
        let mut tables = Vec::new();
        let mut pool_pages = Vec::new();
        let mut row_pages_max = Vec::new();
        let mut bytes_per_step = 0u64;
        for (t, (tier, (_, kernel))) in view.tiers.iter().zip(&kernels.decode).enumerate() {
            let upload = |what: &'static str| move || format!("uploading tier {t} {what}");
            // Never allocate zero bytes: an empty tier still needs a valid pointer.
            let mut pool_bytes = tier.pool.to_vec();
            pool_bytes.resize(pool_bytes.len().max(abi_alignment()), 0);
            pools.push(stream.clone_htod(&pool_bytes).during(upload("pages"))?);
            pool_pages.push(tier.pool.len() / kernel.page_bytes as usize);
            let (offsets, ids) = abi::page_lists(view.page_tables, t as u32);
            row_pages_max.push(offsets.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0));
            bytes_per_step += ids.len() as u64 * u64::from(kernel.page_bytes);
            page_offsets.push(stream.clone_htod(&offsets).during(upload("page offsets"))?);
            let mut ids = ids;
            if ids.is_empty() {
                ids.push(0);
            }
            page_ids.push(stream.clone_htod(&ids).during(upload("page ids"))?);
            let mut table_buffer = kernel.tables.fill(tier.tables);
            bytes_per_step += table_buffer.len() as u64 * 4;
            table_buffer.resize(table_buffer.len().max(4), 0.0);
            tables.push(stream.clone_htod(&table_buffer).during(upload("tables"))?);
        }
        static UPLOADS: AtomicU64 = AtomicU64::new(0);
        Ok(DeviceCache {
            id: UPLOADS.fetch_add(1, Ordering::Relaxed),
            sequences: view.page_tables.len(),
            kv_heads: view.kv_heads,
            pools,
            page_offsets,
            page_ids,
            tables,
            pool_pages,
            row_pages_max,
            bytes_per_step,
        })
    }
}

fn abi_alignment() -> usize {
    kvcc_compiler::layout::PAGE_ALIGN as usize
}

/// Query, partial and output buffers of decode steps over one `DeviceCache`.
pub struct DeviceDecode {
    /// The cache this step was prepared for (`DeviceCache::id`).
    cache: u64,
    pub q_heads: usize,
    /// Splits per tier (0: tier not launched).
    pub splits: Vec<u32>,
    slot_bases: Vec<u32>,
    slot_count: u32,
    queries: CudaSlice<f32>,
    partials: CudaSlice<f32>,
    output: CudaSlice<f32>,
    /// Per tier: the tensor maps of its kernel's tensor-copied streams over
    /// the cache's pool (`abi::TensorMap`: they hold the kernel's tile), and
    /// what they were encoded for, which a launch's kernels must match.
    tensor_maps: Vec<CudaSlice<u8>>,
    mapped: Vec<Vec<abi::TensorMap>>,
}

impl DeviceDecode {
    /// `splits`: per tier, or `None` for the kernels' own (tuned) splits, and
    /// where they have none, as many as make one wave of CTAs fill every
    /// multiprocessor to the kernel's occupancy.
    pub fn new(
        gpu: &Gpu,
        kernels: &FormatKernels,
        cache: &DeviceCache,
        q_heads: usize,
        splits: Option<Vec<u32>>,
    ) -> Result<DeviceDecode, CudaError> {
        let kv_heads = cache.kv_heads;
        if kv_heads == 0 || q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return Err(CudaError::Shape(format!(
                "{q_heads} query heads is not a positive multiple of {kv_heads} kv heads"
            )));
        }
        let group = (q_heads / kv_heads) as u32;
        if let Some((_, k)) = kernels
            .decode
            .first()
            .filter(|(_, k)| group > k.max_query_group)
        {
            return Err(CudaError::Shape(format!(
                "query group {group} exceeds the format's page.max_query_group {}",
                k.max_query_group
            )));
        }
        let rows = (cache.sequences * kv_heads).max(1) as u32;
        let splits: Vec<u32> = match splits {
            Some(s) if s.len() == kernels.decode.len() => s
                .iter()
                .zip(&cache.row_pages_max)
                .map(|(&s, &max)| if max == 0 { 0 } else { s.clamp(1, max) })
                .collect(),
            Some(s) => {
                return Err(CudaError::Shape(format!(
                    "{} split counts for {} tiers",
                    s.len(),
                    kernels.decode.len()
                )))
            }
            // One full wave: as many CTAs as the GPU holds at once (occupancy
            // from the kernel's registers and shared memory). A partial second
            // wave (e.g. 576 CTAs on 396 slots) leaves SMs idle for its whole
            // duration; more, smaller splits only repeat per-CTA setup.
            None => {
                let mut splits = Vec::with_capacity(kernels.decode.len());
                for (((function, kernel), &max), preferred) in kernels
                    .decode
                    .iter()
                    .zip(&cache.row_pages_max)
                    .zip(&kernels.splits)
                {
                    if let Some(s) = preferred {
                        splits.push(if max == 0 { 0 } else { (*s).clamp(1, max) });
                        continue;
                    }
                    let resident = function
                        .occupancy_max_active_blocks_per_multiprocessor(
                            kernel.threads,
                            kernel.dynamic_shared_bytes() as usize,
                            None,
                        )
                        .during(|| format!("reading the occupancy of {}", kernel.name))?;
                    let slots = resident.max(1) * gpu.multiprocessors;
                    splits.push(if max == 0 {
                        0
                    } else {
                        (slots / rows).clamp(1, max)
                    });
                }
                splits
            }
        };
        let (slot_bases, slot_count) = abi::slot_bases(&splits);
        let mut tensor_maps = Vec::new();
        for (t, (_, kernel)) in kernels.decode.iter().enumerate() {
            let encoded = super::tensor_map::encode(
                &gpu.stream,
                &cache.pools[t],
                cache.pool_pages[t].max(1),
                &kernel.tensor_maps,
            )
            .during(|| format!("encoding the tensor maps of {}", kernel.name))?;
            let buffer = gpu.stream.clone_htod(&encoded);
            tensor_maps.push(buffer.during(|| "uploading tensor maps".into())?);
        }
        let mapped = (kernels.decode.iter())
            .map(|(_, k)| k.tensor_maps.clone())
            .collect();
        let layout = kernels.merge.1.partials;
        let rows_out = cache.sequences * q_heads;
        let d = kernels.format.head_dim() as usize;
        let stream = &gpu.stream;
        let alloc = |len: usize, what: &'static str| {
            stream
                .alloc_zeros::<f32>(len.max(4))
                .during(|| format!("allocating {what}"))
        };
        Ok(DeviceDecode {
            cache: cache.id,
            q_heads,
            splits,
            slot_bases,
            slot_count,
            queries: alloc(rows_out * d, "queries")?,
            partials: alloc(
                layout.len(cache.sequences, q_heads, slot_count as usize),
                "partials",
            )?,
            output: alloc(rows_out * d, "the output")?,
            tensor_maps,
            mapped,
        })
    }

    /// Refuses a cache other than the one the step was prepared for: its
    /// partials, output and tensor maps are sized and encoded for that one.
    fn check_cache(&self, cache: &DeviceCache) -> Result<(), CudaError> {
        match cache.id == self.cache {
            true => Ok(()),
            false => Err(CudaError::Shape(
                "the decode step was prepared for another device cache".into(),
            )),
        }
    }

    /// Uploads `[sequence][q_head][head_dim]` queries (checked for NaN/Inf first).
    pub fn set_queries(
        &mut self,
        gpu: &Gpu,
        kernels: &FormatKernels,
        cache: &DeviceCache,
        queries: &[f32],
    ) -> Result<(), CudaError> {
        self.check_cache(cache)?;
        Interpreter::new(kernels.format.tiers(), InterpOptions::default()).check_queries(
            queries,
            cache.sequences,
            self.q_heads,
            cache.kv_heads,
        )?;
        gpu.stream
            .memcpy_htod(queries, &mut self.queries)
            .during(|| "uploading queries".into())
    }

    /// Fills output and partials with NaN, so an element no kernel writes shows.
    pub fn poison(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        for buffer in [&mut self.output, &mut self.partials] {
            let nan = vec![f32::NAN; buffer.len()];
            gpu.stream
                .memcpy_htod(&nan, buffer)
                .during(|| "poisoning buffers".into())?;
        }
        Ok(())
    }

    /// Enqueues one decode step (every tier's kernel, then the merge).
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        kernels: &FormatKernels,
        cache: &DeviceCache,
    ) -> Result<(), CudaError> {
        self.check_cache(cache)?;
        let scale = 1.0 / (kernels.format.head_dim() as f32).sqrt();
        let (q_heads, kv_heads, sequences) = (
            self.q_heads as u32,
            cache.kv_heads as u32,
            cache.sequences as u32,
        );
        let mapped = kernels.decode.iter().map(|(_, k)| &k.tensor_maps);
        if !mapped.eq(self.mapped.iter()) {
            return Err(CudaError::Shape(
                "the decode step was prepared for other kernels (its tensor maps differ)".into(),
            ));
        }
        for (t, (function, kernel)) in kernels.decode.iter().enumerate() {
            let splits = self.splits[t];
            if splits == 0 || sequences == 0 {
                continue;
            }
            let launch = kernel.launch(splits, kv_heads, sequences);
            let mut args = gpu.stream.launch_builder(function);
            args.arg(&cache.pools[t])
                .arg(&cache.page_offsets[t])
                .arg(&cache.page_ids[t])
                .arg(&cache.tables[t])
                .arg(&self.queries)
                .arg(&mut self.partials)
                .arg(&q_heads)
                .arg(&kv_heads)
                .arg(&splits)
                .arg(&self.slot_bases[t])
                .arg(&self.slot_count)
                .arg(&scale)
                .arg(&self.tensor_maps[t]);
            // SAFETY: arguments follow abi::DECODE_PARAMS in order and type; every
            // buffer is sized by the ABI's layouts and the page lists were checked.
            unsafe { args.launch(config(launch)) }
                .during(|| format!("launching {}", kernel.name))?;
        }
        if sequences > 0 {
            let (function, kernel) = &kernels.merge;
            let launch = kernel.launch(q_heads, sequences);
            let dependent = gpu.target().dependent_launches();
            self.launch_merge(gpu, function, launch, dependent)
                .during(|| format!("launching {}", kernel.name))?;
        }
        Ok(())
    }

    /// The merge; `dependent`, as a programmatic dependent launch: its CTAs
    /// may start once every CTA of the last decode kernel has left its
    /// stream loop, and wait for the partials themselves
    /// (`griddepcontrol.wait`), so the launch gap overlaps the decode
    /// kernel's tail. cudarc's launch builder takes no launch attributes,
    /// hence the driver call.
    fn launch_merge(
        &mut self,
        gpu: &Gpu,
        function: &CudaFunction,
        launch: abi::Launch,
        dependent: bool,
    ) -> Result<(), DriverError> {
        let stream = &gpu.stream;
        stream.context().bind_to_thread()?;
        let (partials, _reading) = self.partials.device_ptr(stream);
        let (output, _writing) = self.output.device_ptr_mut(stream);
        let (q_heads, slot_count) = (self.q_heads as u32, self.slot_count);
        // abi::MERGE_PARAMS in order: two pointers, two u32.
        let mut params: [*mut c_void; 4] = [
            (&partials as *const sys::CUdeviceptr).cast_mut().cast(),
            (&output as *const sys::CUdeviceptr).cast_mut().cast(),
            (&q_heads as *const u32).cast_mut().cast(),
            (&slot_count as *const u32).cast_mut().cast(),
        ];
        // SAFETY: an all-zero attribute value is valid (a plain C union).
        let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
        value.programmaticStreamSerializationAllowed = 1;
        let mut attribute = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value,
        };
        let config = sys::CUlaunchConfig {
            gridDimX: launch.grid[0],
            gridDimY: launch.grid[1],
            gridDimZ: launch.grid[2],
            blockDimX: launch.block[0],
            blockDimY: launch.block[1],
            blockDimZ: launch.block[2],
            sharedMemBytes: launch.shared_bytes,
            hStream: stream.cu_stream(),
            attrs: &mut attribute,
            numAttrs: u32::from(dependent),
        };
        // SAFETY: the parameters follow abi::MERGE_PARAMS in order and type and
        // outlive the call (the driver copies them); the buffers are sized by
        // the ABI's layouts.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                function.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }

    /// Waits for the step and downloads `[sequence][q_head][head_dim]`.
    pub fn output(
        &self,
        gpu: &Gpu,
        cache: &DeviceCache,
        head_dim: usize,
    ) -> Result<Vec<f32>, CudaError> {
        self.check_cache(cache)?;
        let mut out = gpu
            .stream
            .clone_dtoh(&self.output)
            .during(|| "downloading the output".into())?;
        out.truncate(cache.sequences * self.q_heads * head_dim);
        Ok(out)
    }
}

pub(crate) fn config(launch: abi::Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (launch.grid[0], launch.grid[1], launch.grid[2]),
        block_dim: (launch.block[0], launch.block[1], launch.block[2]),
        shared_mem_bytes: launch.shared_bytes,
    }
}
