//! The live cache on the GPU: exact sinks and tail in pages of the serving
//! format's exact tier (`live::serving_format`), whole pages compressed by
//! the generated page encoders as they leave the window, and one decode step
//! over every tier merged by log-sum-exp. The host keeps the bookkeeping
//! (which page holds which tokens), the device every byte of K/V: pages are
//! compressed from the exact pages in the same stream, with no round trip.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use kvcc_compiler::back::ptx::{self, abi};
use kvcc_compiler::page::PageRef;
use kvcc_compiler::Format;

use super::encode::PageEncoders;
use super::resident::SideLaunch;
use super::resident::StepIo;
use super::{CudaError, DeviceCache, DeviceDecode, DeviceSelection, During, FormatKernels, Gpu};
use crate::cache::Tables;
use crate::encode::TrainOptions;
use crate::live::{
    serving_format, train_tables, Append, Attention, CachePolicy, LiveError, LiveKv, PagePool,
    SequenceKv, ServingFormat,
};
use crate::tune::{lookup, ShapeBucket};

mod append;

/// How a [`DeviceLiveCache`] is shaped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceLiveOptions {
    pub policy: CachePolicy,
    pub kv_heads: usize,
    /// Most sequences held at once: sizes the exact tier's pool.
    pub max_sequences: usize,
    /// Page slots of every compressed tier's pool (each kv head's page takes one).
    pub pages_per_tier: usize,
    /// The context the kernels' configurations are looked up for (tune cache).
    pub context: usize,
    /// Query heads the decode kernels are generated for (a multiple of
    /// kv_heads); [`DeviceLiveCache::attend_into`] reloads them for others.
    pub q_heads: usize,
    /// Decode steps planned once for capacity (`max_sequences`, full pools)
    /// with every tier launched, instead of re-planned whenever a page fills:
    /// a step captured in a CUDA graph then stays valid across appends.
    pub fixed_plan: bool,
}

/// One sequence's exact pages, per kv head: what an append plans on a copy
/// of (a few pages, whatever the sequence's length).
#[derive(Debug, Clone, PartialEq, Eq)]
struct ExactPart {
    tokens: usize,
    /// Exact pages of the first `sinks` tokens.
    sinks: Vec<Vec<u32>>,
    /// Exact pages of the tail: tail token `j` is item `j % items` of page
    /// `tail[j / items]`.
    tail: Vec<Vec<u32>>,
    tail_tokens: usize,
}

