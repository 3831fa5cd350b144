//! The page-compress kernels of a format, loaded into the GPU's context, and
//! their launches: full pages of a dense exact tier in, pages of any tier
//! out, byte-identical to [`crate::encode::encode_page`] on the same rows
//! (see `kvcc_compiler::back::ptx::encode` and [`abi::EncodeKernel`]).

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule, CudaSlice, CudaView, PushKernelArg};
use cudarc::nvrtc::Ptx;
use kvcc_compiler::back::ptx::abi::{self, DenseSource, ENCODE_JOB_WORDS};
use kvcc_compiler::back::ptx::encode::write_encoder_within;
use kvcc_compiler::layout::TierLayout;
use kvcc_compiler::Format;

use super::{CudaError, During, Gpu};

/// One encode kernel per tier of a format, all reading source pages of one
/// dense tier.
pub struct PageEncoders {
    pub format: Format,
    pub source: DenseSource,
    kernels: Vec<(CudaFunction, abi::EncodeKernel)>,
    /// Keep modules alive as long as their functions.
    _modules: Vec<Arc<CudaModule>>,
}

impl PageEncoders {
    /// Generates and loads the encode kernel of every tier of `format` for
    /// source pages laid out as `source` (a dense f16 or bf16 tier with the
    /// format's head_dim and page size).
    pub fn load(
        gpu: &Gpu,
        format: &Format,
        source: &TierLayout,
    ) -> Result<PageEncoders, CudaError> {
        PageEncoders::load_within(gpu, format, source, gpu.target().max_shared_bytes())
    }

    /// [`PageEncoders::load`] with kernels that use at most `shared_limit`
    /// bytes of shared memory (pages that do not fit go in chunks).
    pub fn load_within(
        gpu: &Gpu,
        format: &Format,
        source: &TierLayout,
        shared_limit: u32,
    ) -> Result<PageEncoders, CudaError> {
        let source = DenseSource::of_layout(source).ok_or_else(|| {
            CudaError::Shape(format!(
                "tier {} is not a dense f16 or bf16 tier without a transform: it cannot be an encoder source",
                source.name
            ))
        })?;
        let outputs = (0..format.tiers().len())
            .map(|t| {
                let layout = format.layout(t);
                write_encoder_within(format.name(), layout, &source, gpu.target(), shared_limit)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut kernels = Vec::new();
        let mut modules = Vec::new();
        for output in outputs {
            let name = &output.kernel.name;
            let module = gpu
                .context
                .load_module(Ptx::from_src(&output.ptx))
                .during(|| {
                    format!(
                        "loading the encode PTX of {}/{}",
                        format.name(),
                        output.tier
                    )
                })?;
            let function = module
                .load_function(name)
                .during(|| format!("finding kernel {name}"))?;
            let shared = output.kernel.shared_bytes;
            function
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared as i32,
                )
                .during(|| format!("allowing {name} {shared} bytes of shared memory"))?;
            modules.push(module);
            kernels.push((function, output.kernel));
        }
        Ok(PageEncoders {
            format: format.clone(),
            source,
            kernels,
            _modules: modules,
        })
    }

    /// Tier `tier`'s kernel description.
    pub fn kernel(&self, tier: usize) -> &abi::EncodeKernel {
        &self.kernels[tier].1
    }

    /// Enqueues on `gpu`'s stream the encoding of `count` jobs of `jobs`
    /// (`abi::ENCODE_PARAMS`: per job the source page in `source`, the
    /// destination page in `target` — tier `tier`'s pool — and the kv head
    /// whose block of `tables` (tier `tier`'s `TableBuffer`) applies). Every
    /// job writes its whole destination page. The buffers' sizes are checked
    /// against one page and one head's tables; the job list's page indices
    /// and heads must lie inside them, and no two jobs may share a
    /// destination page.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        gpu: &Gpu,
        tier: usize,
        source: &CudaSlice<u8>,
        target: &mut CudaSlice<u8>,
        tables: &CudaSlice<f32>,
        jobs: &CudaView<u32>,
        count: u32,
    ) -> Result<(), CudaError> {
        let Some((function, kernel)) = self.kernels.get(tier) else {
            return Err(CudaError::Shape(format!(
                "tier {tier} does not exist; {} has {} tiers",
                self.format.name(),
                self.kernels.len()
            )));
        };
        if count == 0 {
            return Ok(());
        }
        let short = |what: &str, len: usize, need: usize| {
            (len < need).then(|| {
                CudaError::Shape(format!(
                    "{}: the {what} holds {len} elements, fewer than the {need} one launch reads",
                    kernel.name
                ))
            })
        };
        let checks = [
            short("source pool", source.len(), self.source.page_bytes as usize),
            short("target pool", target.len(), kernel.page_bytes as usize),
            short("table buffer", tables.len(), kernel.tables.stride as usize),
            short("job list", jobs.len(), (ENCODE_JOB_WORDS * count) as usize),
        ];
        if let Some(error) = checks.into_iter().flatten().next() {
            return Err(error);
        }
        let launch = kernel.launch(count);
        let mut args = gpu.stream.launch_builder(function);
        args.arg(target)
            .arg(source)
            .arg(tables)
            .arg(jobs)
            .arg(&count);
        // SAFETY: the arguments follow abi::ENCODE_PARAMS in order and type;
        // the buffers hold at least one page / one head's tables and the
        // caller keeps the job list inside them (see above).
        unsafe { args.launch(super::config(launch)) }
            .during(|| format!("launching {}", kernel.name))?;
        Ok(())
    }

