//! The live cache on the GPU: exact sinks and tail in pages of the serving
//! format's exact tier (`live::serving_format`), whole pages compressed by
//! the generated page encoders as they leave the window, and one decode step
//! over every tier merged by log-sum-exp. The host keeps the bookkeeping
//! (which page holds which tokens), the device every byte of K/V: pages are
//! compressed from the exact pages in the same stream, with no round trip.
//!
//! An append is planned first (slots, header counts, compress jobs,
//! capacity) on copies of the appended sequences' exact pages and of the
//! pools, so a call that fails changes nothing and the host's work per step
//! does not grow with the cache.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{
    CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, DevicePtr, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use kvcc_compiler::back::ptx::{self, abi};
use kvcc_compiler::page::PageRef;
use kvcc_compiler::Format;

use super::encode::PageEncoders;
use super::resident::SideLaunch;
use super::resident::StepIo;
use super::{CudaError, DeviceCache, DeviceDecode, During, FormatKernels, Gpu};
use crate::cache::Tables;
use crate::encode::TrainOptions;
use crate::live::{
    check_exact, check_kv, serving_format, train_tables, Append, Attention, CachePolicy, LiveError,
    LiveKv, PagePool, SequenceKv, ServingFormat,
};
use crate::tune::{lookup, ShapeBucket};

/// How a [`DeviceLiveCache`] is shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// An append, planned without touching the books: the appended sequences'
/// new exact parts, the pages compressed, the pool after it, and the
/// device rounds.
struct Plan {
    touched: Vec<(usize, ExactPart)>,
    /// (sequence, kv head, page) in token order.
    compressed: Vec<(usize, usize, PageRef)>,
    pool: PagePool,
    /// Whether any page list changes (a page allocated or compressed).
    changed: bool,
    rounds: Vec<Round>,
}

/// One batch of device work: append kernel rows and headers, then compress jobs.
#[derive(Debug, Default)]
struct Round {
    /// (source row, exact item) pairs.
    rows: Vec<[u32; 2]>,
    /// (exact page, count) pairs.
    headers: Vec<[u32; 2]>,
    /// (exact page, compressed page, kv head) triples, into the policy's tier.
    jobs: Vec<[u32; 3]>,
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
        let device = DeviceCache::with_capacity(
            &gpu,
            &kernels,
            kv_heads,
            options.max_sequences,
            &capacities,
            &all_tables,
        )?;
        // A row's compressed pages are bounded by the pool, its exact ones by the policy.
        let mut row_pages = vec![options.pages_per_tier as u32; tiers];
        row_pages.push(exact_pages_per_row as u32);
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

    /// Appends tokens whose K/V are on the device: `keys` and `values` hold,
    /// for each entry of `batch` in order, `[kv_head][token][head_dim]` f32.
    pub fn append_device(
        &mut self,
        keys: &CudaView<f32>,
        values: &CudaView<f32>,
        batch: &[DeviceAppend],
    ) -> Result<(), LiveError> {
        self.check_batch(batch.iter().map(|a| a.sequence))?;
        let rows: usize = batch.iter().map(|a| a.tokens * self.kv_heads).sum();
        let d = self.format.head_dim() as usize;
        for (what, data) in [("keys", keys), ("values", values)] {
            if data.len() != rows * d {
                return Err(LiveError::Device(format!(
                    "{what} hold {} values; the batch's {rows} rows need {}",
                    data.len(),
                    rows * d
                )));
            }
        }
        let new: Vec<(usize, usize)> = batch.iter().map(|a| (a.sequence, a.tokens)).collect();
        let stream = &self.gpu.stream;
        let (keys, values) = (keys.device_ptr(stream).0, values.device_ptr(stream).0);
        self.run_append(keys, values, abi::RowDtype::F32, &new)
    }

    /// Appends tokens whose K/V lie in device memory the caller owns (a
    /// framework's tensors): `keys` and `values` hold, for each entry of
    /// `batch` in order, `[kv_head][token][head_dim]` rows of `input`.
    /// Nothing is checked for NaN here (the caller's tensors are not read on
    /// the host); rows are rounded to the exact dtype as the CPU rounds them.
    ///
    /// # Safety
    /// `keys` and `values` must be device pointers of this cache's context,
    /// each to `len` readable elements of `input` that stay unchanged until
    /// the work enqueued now is done (order the caller's stream with
    /// [`on_stream`](Self::on_stream)).
    pub unsafe fn append_rows(
        &mut self,
        keys: sys::CUdeviceptr,
        values: sys::CUdeviceptr,
        len: usize,
        input: abi::RowDtype,
        batch: &[DeviceAppend],
    ) -> Result<(), LiveError> {
        self.check_batch(batch.iter().map(|a| a.sequence))?;
        let new: Vec<(usize, usize)> = batch.iter().map(|a| (a.sequence, a.tokens)).collect();
        self.check_rows(len, &new)?;
        self.run_append(keys, values, input, &new)
    }