impl ExactPart {
    fn new(kv_heads: usize) -> ExactPart {
        ExactPart {
            tokens: 0,
            sinks: vec![Vec::new(); kv_heads],
            tail: vec![Vec::new(); kv_heads],
            tail_tokens: 0,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Sequence {
    exact: ExactPart,
    /// Compressed pages per kv head, in token order.
    pages: Vec<Vec<PageRef>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Books {
    sequences: Vec<Sequence>,
    pool: PagePool,
}

/// New tokens of one sequence whose K/V already lie on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAppend {
    pub sequence: usize,
    pub tokens: usize,
}

pub struct DeviceLiveCache {
    gpu: Arc<Gpu>,
    format: Format,
    serving: ServingFormat,
    kernels: FormatKernels,
    /// What the kernels were loaded for: the tuned configurations and the
    /// query group (reloaded for another group by `attend_into`).
    configs: Vec<crate::tune::KernelConfig>,
    group: u32,
    /// One append kernel per row dtype, in `abi::RowDtype::ALL` order.
    append_kernels: Vec<(CudaFunction, abi::AppendKernel)>,
    encoders: PageEncoders,
    device: DeviceCache,
    decode: Mutex<Option<DeviceDecode>>,
    /// `Some(most pages of a row per tier)` when steps are planned for capacity.
    fixed: Option<Vec<u32>>,
    /// Steps and kernels replaced while a CUDA graph may still hold their
    /// buffers and functions: kept until the cache is dropped.
    retired: Vec<(Option<DeviceDecode>, Option<FormatKernels>)>,
    /// Ordering against a caller's stream (`on_stream`).
    enter: CudaEvent,
    leave: CudaEvent,
    tables: Tables,
    policy: CachePolicy,
    kv_heads: usize,
    max_sequences: usize,
    books: Books,
    /// Staged host K/V (`[row][head_dim]` f32 keys, values; taken while
    /// an append reads them) and the rounds' u32 lists.
    staged: Option<[CudaSlice<f32>; 2]>,
    lists: CudaSlice<u32>,
    /// The stream appends of rows into listed pages run on, and the exact
    /// tier's decode kernel after them, beside the other tiers' kernels;
    /// whether it holds work the main stream has not waited for yet.
    side: Arc<CudaStream>,
    side_ready: CudaEvent,
    side_done: CudaEvent,
    beside: AtomicBool,
    _modules: Vec<Arc<CudaModule>>,
}

impl Drop for DeviceLiveCache {
    /// Buffers are freed in the main stream's order: the side stream's work
    /// must be done first.
    fn drop(&mut self) {
        let _ = self.side.synchronize();
    }
}

impl std::fmt::Debug for DeviceLiveCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceLiveCache")
            .field("format", &self.format.name())
            .field("policy", &self.policy)
            .field("kv_heads", &self.kv_heads)
            .field("books", &self.books)
            .finish()
    }
}

impl DeviceLiveCache {
    /// An empty cache on `gpu` with given `tables` (`[tier][kv_head][table]`).
    pub fn new(
        gpu: Arc<Gpu>,
        format: &Format,
        options: &DeviceLiveOptions,
        tables: Tables,
    ) -> Result<DeviceLiveCache, LiveError> {
        let tiers = format.tiers().len();
        let policy = options.policy;
        if policy.tier >= tiers {
            return Err(LiveError::PolicyTier {
                tier: policy.tier,
                tiers,
            });
        }
        if policy.budget.is_some() {
            return Err(LiveError::Device(
                "[cache.budget] runs on the CPU live cache: the GPU live cache has no controller \
                 kernels yet"
                    .to_string(),
            ));
        }
        let kv_heads = options.kv_heads;
        crate::cache::PagedCache::new(format, kv_heads, tables.clone())?;
        let serving = serving_format(format, policy.exact).map_err(|e| {
            LiveError::Device(format!("the serving format of {}: {e}", format.name()))
        })?;
        if options.q_heads == 0 || !options.q_heads.is_multiple_of(kv_heads.max(1)) {
            return Err(LiveError::Device(format!(
                "{} query heads is not a positive multiple of {kv_heads} kv heads",
                options.q_heads
            )));
        }
        let group = (options.q_heads / kv_heads) as u32;
        let shape = ShapeBucket::of(
            options.max_sequences,
            options.q_heads,
            kv_heads,
            options.context,
        );
        let machine = gpu.machine();
        let mut configs =
            lookup::resolve_default(&gpu.id(), machine, &serving.format, shape).configs;
        let items = format.spec().page.items;
        for (tier, config) in configs.iter_mut().enumerate() {
            if config.page_items != items {
                *config = crate::tune::model::config_at(&serving.format, tier, shape, machine);
            }
        }
        let kernels = FormatKernels::load_configs(&gpu, &serving.format, &configs, group)?;
        let exact_layout = serving.format.layout(serving.exact_tier);
        let mut modules = Vec::new();
        let mut append_kernels = Vec::new();
        for input in abi::RowDtype::ALL {
            let (append_ptx, append) =
                ptx::write_append(format.name(), exact_layout, input, gpu.target())
                    .map_err(|e| LiveError::Device(e.to_string()))?;
            let module = (gpu.context.load_module(Ptx::from_src(append_ptx)))
                .during(|| format!("loading the append kernel of {}", format.name()))?;
            let function = (module.load_function(&append.name))
                .during(|| format!("finding kernel {}", append.name))?;
            modules.push(module);
            append_kernels.push((function, append));
        }
        let encoders = PageEncoders::load(&gpu, format, exact_layout)?;
        let items = items as usize;
        let exact_pages_per_row = policy.sinks.div_ceil(items) + policy.window.div_ceil(items) + 2;
        let mut capacities = vec![options.pages_per_tier; tiers];
        capacities.push(options.max_sequences * kv_heads * exact_pages_per_row);
        let mut all_tables: Vec<&[Vec<Vec<f32>>]> = tables.iter().map(Vec::as_slice).collect();
        let exact_tables = vec![Vec::new(); kv_heads];
        all_tables.push(&exact_tables);
        let mut device = DeviceCache::with_capacity(
            &gpu,
            &kernels,
            kv_heads,
            options.max_sequences,
            &capacities,
            &all_tables,
        )?;
        // A row's compressed pages are bounded by the pool (where it selects,
        // by the budget), its exact ones by the policy.
        let mut row_pages = vec![options.pages_per_tier as u32; tiers];
        row_pages.push(exact_pages_per_row as u32);
        if let Some(layout) = policy.select {
            let selection = DeviceSelection::new(
                &gpu,
                format.name(),
                layout,
                exact_layout,
                policy.tier,
                options.pages_per_tier,
                options.max_sequences * kv_heads,
                group,
            )?;
            row_pages[policy.tier] = selection.read_of(row_pages[policy.tier]);
            device.attach_selection(&gpu, selection, &[])?;
        }
        let lists =
            (gpu.stream.alloc_zeros::<u32>(4)).during(|| "allocating append lists".into())?;
        let side = (gpu.stream.fork()).during(|| "creating the side stream".into())?;
        let event = || {
            (gpu.context
                .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING)))
            .during(|| "creating an event".into())
        };
        let (side_ready, side_done) = (event()?, event()?);
        let (enter, leave) = (event()?, event()?);
        Ok(DeviceLiveCache {
            format: format.clone(),
            serving,
            kernels,
            configs,
            group,
            append_kernels,
            encoders,
            device,
            decode: Mutex::new(None),
            fixed: options.fixed_plan.then_some(row_pages),
            retired: Vec::new(),
            enter,
            leave,
            tables,
            policy,
            kv_heads,
            max_sequences: options.max_sequences,
            books: Books {
                sequences: Vec::new(),
                pool: PagePool::with_capacities(capacities),
            },
            staged: None,
            lists,
            side,
            side_ready,
            side_done,
            beside: AtomicBool::new(false),
            _modules: modules,
            gpu,
        })
    }

    /// Trains every tier's tables on the prompts, then prefills them.
    pub fn train(
        gpu: Arc<Gpu>,
        format: &Format,
        options: &DeviceLiveOptions,
        prompts: &[SequenceKv],
        train: &TrainOptions,
    ) -> Result<(DeviceLiveCache, Vec<usize>), LiveError> {
        let tables = train_tables(format, options.kv_heads, prompts, train)?;
        let mut live = DeviceLiveCache::new(gpu, format, options, tables)?;
        let indices = live.prefill(prompts)?;
        Ok((live, indices))
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn tables(&self) -> &Tables {
        &self.tables
    }

    /// The format the kernels run: the spec's tiers and the exact tier.
    pub fn serving(&self) -> &ServingFormat {
        &self.serving
    }

    /// Pages of every tier in use (the exact tier last).
    pub fn pages_in_use(&self) -> Vec<usize> {
        (0..=self.format.tiers().len())
            .map(|t| self.books.pool.used(t))
            .collect()
    }

    /// Bytes a decode step reads now: every referenced page and every table.
    pub fn bytes_per_step(&self) -> u64 {
        self.device.bytes_per_step
    }

    /// Page `page` of tier `tier` as the device holds it (tests compare it
    /// with the CPU encoder).
    pub fn page_bytes(&self, tier: usize, page: u32) -> Result<Vec<u8>, LiveError> {
        let size = self.kernels.decode[tier].1.page_bytes as usize;
        let at = page as usize * size;
        let pool = self.device.pool(tier);
        if at + size > pool.len() {
            return Err(LiveError::Device(format!(
                "page {page} is outside tier {tier}'s pool"
            )));
        }
        let mut out = vec![0u8; size];
        let stream = &self.gpu.stream;
        (stream.memcpy_dtoh(&pool.slice(at..at + size), &mut out))
            .and_then(|()| stream.synchronize())
            .during(|| "downloading a page".into())?;
        Ok(out)
    }

    /// Per kv head of `sequence`: its compressed pages in token order, then
    /// its exact pages (sinks, then tail) as references into the exact tier.
    pub fn page_table(&self, sequence: usize) -> Option<Vec<Vec<PageRef>>> {
        let s = self.books.sequences.get(sequence)?;
        Some(self.row_pages(s))
    }

    fn row_pages(&self, s: &Sequence) -> Vec<Vec<PageRef>> {
        let exact = self.serving.exact_tier as u32;
        (0..self.kv_heads)
            .map(|h| {
                let exact_pages = s.exact.sinks[h].iter().chain(&s.exact.tail[h]);
                (s.pages[h].iter().copied())
                    .chain(exact_pages.map(|&page| PageRef { tier: exact, page }))
                    .collect()
            })
            .collect()
    }

    fn check_batch(&self, sequences: impl Iterator<Item = usize>) -> Result<(), LiveError> {
        crate::live::check_batch(self.books.sequences.len(), sequences)
    }

    /// Uploads `[sequence][q_head][head_dim]` queries (checked) for the
    /// decode steps that follow; plans a step for `q_heads` if needed.
    /// `q_heads` must be the count the loaded kernels serve (the `q_heads`
    /// option, or the last `attend_into`'s): anything else is an error.
    pub fn set_queries(&self, queries: &[f32], q_heads: usize) -> Result<(), LiveError> {
        loaded_group(q_heads, self.kv_heads, self.group)?;
        let mut slot = self.decode.lock().expect("decode lock");
        if !matches!(&*slot, Some(step) if step.q_heads == q_heads) {
            *slot = Some(self.new_step(q_heads)?);
        }
        let step = slot.as_mut().expect("a step was just made");
        if !step.planned_for(&self.device) {
            step.replan(&self.gpu, &self.kernels, &self.device)?;
        }
        step.set_queries(&self.gpu, &self.kernels, &self.device, queries)?;
        Ok(())
    }

    /// A decode step for `q_heads` query heads: planned for capacity when
    /// the cache is (`fixed_plan`), else for the current page lists.
    fn new_step(&self, q_heads: usize) -> Result<DeviceDecode, CudaError> {
        let (gpu, kernels, device) = (&self.gpu, &self.kernels, &self.device);
        match &self.fixed {
            Some(rows) => DeviceDecode::fixed(
                gpu,
                kernels,
                device,
                q_heads,
                rows.clone(),
                self.max_sequences,
            ),
            None => DeviceDecode::new(gpu, kernels, device, q_heads, None),
        }
    }

    /// Runs `work` ordered after everything enqueued so far on `stream` (a
    /// framework's current stream), and makes `stream` wait for all the work
    /// it enqueued, the side stream's included: events, no host wait, so a
    /// call made while `stream` is being captured into a CUDA graph is
    /// captured too (the cache's streams join the capture and leave it
    /// again).
    ///
    /// # Safety
    /// `stream` must be a live stream of this cache's context (the device's
    /// primary context, which torch uses) for the whole call.
    pub unsafe fn on_stream<T>(
        &mut self,
        stream: sys::CUstream,
        work: impl FnOnce(&mut Self) -> Result<T, LiveError>,
    ) -> Result<T, LiveError> {
        // SAFETY: the caller keeps the stream alive for the call; the
        // wrapper does not destroy it.
        let outer = unsafe { self.gpu.context.wrap_borrowed_stream(stream) };
        (self.enter.record(&outer))
            .and_then(|()| self.gpu.stream.wait(&self.enter))
            .during(|| "ordering the cache after the caller's stream".into())?;
        let result = work(self);
        self.join_side()?;
        (self.leave.record(&self.gpu.stream))
            .and_then(|()| outer.wait(&self.leave))
            .during(|| "ordering the caller's stream after the cache".into())?;
        result
    }

    /// One decode step over every sequence on device buffers the caller
    /// owns (`io`): no allocation, no host copy, no host wait once a step
    /// for `q_heads` exists, so it can be captured in a CUDA graph. With
    /// `fixed_plan`, a captured step stays valid while appends fill and
    /// compress pages; it attends the sequences present when it was captured
    /// (re-capture after a prefill or release). The first call for a new
    /// number of query heads (re)loads kernels and plans, outside a capture.
    ///
    /// # Safety
    /// `io`'s pointers must be device buffers of this cache's context of
    /// `sequences * q_heads * head_dim` (queries, output) and
    /// `sequences * q_heads` (log-sum-exp) f32 each, alive until the step is
    /// done.
    pub unsafe fn attend_into(&mut self, io: StepIo, q_heads: usize) -> Result<(), LiveError> {
        let group = query_group(q_heads, self.kv_heads)?;
        let capturing = capturing(&self.gpu.stream)?;
        let slot = self.decode.get_mut().expect("decode lock");
        let ready = matches!(&*slot, Some(step) if step.q_heads == q_heads && step.planned_for(&self.device));
        if !ready || group != self.group {
            if capturing {
                return Err(LiveError::Device(format!(
                    "the first decode step for {q_heads} query heads (or after the page \
                     structure changed, without fixed_plan) plans and loads kernels: run it \
                     once before capturing"
                )));
            }
            if group != self.group {
                let kernels = FormatKernels::load_configs(
                    &self.gpu,
                    &self.serving.format,
                    &self.configs,
                    group,
                )?;
                if let Some(selection) = self.device.selection_mut() {
                    selection.set_group(&self.gpu, group)?;
                }
                let old = std::mem::replace(&mut self.kernels, kernels);
                let step = self.decode.get_mut().expect("decode lock").take();
                self.retired.push((step, Some(old)));
                self.group = group;
            }
            let slot = self.decode.get_mut().expect("decode lock");
            match slot.as_mut() {
                Some(step) if step.q_heads == q_heads => {
                    step.replan(&self.gpu, &self.kernels, &self.device)?
                }
                _ => {
                    let step = self.new_step(q_heads)?;
                    let old = self.decode.get_mut().expect("decode lock").replace(step);
                    self.retired.push((old, None));
                }
            }
        }
        self.join_side()?;
        let step =
            (self.decode.get_mut().expect("decode lock").as_mut()).expect("a step was just made");
        step.launch_io(&self.gpu, &self.kernels, &self.device, None, Some(io))?;
        Ok(())
    }

    /// The pages the last decode step chose per sequence and kv head
    /// (`[sequence][kv_head]`, ascending pool pages of the selected tier in
    /// list order); `None` without `[cache.select]`. Waits for the step.
    pub fn chosen_pages(&self) -> Result<Option<Vec<Vec<Vec<u32>>>>, LiveError> {
        let Some(selection) = self.device.selection() else {
            return Ok(None);
        };
        let rows = selection.chosen(&self.gpu, self.books.sequences.len() * self.kv_heads)?;
        Ok(Some(
            rows.chunks(self.kv_heads.max(1))
                .map(<[_]>::to_vec)
                .collect(),
        ))
    }

    /// The selection summary of page `page` of the selected tier, as the
    /// device holds it; `None` without `[cache.select]`.
    pub fn page_summary(&self, page: u32) -> Result<Option<Vec<u16>>, LiveError> {
        match self.device.selection() {
            Some(selection) => Ok(Some(selection.summary(&self.gpu, page)?)),
            None => Ok(None),
        }
    }

    /// Bumped by every change of the page lists (a page allocated,
    /// compressed or released).
    pub fn generation(&self) -> u64 {
        self.device.generation()
    }

    /// Enqueues one decode step over every sequence with the queries set
    /// last; its output and log-sum-exp stay on the device until
    /// [`attend`](LiveKv::attend) downloads them.
    pub fn launch_decode(&self) -> Result<(), LiveError> {
        let mut slot = self.decode.lock().expect("decode lock");
        let step =
            (slot.as_mut()).ok_or_else(|| LiveError::Device("no queries were set".into()))?;
        if !step.planned_for(&self.device) {
            step.replan(&self.gpu, &self.kernels, &self.device)?;
        }
        if self.beside.swap(false, Ordering::AcqRel) {
            let side = SideLaunch {
                stream: &self.side,
                tier: self.serving.exact_tier,
                ready: &self.side_ready,
                done: &self.side_done,
            };
            step.launch_beside(&self.gpu, &self.kernels, &self.device, Some(side))?;
        } else {
            step.launch(&self.gpu, &self.kernels, &self.device)?;
        }
        Ok(())
    }

    /// Makes the main stream wait for the side stream's outstanding work.
    fn join_side(&self) -> Result<(), CudaError> {
        if self.beside.swap(false, Ordering::AcqRel) {
            (self.side_done.record(&self.side))
                .and_then(|()| self.gpu.stream.wait(&self.side_done))
                .during(|| "ordering streams".into())?;
        }
        Ok(())
    }

    /// The last step's output and log-sum-exp (waits for it).
    fn results(&self) -> Result<Attention, LiveError> {
        let slot = self.decode.lock().expect("decode lock");
        let step = slot
            .as_ref()
            .ok_or_else(|| LiveError::Device("no step was launched".into()))?;
        let d = self.format.head_dim() as usize;
        Ok(Attention {
            outputs: step.output(&self.gpu, &self.device, d)?,
            lse: step.lse(&self.gpu, &self.device)?,
        })
    }
}