    /// Encodes on the GPU and waits: `source_pages` (whole source pages),
    /// `tables` (`[kv_head][table]` f32 tables of tier `tier`) and `jobs`
    /// (source page, destination page, kv head) in, a pool of `pages`
    /// destination pages out. Bytes no job writes stay 0xA5, so a page the
    /// kernel left short shows.
    pub fn encode_pages(
        &self,
        gpu: &Gpu,
        tier: usize,
        source_pages: &[u8],
        tables: &[Vec<Vec<f32>>],
        jobs: &[[u32; 3]],
        pages: usize,
    ) -> Result<Vec<u8>, CudaError> {
        let kernel = self.kernels.get(tier).map(|(_, k)| k).ok_or_else(|| {
            CudaError::Shape(format!(
                "tier {tier} does not exist in {}",
                self.format.name()
            ))
        })?;
        let (src_page, dst_page) = (self.source.page_bytes as usize, kernel.page_bytes as usize);
        let src_pages = source_pages.len() / src_page;
        if source_pages.len() != src_pages * src_page {
            return Err(CudaError::Shape(format!(
                "{} source bytes are not whole pages of {src_page}",
                source_pages.len()
            )));
        }
        for (j, &[src, dst, head]) in jobs.iter().enumerate() {
            if src as usize >= src_pages || dst as usize >= pages || head as usize >= tables.len() {
                return Err(CudaError::Shape(format!(
                    "job {j} (source page {src}, destination page {dst}, kv head {head}) is outside \
                     {src_pages} source pages, {pages} destination pages, {} kv heads",
                    tables.len()
                )));
            }
            if jobs[..j].iter().any(|other| other[1] == dst) {
                return Err(CudaError::Shape(format!(
                    "job {j} writes destination page {dst}, as an earlier job does"
                )));
            }
        }
        let stream = &gpu.stream;
        let mut table_buffer = kernel.tables.fill(tables);
        table_buffer.resize(table_buffer.len().max(4), 0.0);
        let tables = stream
            .clone_htod(&table_buffer)
            .during(|| "uploading encoder tables".into())?;
        let mut source_bytes = source_pages.to_vec();
        source_bytes.resize(source_bytes.len().max(16), 0);
        let source = stream
            .clone_htod(&source_bytes)
            .during(|| "uploading source pages".into())?;
        let mut target = stream
            .clone_htod(&vec![0xA5u8; (pages * dst_page).max(16)])
            .during(|| "allocating destination pages".into())?;
        let mut words: Vec<u32> = jobs.iter().flatten().copied().collect();
        words.resize(words.len().max(ENCODE_JOB_WORDS as usize), 0);
        let job_list = stream
            .clone_htod(&words)
            .during(|| "uploading the job list".into())?;
        self.launch(
            gpu,
            tier,
            &source,
            &mut target,
            &tables,
            &job_list.as_view(),
            jobs.len() as u32,
        )?;
        let mut out = stream
            .clone_dtoh(&target)
            .during(|| "downloading encoded pages".into())?;
        out.truncate(pages * dst_page);
        Ok(out)
    }
}