    /// Adds sequences whose prompts lie in device memory (see
    /// [`append_rows`](Self::append_rows)): `tokens[i]` tokens of new
    /// sequence `i`, `[sequence][kv_head][token][head_dim]` in `keys` and
    /// `values`. Returns their indices.
    ///
    /// # Safety
    /// As for [`append_rows`](Self::append_rows).
    pub unsafe fn prefill_rows(
        &mut self,
        keys: sys::CUdeviceptr,
        values: sys::CUdeviceptr,
        len: usize,
        input: abi::RowDtype,
        tokens: &[usize],
    ) -> Result<Vec<usize>, LiveError> {
        let first = self.books.sequences.len();
        self.check_room(tokens.len())?;
        let new: Vec<(usize, usize)> = (tokens.iter().enumerate())
            .map(|(i, &n)| (first + i, n))
            .collect();
        self.check_rows(len, &new)?;
        self.run_append(keys, values, input, &new)?;
        Ok((first..first + tokens.len()).collect())
    }

    /// Refuses device K/V whose length is not the batch's rows.
    fn check_rows(&self, len: usize, new: &[(usize, usize)]) -> Result<(), LiveError> {
        let rows: usize = new.iter().map(|&(_, n)| n * self.kv_heads).sum();
        let d = self.format.head_dim() as usize;
        if len != rows * d {
            return Err(LiveError::Device(format!(
                "keys and values hold {len} values each; the batch's {rows} rows need {}",
                rows * d
            )));
        }
        Ok(())
    }

    fn check_room(&self, new: usize) -> Result<(), LiveError> {
        let total = self.books.sequences.len() + new;
        if total > self.max_sequences {
            return Err(LiveError::Device(format!(
                "{total} sequences would exceed the cache's {} (max_sequences)",
                self.max_sequences
            )));
        }
        Ok(())
    }