/// Query heads per kv head of a step over `q_heads` query heads.
fn query_group(q_heads: usize, kv_heads: usize) -> Result<u32, LiveError> {
    if kv_heads == 0 || q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
        return Err(
            kvcc_compiler::back::interp::DecodeError::Grouping { q_heads, kv_heads }.into(),
        );
    }
    Ok((q_heads / kv_heads) as u32)
}

/// Checks that the decode kernels loaded for query group `loaded` serve
/// `q_heads` query heads: they are generated for one group, and loading
/// others takes `&mut self` (`attend_into` does).
fn loaded_group(q_heads: usize, kv_heads: usize, loaded: u32) -> Result<(), LiveError> {
    let group = query_group(q_heads, kv_heads)?;
    if group != loaded {
        return Err(LiveError::Device(format!(
            "the decode kernels are loaded for {} query heads ({loaded} per kv head), \
             not {q_heads}: attend_into loads kernels for another count (the cache's \
             q_heads option picks the first)",
            loaded as usize * kv_heads
        )));
    }
    Ok(())
}

/// Whether `stream` is being captured into a CUDA graph.
fn capturing(stream: &CudaStream) -> Result<bool, CudaError> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: writes one status; the stream is alive (borrowed).
    unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut status) }
        .result()
        .during(|| "asking whether the stream is captured".into())?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

