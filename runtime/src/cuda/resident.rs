//! A paged cache on the device, and a decode step over it: one launch per tier
//! with pages, then the merge (see `kvcc_compiler::back::ptx::abi`).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{
    sys, CudaEvent, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DriverError,
    PushKernelArg,
};
use kvcc_compiler::back::interp::{Interpreter, Options as InterpOptions};
use kvcc_compiler::back::ptx::abi;

use super::select::DeviceSelection;
use super::{config, CudaError, During, FormatKernels, Gpu};
use crate::cache::PagedCache;
use kvcc_compiler::page::PageRef;

/// Pools, page lists and tables of every tier on the device. A live cache
/// keeps one with pools at capacity and rewrites its page lists as pages
/// fill; every rewrite makes a new generation, and decode steps planned for
/// an older one are refused until re-planned ([`DeviceDecode::replan`]).
pub struct DeviceCache {
    /// This upload among the process's: a decode step serves only the cache
    /// it was prepared for (its buffers' sizes and tensor maps are that
    /// cache's).
    id: u64,
    /// Bumped by every change of the page lists.
    generation: u64,
    pub sequences: usize,
    pub kv_heads: usize,
    pools: Vec<CudaSlice<u8>>,
    page_offsets: Vec<CudaSlice<u32>>,
    page_ids: Vec<CudaSlice<u32>>,
    tables: Vec<CudaSlice<f32>>,
    /// Per tier: pages in its pool, and bytes per page.
    pool_pages: Vec<usize>,
    page_bytes: Vec<u32>,
    /// Per tier: the most pages any (sequence, kv head) row has in it.
    row_pages_max: Vec<u32>,
    /// Per tier: bytes of its tables (read once per step).
    table_bytes: Vec<u64>,
    /// Bytes a decode step must read: every referenced page and every table once.
    pub bytes_per_step: u64,
    /// `[cache.select]`: the tier whose pages a step chooses among, and
    /// the chosen lists its kernel reads instead of the full ones.
    selection: Option<DeviceSelection>,
}

impl DeviceCache {
    /// Checks the cache on the host (page tables, tables) and uploads it.
    pub fn upload(
        gpu: &Gpu,
        kernels: &FormatKernels,
        cache: &PagedCache,
    ) -> Result<DeviceCache, CudaError> {
        let (format, pages) = (cache.format(), cache.format().spec().page.items);
        if format.name() != kernels.format.name() {
            return Err(CudaError::Shape(format!(
                "the cache holds {} pages but the kernels are for {}",
                format.name(),
                kernels.format.name()
            )));
        }
        check_page_items(kernels, pages)?;
        let view = cache.view();
        Interpreter::new(kernels.format.tiers(), InterpOptions::default()).check_cache(&view)?;
        let stream = &gpu.stream;
        let mut pools = Vec::new();
        let mut pool_pages = Vec::new();
        for (t, (tier, (_, kernel))) in view.tiers.iter().zip(&kernels.decode).enumerate() {
            // Never allocate zero bytes: an empty tier still needs a valid pointer.
            let mut pool_bytes = tier.pool.to_vec();
            pool_bytes.resize(pool_bytes.len().max(abi_alignment()), 0);
            let pool = stream.clone_htod(&pool_bytes);
            pools.push(pool.during(|| format!("uploading tier {t} pages"))?);
            pool_pages.push(tier.pool.len() / kernel.page_bytes as usize);
        }
        let tables: Vec<&[Vec<Vec<f32>>]> = view.tiers.iter().map(|t| t.tables).collect();
        let mut cache =
            DeviceCache::with_pools(gpu, kernels, view.kv_heads, pools, pool_pages, &tables)?;
        cache.set_page_lists(gpu, view.page_tables)?;
        Ok(cache)
    }