    /// Plans `new` (sequence, tokens) in batch order, then runs the rounds
    /// over source rows `[entry][kv_head][token]` of `keys`/`values`
    /// (elements of `input`).
    fn run_append(
        &mut self,
        keys: sys::CUdeviceptr,
        values: sys::CUdeviceptr,
        input: abi::RowDtype,
        new: &[(usize, usize)],
    ) -> Result<(), LiveError> {
        if capturing(&self.gpu.stream)? {
            return Err(LiveError::Device(
                "an append cannot be captured in a CUDA graph (it is planned on the host): \
                 append outside the graph and replay the captured attend"
                    .into(),
            ));
        }
        let plan = self.plan(new)?;
        let rounds = &plan.rounds;
        let lists_len: usize = rounds
            .iter()
            .map(|r| 2 * r.rows.len() + 2 * r.headers.len() + 3 * r.jobs.len())
            .sum();
        let mut host = Vec::with_capacity(lists_len);
        for r in rounds {
            host.extend(r.rows.iter().flatten());
            host.extend(r.headers.iter().flatten());
            host.extend(r.jobs.iter().flatten());
        }
        // A step that only appends rows into pages already listed goes to the
        // side stream, where the exact tier's decode kernel follows it beside
        // the other tiers' (`launch_decode`); anything else runs in order on
        // the main stream, after whatever the side stream still holds.
        let steady = !plan.changed
            && rounds.iter().all(|r| r.jobs.is_empty())
            && self.lists.len() >= host.len();
        let main = self.gpu.stream.clone();
        let stream = if steady {
            (self.side_ready.record(&main))
                .and_then(|()| self.side.wait(&self.side_ready))
                .during(|| "ordering streams".into())?;
            self.side.clone()
        } else {
            self.join_side()?;
            main.clone()
        };
        if self.lists.len() < host.len() {
            self.lists = (stream.alloc_zeros::<u32>(host.len() + host.len() / 2))
                .during(|| "allocating append lists".into())?;
        }
        if !host.is_empty() {
            let mut part = self.lists.slice_mut(0..host.len());
            (stream.memcpy_htod(&host, &mut part)).during(|| "uploading append lists".into())?;
        }
        let exact = self.serving.exact_tier;
        let tier = self.policy.tier;
        let mut at = 0usize;
        for r in rounds {
            let rows = self.lists.slice(at..at + 2 * r.rows.len().max(1));
            at += 2 * r.rows.len();
            let headers = self.lists.slice(at..at + 2 * r.headers.len().max(1));
            at += 2 * r.headers.len();
            let jobs_at = at;
            at += 3 * r.jobs.len();
            let (function, kernel) = &self.append_kernels[input as usize];
            let launch = kernel.launch(r.rows.len() as u32, r.headers.len() as u32);
            let (row_count, header_count) = (r.rows.len() as u32, r.headers.len() as u32);
            if row_count + header_count > 0 {
                let mut args = stream.launch_builder(function);
                args.arg(self.device.pool_mut(exact))
                    .arg(&keys)
                    .arg(&values)
                    .arg(&rows)
                    .arg(&row_count)
                    .arg(&headers)
                    .arg(&header_count);
                // SAFETY: arguments follow abi::APPEND_PARAMS in order and
                // type; every source row and exact item was planned inside
                // its buffer.
                unsafe { args.launch(super::resident::config(launch)) }
                    .during(|| format!("launching {}", kernel.name))?;
            }
            if !r.jobs.is_empty() {
                let jobs = self.lists.slice(jobs_at..jobs_at + 3 * r.jobs.len());
                let (source, target, tables) = self.device.encode_buffers(exact, tier);
                self.encoders.launch(
                    &self.gpu,
                    tier,
                    source,
                    target,
                    tables,
                    &jobs,
                    r.jobs.len() as u32,
                )?;
            }
        }
        if steady {
            self.beside.store(true, Ordering::Release);
        }
        let Plan {
            touched,
            compressed,
            pool,
            changed,
            ..
        } = plan;
        for (sequence, part) in touched {
            match self.books.sequences.get_mut(sequence) {
                Some(s) => s.exact = part,
                None => self.books.sequences.push(Sequence {
                    exact: part,
                    pages: vec![Vec::new(); self.kv_heads],
                }),
            }
        }
        for (sequence, h, page) in compressed {
            self.books.sequences[sequence].pages[h].push(page);
        }
        self.books.pool = pool;
        if changed {
            let tables: Vec<Vec<Vec<PageRef>>> = (self.books.sequences.iter())
                .map(|s| self.row_pages(s))
                .collect();
            self.device.set_page_lists(&self.gpu, &tables)?;
        }
        Ok(())
    }