impl LiveKv for DeviceLiveCache {
    fn format(&self) -> &Format {
        &self.format
    }

    fn policy(&self) -> &CachePolicy {
        &self.policy
    }

    fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    fn lengths(&self) -> Vec<usize> {
        self.books
            .sequences
            .iter()
            .map(|s| s.exact.tokens)
            .collect()
    }

    fn prefill(&mut self, sequences: &[SequenceKv]) -> Result<Vec<usize>, LiveError> {
        let first = self.books.sequences.len();
        self.check_room(sequences.len())?;
        let entries: Vec<(usize, &[f32], &[f32])> = (sequences.iter().enumerate())
            .map(|(i, s)| (first + i, s.keys, s.values))
            .collect();
        self.append_host(&entries)?;
        Ok((first..first + sequences.len()).collect())
    }

    fn append(&mut self, batch: &[Append]) -> Result<(), LiveError> {
        self.check_batch(batch.iter().map(|a| a.sequence))?;
        let entries: Vec<(usize, &[f32], &[f32])> = batch
            .iter()
            .map(|a| (a.sequence, a.keys, a.values))
            .collect();
        self.append_host(&entries)
    }

    fn attend(&self, queries: &[f32], q_heads: usize) -> Result<Attention, LiveError> {
        self.set_queries(queries, q_heads)?;
        self.launch_decode()?;
        self.results()
    }