    /// An empty cache (no sequence) whose tier `t` pool holds `pool_pages[t]`
    /// pages (zeroed), with `tables` (`[tier][kv_head][table]`), for at most
    /// `max_sequences` sequences. Its page lists are allocated for that
    /// capacity (every page of a pool listed once), so their device addresses
    /// never change: a decode step captured in a CUDA graph keeps reading the
    /// lists that later appends rewrite.
    pub fn with_capacity(
        gpu: &Gpu,
        kernels: &FormatKernels,
        kv_heads: usize,
        max_sequences: usize,
        pool_pages: &[usize],
        tables: &[&[Vec<Vec<f32>>]],
    ) -> Result<DeviceCache, CudaError> {
        check_per_tier(kernels, pool_pages.len(), "pool sizes")?;
        let mut pools = Vec::new();
        for (t, (&pages, (_, kernel))) in pool_pages.iter().zip(&kernels.decode).enumerate() {
            let bytes = (pages * kernel.page_bytes as usize).max(abi_alignment());
            let pool = gpu.stream.alloc_zeros::<u8>(bytes);
            pools.push(pool.during(|| format!("allocating tier {t}'s pool of {pages} pages"))?);
        }
        let mut cache =
            DeviceCache::with_pools(gpu, kernels, kv_heads, pools, pool_pages.to_vec(), tables)?;
        for &pages in pool_pages {
            let alloc = |len: usize| {
                (gpu.stream.alloc_zeros::<u32>(len.max(1)))
                    .during(|| format!("allocating page lists of {len} entries"))
            };
            cache
                .page_offsets
                .push(alloc(max_sequences * kv_heads + 1)?);
            cache.page_ids.push(alloc(pages)?);
        }
        cache.set_page_lists(gpu, &[])?;
        Ok(cache)
    }

    fn with_pools(
        gpu: &Gpu,
        kernels: &FormatKernels,
        kv_heads: usize,
        pools: Vec<CudaSlice<u8>>,
        pool_pages: Vec<usize>,
        tables: &[&[Vec<Vec<f32>>]],
    ) -> Result<DeviceCache, CudaError> {
        let mut buffers = Vec::new();
        let mut table_bytes = Vec::new();
        for (t, (tier_tables, (_, kernel))) in tables.iter().zip(&kernels.decode).enumerate() {
            if tier_tables.len() != kv_heads {
                return Err(CudaError::Shape(format!(
                    "tier {t} has tables for {} kv heads, not {kv_heads}",
                    tier_tables.len()
                )));
            }
            let mut buffer = kernel.tables.fill(tier_tables);
            table_bytes.push(buffer.len() as u64 * 4);
            buffer.resize(buffer.len().max(4), 0.0);
            let uploaded = gpu.stream.clone_htod(&buffer);
            buffers.push(uploaded.during(|| format!("uploading tier {t} tables"))?);
        }
        static UPLOADS: AtomicU64 = AtomicU64::new(0);
        let tiers = kernels.decode.len();
        Ok(DeviceCache {
            id: UPLOADS.fetch_add(1, Ordering::Relaxed),
            generation: 0,
            sequences: 0,
            kv_heads,
            pools,
            page_offsets: Vec::with_capacity(tiers),
            page_ids: Vec::with_capacity(tiers),
            tables: buffers,
            pool_pages,
            page_bytes: kernels.decode.iter().map(|(_, k)| k.page_bytes).collect(),
            row_pages_max: vec![0; tiers],
            bytes_per_step: 0,
            table_bytes,
            selection: None,
        })
    }

