//! `[cache.select]` on the device: the summaries of a compressed tier's pages
//! (written beside the page encoder, from the same jobs), and the chosen page
//! lists a decode step reads instead of the tier's full lists. Buffers are
//! sized once for capacity, so a step that selects keeps its grid and its
//! addresses while pages fill: a captured CUDA graph stays valid.

use std::sync::Arc;

use cudarc::driver::{sys, CudaFunction, CudaModule, CudaSlice, CudaView, PushKernelArg};
use cudarc::nvrtc::Ptx;
use kvcc_compiler::back::ptx::{self, select::SelectKernels};
use kvcc_compiler::layout::summary::SummaryLayout;
use kvcc_compiler::layout::TierLayout;

use super::{config, CudaError, During, Gpu};

pub struct DeviceSelection {
    pub layout: SummaryLayout,
    /// The compressed tier whose pages are summarized and chosen.
    pub tier: usize,
    format_name: String,
    exact: TierLayout,
    kernels: SelectKernels,
    functions: [CudaFunction; 3],
    _module: Arc<CudaModule>,
    /// u16 per summary value, `[pool page][values]`.
    summaries: CudaSlice<u16>,
    /// One ordered key per entry of the tier's full page lists.
    scores: CudaSlice<u32>,
    offsets: CudaSlice<u32>,
    ids: CudaSlice<u32>,
    max_rows: usize,
    /// Score CTAs per row.
    slices: u32,
}