    fn release(&mut self, sequence: usize) -> Result<(), LiveError> {
        if sequence >= self.books.sequences.len() {
            return Err(LiveError::UnknownSequence {
                sequence,
                sequences: self.books.sequences.len(),
            });
        }
        self.join_side()?;
        let s = self.books.sequences.remove(sequence);
        let exact = self.serving.exact_tier as u32;
        for page in s.pages.into_iter().flatten() {
            self.books.pool.release(page);
        }
        for page in s.exact.sinks.into_iter().chain(s.exact.tail).flatten() {
            self.books.pool.release(PageRef { tier: exact, page });
        }
        let tables: Vec<Vec<Vec<PageRef>>> = (self.books.sequences.iter())
            .map(|s| self.row_pages(s))
            .collect();
        self.device.set_page_lists(&self.gpu, &tables)?;
        Ok(())
    }

    fn observe(&mut self, _queries: &[f32], _q_heads: usize) -> Result<(), LiveError> {
        // A device cache never has a budget (`new` refuses one): nothing to keep.
        Ok(())
    }

    fn set_tier(&mut self, tier: usize) -> Result<(), LiveError> {
        let tiers = self.format.tiers().len();
        if tier >= tiers {
            return Err(crate::encode::EncodeError::UnknownTier { tier, tiers }.into());
        }
        if let Some(selection) = self.device.selection().filter(|s| s.tier != tier) {
            return Err(LiveError::Device(format!(
                "this cache selects among tier {}'s pages ([cache.select]): new pages stay in \
                 that tier",
                selection.tier
            )));
        }
        self.policy.tier = tier;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attend_takes_the_query_heads_its_kernels_serve() {
        assert!(loaded_group(8, 2, 4).is_ok());
        let other = loaded_group(4, 2, 4).unwrap_err().to_string();
        assert!(
            other.contains("loaded for 8 query heads (4 per kv head), not 4")
                && other.contains("attend_into"),
            "{other}"
        );
        assert!(loaded_group(16, 2, 4).is_err());
        for (q_heads, kv_heads) in [(0, 2), (5, 2), (4, 0)] {
            let err = loaded_group(q_heads, kv_heads, 2).unwrap_err().to_string();
            assert!(err.contains("multiple"), "{q_heads}/{kv_heads}: {err}");
        }
        assert_eq!(query_group(8, 2).unwrap(), 4);
    }
}