    /// Replaces every tier's page lists with those of `page_tables`
    /// (`[sequence][kv_head]`), whose pages must lie inside the pools.
    pub fn set_page_lists(
        &mut self,
        gpu: &Gpu,
        page_tables: &[Vec<Vec<PageRef>>],
    ) -> Result<(), CudaError> {
        for (sequence, heads) in page_tables.iter().enumerate() {
            if heads.len() != self.kv_heads {
                return Err(CudaError::Shape(format!(
                    "sequence {sequence} has page tables for {} kv heads, not {}",
                    heads.len(),
                    self.kv_heads
                )));
            }
            for page in heads.iter().flatten() {
                let inside = (self.pool_pages.get(page.tier as usize))
                    .is_some_and(|&pages| (page.page as usize) < pages);
                if !inside {
                    return Err(CudaError::Shape(format!(
                        "sequence {sequence} refers to page {} of tier {}, outside its pool",
                        page.page, page.tier
                    )));
                }
            }
        }
        let stream = &gpu.stream;
        let mut bytes_per_step = 0u64;
        for t in 0..self.pools.len() {
            let upload = |what: &'static str| move || format!("uploading tier {t} {what}");
            let (offsets, mut ids) = abi::page_lists(page_tables, t as u32);
            let rows = offsets.windows(2).map(|w| w[1] - w[0]);
            let selection = self.selection.as_ref().filter(|s| s.tier == t);
            let (read, most) = match selection {
                // The summaries of every listed page, then the chosen pages.
                Some(s) => (
                    rows.clone().map(|n| u64::from(s.read_of(n))).sum::<u64>(),
                    rows.map(|n| s.read_of(n)).max().unwrap_or(0),
                ),
                None => (ids.len() as u64, rows.max().unwrap_or(0)),
            };
            self.row_pages_max[t] = most;
            let summaries = selection.map_or(0, |s| ids.len() as u64 * u64::from(s.layout.bytes()));
            bytes_per_step +=
                read * u64::from(self.page_bytes[t]) + summaries + self.table_bytes[t];
            if ids.is_empty() {
                ids.push(0);
            }
            for (lists, host) in [(&mut self.page_offsets, offsets), (&mut self.page_ids, ids)] {
                match lists.get_mut(t) {
                    Some(buffer) if buffer.len() >= host.len() => {
                        let mut part = buffer.slice_mut(0..host.len());
                        stream
                            .memcpy_htod(&host, &mut part)
                            .during(upload("page lists"))?;
                    }
                    _ => {
                        // Room to grow: a live cache's lists lengthen a page at a time.
                        let mut room = host.clone();
                        room.resize(host.len() + host.len() / 2 + 64, 0);
                        let buffer = stream.clone_htod(&room).during(upload("page lists"))?;
                        if t < lists.len() {
                            lists[t] = buffer;
                        } else {
                            lists.push(buffer);
                        }
                    }
                }
            }
        }
        self.sequences = page_tables.len();
        self.bytes_per_step = bytes_per_step;
        self.generation += 1;
        Ok(())
    }

    /// Makes every later step choose among `selection.tier`'s pages (the
    /// page lists are re-planned for its budget).
    pub(crate) fn attach_selection(
        &mut self,
        gpu: &Gpu,
        selection: DeviceSelection,
        page_tables: &[Vec<Vec<PageRef>>],
    ) -> Result<(), CudaError> {
        self.selection = Some(selection);
        self.set_page_lists(gpu, page_tables)
    }

    pub(crate) fn selection(&self) -> Option<&DeviceSelection> {
        self.selection.as_ref()
    }

    pub(crate) fn selection_mut(&mut self) -> Option<&mut DeviceSelection> {
        self.selection.as_mut()
    }

    /// The exact pool and the selection, apart (summaries are written
    /// from the exact pages).
    pub(crate) fn summarize_buffers(
        &mut self,
        exact: usize,
    ) -> Option<(&CudaSlice<u8>, &mut DeviceSelection)> {
        let selection = self.selection.as_mut()?;
        Some((&self.pools[exact], selection))
    }

    /// Tier `tier`'s pool.
    pub(crate) fn pool(&self, tier: usize) -> &CudaSlice<u8> {
        &self.pools[tier]
    }

    pub(crate) fn pool_mut(&mut self, tier: usize) -> &mut CudaSlice<u8> {
        &mut self.pools[tier]
    }