impl DeviceSelection {
    /// Selection over tier `tier`'s pool of `pool_pages` pages, for at most
    /// `max_rows` (sequence, kv head) rows and query groups of `group` heads,
    /// summarizing pages from the exact tier laid out as `exact`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        format_name: &str,
        layout: SummaryLayout,
        exact: &TierLayout,
        tier: usize,
        pool_pages: usize,
        max_rows: usize,
        group: u32,
    ) -> Result<DeviceSelection, CudaError> {
        let (module, kernels, functions) = load(gpu, format_name, &layout, exact, group)?;
        let stream = &gpu.stream;
        let alloc = |len: usize, what: &str| {
            (stream.alloc_zeros::<u32>(len.max(1))).during(|| format!("allocating {what}"))
        };
        let summaries = (stream.alloc_zeros::<u16>((pool_pages * layout.values()).max(2)))
            .during(|| "allocating page summaries".into())?;
        let budget = layout.budget_pages as usize;
        // Enough CTAs that every row's pages spread over about four waves' worth.
        let slices = (4 * gpu.multiprocessors).div_ceil(max_rows.max(1) as u32);
        let rows_pages = pool_pages.div_ceil(max_rows.max(1));
        let slices = slices.clamp(
            1,
            rows_pages.div_ceil(kernels.score_threads() as usize).max(1) as u32,
        );
        Ok(DeviceSelection {
            layout,
            tier,
            format_name: format_name.to_string(),
            exact: exact.clone(),
            kernels,
            functions,
            _module: module,
            summaries,
            scores: alloc(pool_pages, "page scores")?,
            offsets: alloc(max_rows + 1, "chosen page offsets")?,
            ids: alloc(max_rows * budget, "chosen pages")?,
            max_rows,
            slices,
        })
    }

    /// Reloads the score kernel for query groups of `group` heads.
    pub fn set_group(&mut self, gpu: &Gpu, group: u32) -> Result<(), CudaError> {
        if group == self.kernels.group {
            return Ok(());
        }
        let (module, kernels, functions) =
            load(gpu, &self.format_name, &self.layout, &self.exact, group)?;
        self._module = module;
        self.kernels = kernels;
        self.functions = functions;
        Ok(())
    }

    /// Writes the summaries of the pages `jobs` (the page encoder's, in
    /// `src_pool`, the exact tier's pool) compress.
    pub fn summarize(
        &mut self,
        gpu: &Gpu,
        src_pool: &CudaSlice<u8>,
        jobs: &CudaView<u32>,
        count: u32,
    ) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(());
        }
        let mut args = gpu.stream.launch_builder(&self.functions[0]);
        args.arg(&mut self.summaries)
            .arg(src_pool)
            .arg(jobs)
            .arg(&count);
        // SAFETY: arguments follow select::SUMMARIZE_PARAMS; every job's
        // pages lie inside the pools (planned by the live cache).
        unsafe { args.launch(config(self.kernels.summarize_launch(count))) }
            .during(|| format!("launching {}", self.kernels.summarize))?;
        Ok(())
    }

    /// Enqueues scoring and choosing for `sequences * kv_heads` rows of the
    /// tier's full lists (`(page_offsets, page_ids)`) with the queries at
    /// `queries` (`f32[sequences][q_heads][head_dim]`).
    pub fn select(
        &self,
        gpu: &Gpu,
        queries: sys::CUdeviceptr,
        (page_offsets, page_ids): (&CudaSlice<u32>, &CudaSlice<u32>),
        sequences: u32,
        kv_heads: u32,
        q_heads: u32,
    ) -> Result<(), CudaError> {
        let rows = sequences * kv_heads;
        if rows == 0 {
            return Ok(());
        }
        if rows as usize > self.max_rows || q_heads != kv_heads * self.kernels.group {
            return Err(CudaError::Shape(format!(
                "page selection is loaded for {} rows and groups of {} query heads, not {rows} \
                 rows of {q_heads} query heads over {kv_heads} kv heads",
                self.max_rows, self.kernels.group
            )));
        }
        let stream = &gpu.stream;
        let (score, choose) = (&self.functions[1], &self.functions[2]);
        let launch = self.kernels.score_launch(self.slices, self.max_rows as u32);
        let mut args = stream.launch_builder(score);
        args.arg(&self.summaries)
            .arg(&queries)
            .arg(page_offsets)
            .arg(page_ids)
            .arg(&self.scores)
            .arg(&rows)
            .arg(&kv_heads);
        // SAFETY: arguments follow select::SCORE_PARAMS; the lists were
        // checked against the pool when set, the scores hold every entry.
        unsafe { args.launch(config(launch)) }
            .during(|| format!("launching {}", self.kernels.score))?;
        let budget = self.layout.budget_pages;
        let mut args = stream.launch_builder(choose);
        args.arg(&self.scores)
            .arg(page_offsets)
            .arg(page_ids)
            .arg(&self.offsets)
            .arg(&self.ids)
            .arg(&rows)
            .arg(&budget);
        // SAFETY: arguments follow select::CHOOSE_PARAMS; the chosen lists
        // hold a budget per row of capacity.
        unsafe { args.launch(config(self.kernels.choose_launch(self.max_rows as u32))) }
            .during(|| format!("launching {}", self.kernels.choose))?;
        Ok(())
    }

    /// The chosen page lists (offsets, pages) in the decode ABI.
    pub fn lists(&self) -> (&CudaSlice<u32>, &CudaSlice<u32>) {
        (&self.offsets, &self.ids)
    }

    /// Most pages a row reads of `listed`.
    pub fn read_of(&self, listed: u32) -> u32 {
        listed.min(self.layout.budget_pages)
    }

    /// The last step's chosen pages of `rows` rows, `[row][page]` (waits).
    pub fn chosen(&self, gpu: &Gpu, rows: usize) -> Result<Vec<Vec<u32>>, CudaError> {
        let stream = &gpu.stream;
        let offsets = (stream.clone_dtoh(&self.offsets.slice(0..rows + 1)))
            .during(|| "downloading chosen page offsets".into())?;
        let ids = (stream.clone_dtoh(&self.ids)).during(|| "downloading chosen pages".into())?;
        Ok(offsets
            .windows(2)
            .map(|w| ids[w[0] as usize..w[1] as usize].to_vec())
            .collect())
    }

    /// The summary of pool page `page` (waits).
    pub fn summary(&self, gpu: &Gpu, page: u32) -> Result<Vec<u16>, CudaError> {
        let n = self.layout.values();
        let at = page as usize * n;
        if at + n > self.summaries.len() {
            return Err(CudaError::Shape(format!(
                "page {page} is outside the summaries"
            )));
        }
        (gpu.stream.clone_dtoh(&self.summaries.slice(at..at + n)))
            .during(|| "downloading a page summary".into())
    }
}

type Loaded = (Arc<CudaModule>, SelectKernels, [CudaFunction; 3]);

fn load(
    gpu: &Gpu,
    format_name: &str,
    layout: &SummaryLayout,
    exact: &TierLayout,
    group: u32,
) -> Result<Loaded, CudaError> {
    let (text, kernels) = ptx::write_select(format_name, layout, exact, group, gpu.target())
        .map_err(|e| CudaError::Shape(e.to_string()))?;
    let module = (gpu.context.load_module(Ptx::from_src(text)))
        .during(|| format!("loading the page selection kernels of {format_name}"))?;
    let function =
        |name: &str| (module.load_function(name)).during(|| format!("finding kernel {name}"));
    let functions = [
        function(&kernels.summarize)?,
        function(&kernels.score)?,
        function(&kernels.choose)?,
    ];
    Ok((module, kernels, functions))
}