    /// Where every new row goes, planned on copies of the appended
    /// sequences' exact parts and of the pool: the plan, or the first error
    /// (nothing changed). New entries past the last sequence are new
    /// sequences, in order.
    fn plan(&self, new: &[(usize, usize)]) -> Result<Plan, LiveError> {
        let mut pool = self.books.pool.clone();
        let mut changed = false;
        let mut compressed = Vec::new();
        let items = self.format.spec().page.items as usize;
        let (exact, tier) = (self.serving.exact_tier, self.policy.tier);
        let kv_heads = self.kv_heads;
        let most = new.iter().map(|&(_, n)| n).max().unwrap_or(0);
        let mut rounds = Vec::new();
        // Source rows: entry e's rows start after the earlier entries'.
        let mut first_row = Vec::with_capacity(new.len());
        let mut next = 0usize;
        let mut touched = Vec::with_capacity(new.len());
        for &(sequence, tokens) in new {
            first_row.push(next);
            next += tokens * kv_heads;
            let part = match self.books.sequences.get(sequence) {
                Some(s) => s.exact.clone(),
                None => {
                    changed = true;
                    ExactPart::new(kv_heads)
                }
            };
            touched.push((sequence, part));
        }
        // Rounds of at most a page of tokens per sequence: before a round
        // the tail holds fewer than window + items tokens, so each round
        // compresses at most one page per kv head, and exact pages freed in
        // one round are free for the next (the stream orders them).
        for start in (0..most).step_by(items) {
            let mut round = Round::default();
            let mut freed = Vec::new();
            for (e, &(sequence, tokens)) in new.iter().enumerate() {
                let end = tokens.min(start + items);
                if start >= end {
                    continue;
                }
                let s = &mut touched[e].1;
                let mut touched: Vec<(usize, bool)> = Vec::new();
                for i in start..end {
                    let t = s.tokens;
                    let sink = t < self.policy.sinks;
                    let (list, at) = if sink {
                        (&mut s.sinks, t)
                    } else {
                        (&mut s.tail, s.tail_tokens)
                    };
                    let index = at / items;
                    for (h, pages) in list.iter_mut().enumerate() {
                        if pages.len() == index {
                            let page = allocate(&mut pool, exact, &self.serving.format)?;
                            pages.push(page);
                            changed = true;
                        }
                        let row = first_row[e] + h * tokens + i;
                        let slot = pages[index] as usize * items + at % items;
                        round.rows.push([row as u32, slot as u32]);
                    }
                    if touched.last() != Some(&(index, sink)) {
                        touched.push((index, sink));
                    }
                    s.tokens += 1;
                    if !sink {
                        s.tail_tokens += 1;
                    }
                }
                let sink_tokens = s.tokens.min(self.policy.sinks);
                for (index, sink) in touched {
                    let (list, held) = if sink {
                        (&s.sinks, sink_tokens)
                    } else {
                        (&s.tail, s.tail_tokens)
                    };
                    let count = (held - index * items).min(items) as u32;
                    for pages in list {
                        round.headers.push([pages[index], count]);
                    }
                }
                if s.tail_tokens >= self.policy.window + items {
                    for h in 0..kv_heads {
                        let source = s.tail[h].remove(0);
                        let target = allocate(&mut pool, tier, &self.format)?;
                        round.jobs.push([source, target, h as u32]);
                        let page = PageRef {
                            tier: tier as u32,
                            page: target,
                        };
                        compressed.push((sequence, h, page));
                        freed.push(source);
                        changed = true;
                    }
                    s.tail_tokens -= items;
                }
            }
            for page in freed {
                pool.release(PageRef {
                    tier: exact as u32,
                    page,
                });
            }
            rounds.push(round);
        }
        Ok(Plan {
            touched,
            compressed,
            pool,
            changed,
            rounds,
        })
    }

    /// Checks host K/V entries (`[kv_head][token][head_dim]` each), uploads
    /// them to the staging buffers and appends them.
    fn append_host(&mut self, entries: &[(usize, &[f32], &[f32])]) -> Result<(), LiveError> {
        let mut new = Vec::with_capacity(entries.len());
        let mut host = [Vec::new(), Vec::new()];
        for &(sequence, k, v) in entries {
            let tokens = check_kv(&self.format, self.kv_heads, k, v)?;
            check_exact(self.policy.exact, k, v)?;
            host[0].extend_from_slice(k);
            host[1].extend_from_slice(v);
            new.push((sequence, tokens));
        }
        let len = host[0].len().max(1);
        let stream = self.gpu.stream.clone();
        let mut staged = match self.staged.take() {
            Some(buffers) if buffers[0].len() >= len => buffers,
            _ => {
                let alloc =
                    || (stream.alloc_zeros::<f32>(len)).during(|| "allocating staged K/V".into());
                [alloc()?, alloc()?]
            }
        };
        for (buffer, data) in staged.iter_mut().zip(&host) {
            if !data.is_empty() {
                let mut part = buffer.slice_mut(0..data.len());
                (stream.memcpy_htod(data, &mut part)).during(|| "uploading K/V".into())?;
            }
        }
        let (keys, values) = (
            staged[0].device_ptr(&stream).0,
            staged[1].device_ptr(&stream).0,
        );
        let result = self.run_append(keys, values, abi::RowDtype::F32, &new);
        self.staged = Some(staged);
        result
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

/// A page of `tier`, or the capacity error.
fn allocate(pool: &mut PagePool, tier: usize, format: &Format) -> Result<u32, LiveError> {
    if pool.available(tier) == 0 {
        let name = (format.spec().tiers.get(tier)).map_or("exact", |t| t.name.as_str());
        return Err(LiveError::Capacity {
            tier: name.to_string(),
            needed: 1,
            available: 0,
            capacity: pool.capacity(tier),
        });
    }
    Ok(pool.allocate(tier).page)
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

    fn set_tier(&mut self, tier: usize) -> Result<(), LiveError> {
        let tiers = self.format.tiers().len();
        if tier >= tiers {
            return Err(crate::encode::EncodeError::UnknownTier { tier, tiers }.into());
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