    /// Pages tier `tier`'s pool holds.
    pub fn pool_pages(&self, tier: usize) -> usize {
        self.pool_pages[tier]
    }

    /// Bumped by every change of the page lists.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// What a page encoder reads and writes: the `source` tier's pool, the
    /// `target` tier's pool and the target's tables (`abi::TableBuffer`).
    pub(crate) fn encode_buffers(
        &mut self,
        source: usize,
        target: usize,
    ) -> (&CudaSlice<u8>, &mut CudaSlice<u8>, &CudaSlice<f32>) {
        assert_ne!(source, target, "a tier is not encoded into itself");
        let (low, high) = self.pools.split_at_mut(source.max(target));
        let (source_pool, target_pool) = if source < target {
            (&low[source], &mut high[0])
        } else {
            (&high[0], &mut low[target])
        };
        (source_pool, target_pool, &self.tables[target])
    }
}

/// Refuses pages of another size than the kernels were generated for.
fn check_page_items(kernels: &FormatKernels, pages: u32) -> Result<(), CudaError> {
    let kernel_pages = kernels.format.spec().page.items;
    if pages != kernel_pages {
        return Err(crate::tune::TuneError::PageSize {
            tuned: kernel_pages,
            pages,
        }
        .into());
    }
    Ok(())
}

/// Refuses a list of `len` `what`, one per tier, for another number of tiers
/// than the kernels'.
fn check_per_tier(kernels: &FormatKernels, len: usize, what: &str) -> Result<(), CudaError> {
    let tiers = kernels.decode.len();
    if len != tiers {
        return Err(CudaError::Shape(format!("{len} {what} for {tiers} tiers")));
    }
    Ok(())
}

fn abi_alignment() -> usize {
    kvcc_compiler::layout::PAGE_ALIGN as usize
}

/// One tier's decode kernel launched on a second stream, between two events
/// of the caller's (re-recorded each launch).
pub struct SideLaunch<'a> {
    pub stream: &'a CudaStream,
    pub tier: usize,
    /// Recorded on the main stream before the launches; `stream` waits for it.
    pub ready: &'a CudaEvent,
    /// Recorded on `stream` after its kernel; the merge waits for it.
    pub done: &'a CudaEvent,
}

/// Device buffers a decode step reads its queries from and writes its
/// results to when they are not the step's own (a framework's tensors):
/// `f32[sequences][q_heads][head_dim]` queries and output,
/// `f32[sequences][q_heads]` log-sum-exp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepIo {
    pub queries: sys::CUdeviceptr,
    pub output: sys::CUdeviceptr,
    pub lse: sys::CUdeviceptr,
}

/// Query, partial and output buffers of decode steps over one `DeviceCache`.
pub struct DeviceDecode {
    /// The cache this step was prepared for (`DeviceCache::id`), and the
    /// generation of its page lists the splits were planned for.
    cache: u64,
    generation: u64,
    /// `Some((most pages of any row per tier, most sequences))`: splits and
    /// buffers planned once for capacity and every tier launched, so the
    /// step stays valid (and a captured one replays right) whatever the
    /// page lists and the number of sequences become.
    fixed: Option<(Vec<u32>, usize)>,
    pub q_heads: usize,
    /// Splits asked for per tier (`None`: the kernels' own, else one wave).
    requested: Option<Vec<u32>>,
    /// Splits per tier (0: tier not launched).
    pub splits: Vec<u32>,
    slot_bases: Vec<u32>,
    slot_count: u32,
    queries: CudaSlice<f32>,
    partials: CudaSlice<f32>,
    output: CudaSlice<f32>,
    lse: CudaSlice<f32>,
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
        if let Some(s) = &splits {
            check_per_tier(kernels, s.len(), "split counts")?;
        }
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
        let alloc = |what: &'static str| {
            (gpu.stream.alloc_zeros::<f32>(4)).during(|| format!("allocating {what}"))
        };
        let mut decode = DeviceDecode {
            cache: cache.id,
            generation: u64::MAX,
            fixed: None,
            q_heads,
            requested: splits,
            splits: Vec::new(),
            slot_bases: Vec::new(),
            slot_count: 0,
            queries: alloc("queries")?,
            partials: alloc("partials")?,
            output: alloc("the output")?,
            lse: alloc("the log-sum-exp")?,
            tensor_maps,
            mapped,
        };
        decode.replan(gpu, kernels, cache)?;
        Ok(decode)
    }

    /// A step planned for capacity rather than for the current page lists:
    /// at most `max_sequences` sequences, no row of tier `t` holding more
    /// than `row_pages[t]` pages. Every tier's kernel launches with the same
    /// splits whatever the lists hold (CTAs past a row's pages write empty
    /// partials) and the buffers are sized once, so appends that fill or
    /// compress pages leave the step, and a CUDA graph that captured it,
    /// valid; a launch covers the sequences the cache holds then.
    pub fn fixed(
        gpu: &Gpu,
        kernels: &FormatKernels,
        cache: &DeviceCache,
        q_heads: usize,
        row_pages: Vec<u32>,
        max_sequences: usize,
    ) -> Result<DeviceDecode, CudaError> {
        check_per_tier(kernels, row_pages.len(), "row capacities")?;
        let mut step = DeviceDecode::new(gpu, kernels, cache, q_heads, None)?;
        let row_pages = row_pages.into_iter().map(|p| p.max(1)).collect();
        step.fixed = Some((row_pages, max_sequences.max(1)));
        step.replan(gpu, kernels, cache)?;
        Ok(step)
    }

    /// Plans the splits for the cache's current page lists and grows the
    /// buffers to its sequences; a step launches only once planned for the
    /// cache's generation.
    pub fn replan(
        &mut self,
        gpu: &Gpu,
        kernels: &FormatKernels,
        cache: &DeviceCache,
    ) -> Result<(), CudaError> {
        self.check_cache(cache)?;
        // A fixed step plans for its most sequences, every tier as if its
        // rows could be full.
        let (row_pages_max, sequences) = match &self.fixed {
            Some((rows, most)) => (rows.clone(), *most),
            None => (cache.row_pages_max.clone(), cache.sequences),
        };
        let rows = (sequences * cache.kv_heads).max(1) as u32;
        let splits: Vec<u32> = match &self.requested {
            Some(s) => s
                .iter()
                .zip(&row_pages_max)
                .map(|(&s, &max)| if max == 0 { 0 } else { s.clamp(1, max) })
                .collect(),
            // One full wave: as many CTAs as the GPU holds at once (occupancy
            // from the kernel's registers and shared memory). A partial second
            // wave (e.g. 576 CTAs on 396 slots) leaves SMs idle for its whole
            // duration; more, smaller splits only repeat per-CTA setup, and
            // CTAs of a few pages are mostly that (`model::splits`).
            None => {
                let mut splits = Vec::with_capacity(kernels.decode.len());
                for (((function, kernel), &max), preferred) in kernels
                    .decode
                    .iter()
                    .zip(&row_pages_max)
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
                    splits.push(if max == 0 {
                        0
                    } else {
                        crate::tune::model::splits(resident, gpu.multiprocessors, rows, max)
                    });
                }
                splits
            }
        };
        let (slot_bases, slot_count) = abi::slot_bases(&splits);
        let layout = kernels.merge.1.partials;
        let rows_out = sequences * self.q_heads;
        let d = kernels.format.head_dim() as usize;
        let stream = &gpu.stream;
        let grow = |buffer: &mut CudaSlice<f32>, len: usize, what: &'static str| {
            if buffer.len() < len {
                *buffer =
                    (stream.alloc_zeros::<f32>(len)).during(|| format!("allocating {what}"))?;
            }
            Ok::<(), CudaError>(())
        };
        grow(&mut self.queries, rows_out * d, "queries")?;
        let records = layout.len(sequences, self.q_heads, slot_count as usize);
        grow(&mut self.partials, records, "partials")?;
        grow(&mut self.output, rows_out * d, "the output")?;
        grow(&mut self.lse, rows_out, "the log-sum-exp")?;
        self.splits = splits;
        self.slot_bases = slot_bases;
        self.slot_count = slot_count;
        self.generation = cache.generation;
        Ok(())
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

    /// Partials the merge combines into each output row: every tier's splits.
    pub fn slots(&self) -> u32 {
        self.slot_count
    }

    /// Whether the splits were planned for the cache's current page lists
    /// (a fixed step: for its number of sequences).
    pub fn planned_for(&self, cache: &DeviceCache) -> bool {
        self.cache == cache.id && (self.fixed.is_some() || self.generation == cache.generation)
    }

    /// [`check_cache`](Self::check_cache), and planned for its page lists.
    fn check_planned(&self, cache: &DeviceCache) -> Result<(), CudaError> {
        self.check_cache(cache)?;
        match self.planned_for(cache) {
            true => Ok(()),
            false => Err(CudaError::Shape(
                "the device cache's page lists changed since the decode step was planned".into(),
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
        let mut part = self.queries.slice_mut(0..queries.len());
        gpu.stream
            .memcpy_htod(queries, &mut part)
            .during(|| "uploading queries".into())
    }

    /// The step's launches captured as a CUDA graph on the GPU's stream
    /// (thread-local capture mode), uploaded: `launch()` replays the step as
    /// [`launch`](Self::launch) runs it (a [`fixed`](Self::fixed) step's
    /// graph stays right while the page lists change).
    pub fn capture(
        &mut self,
        gpu: &Gpu,
        kernels: &FormatKernels,
        cache: &DeviceCache,
    ) -> Result<CudaGraph, CudaError> {
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        gpu.stream
            .begin_capture(mode)
            .during(|| "capturing a decode step".into())?;
        let launched = self.launch(gpu, kernels, cache);
        // The capture ends whether or not the launches went in.
        let captured = gpu
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .during(|| "capturing a decode step".into())?;
        launched?;
        let graph =
            captured.ok_or_else(|| CudaError::Shape("the captured decode step is empty".into()))?;
        graph
            .upload()
            .during(|| "uploading a captured decode step".into())?;
        Ok(graph)
    }

    /// Fills output and partials with NaN, so an element no kernel writes shows.
    pub fn poison(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        for buffer in [&mut self.output, &mut self.partials, &mut self.lse] {
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
        self.launch_beside(gpu, kernels, cache, None)
    }

    /// [`launch`](Self::launch), with tier `side.tier`'s kernel on
    /// `side.stream` beside the others: that stream first waits for the
    /// main stream's work so far, and the merge waits for it.
    pub fn launch_beside(
        &mut self,
        gpu: &Gpu,
        kernels: &FormatKernels,
        cache: &DeviceCache,
        side: Option<SideLaunch>,
    ) -> Result<(), CudaError> {
        self.launch_io(gpu, kernels, cache, side, None)
    }

    /// [`launch_beside`](Self::launch_beside) reading the queries from and
    /// writing the output and log-sum-exp to `io`'s buffers instead of the
    /// step's own (`None`: the step's). Nothing is allocated, copied from the
    /// host or waited for: the launches can be captured in a CUDA graph.
    pub fn launch_io(
        &mut self,
        gpu: &Gpu,
        kernels: &FormatKernels,
        cache: &DeviceCache,
        side: Option<SideLaunch>,
        io: Option<StepIo>,
    ) -> Result<(), CudaError> {
        self.check_planned(cache)?;
        let stream = &gpu.stream;
        let own = StepIo {
            queries: self.queries.device_ptr(stream).0,
            output: self.output.device_ptr(stream).0,
            lse: self.lse.device_ptr(stream).0,
        };
        let io = io.unwrap_or(own);
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
        if let Some(selection) = &cache.selection {
            let t = selection.tier;
            let lists = (&cache.page_offsets[t], &cache.page_ids[t]);
            selection.select(gpu, io.queries, lists, sequences, kv_heads, q_heads)?;
        }
        if let Some(side) = &side {
            side.ready
                .record(&gpu.stream)
                .during(|| "recording an event".into())?;
            side.stream
                .wait(side.ready)
                .during(|| "ordering streams".into())?;
        }
        for (t, (function, kernel)) in kernels.decode.iter().enumerate() {
            let splits = self.splits[t];
            if splits == 0 || sequences == 0 {
                continue;
            }
            let launch = kernel.launch(splits, kv_heads, sequences);
            let stream = match &side {
                Some(side) if side.tier == t => side.stream,
                _ => &gpu.stream,
            };
            let (offsets, ids) = match &cache.selection {
                Some(selection) if selection.tier == t => selection.lists(),
                _ => (&cache.page_offsets[t], &cache.page_ids[t]),
            };
            let mut args = stream.launch_builder(function);
            args.arg(&cache.pools[t])
                .arg(offsets)
                .arg(ids)
                .arg(&cache.tables[t])
                .arg(&io.queries)
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
        if let Some(side) = &side {
            side.done
                .record(side.stream)
                .during(|| "recording an event".into())?;
            gpu.stream
                .wait(side.done)
                .during(|| "ordering streams".into())?;
        }
        if sequences > 0 {
            let (function, kernel) = &kernels.merge;
            let launch = kernel.launch(q_heads, sequences);
            // After a wait on another stream the merge follows that wait,
            // not one kernel: no programmatic dependent launch.
            let dependent = gpu.target().dependent_launches() && side.is_none();
            self.launch_merge(gpu, function, launch, dependent, io)
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
        io: StepIo,
    ) -> Result<(), DriverError> {
        let stream = &gpu.stream;
        stream.context().bind_to_thread()?;
        let (partials, _reading) = self.partials.device_ptr(stream);
        let (output, lse) = (io.output, io.lse);
        let (q_heads, slot_count) = (self.q_heads as u32, self.slot_count);
        // abi::MERGE_PARAMS in order: three pointers, two u32.
        let mut params: [*mut c_void; 5] = [
            (&partials as *const sys::CUdeviceptr).cast_mut().cast(),
            (&output as *const sys::CUdeviceptr).cast_mut().cast(),
            (&lse as *const sys::CUdeviceptr).cast_mut().cast(),
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
        let len = cache.sequences * self.q_heads * head_dim;
        download(gpu, &self.output, len, "the output")
    }

    /// Waits for the step and downloads the `[sequence][q_head]` log-sum-exp
    /// of every row's scaled logits.
    pub fn lse(&self, gpu: &Gpu, cache: &DeviceCache) -> Result<Vec<f32>, CudaError> {
        self.check_cache(cache)?;
        download(
            gpu,
            &self.lse,
            cache.sequences * self.q_heads,
            "the log-sum-exp",
        )
    }
}

/// The first `len` values of `buffer`, after the stream's work so far.
fn download(
    gpu: &Gpu,
    buffer: &CudaSlice<f32>,
    len: usize,
    what: &'static str,
) -> Result<Vec<f32>, CudaError> {
    let mut out = vec![0.0f32; len];
    if len > 0 {
        let part = buffer.slice(0..len);
        (gpu.stream.memcpy_dtoh(&part, &mut out)).during(|| format!("downloading {what}"))?;
        gpu.stream
            .synchronize()
            .during(|| format!("downloading {what}"))?;
    }
    Ok(out)
}
