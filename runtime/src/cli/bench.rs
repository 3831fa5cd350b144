//! `kvcc bench`: time the generated decode kernels on the GPU at a serving shape
//! and compare with dense f16 decode baselines measured in the same run
//! (`benches/gpu/baseline.py`: PyTorch SDPA and FlashInfer).
//!
//! Method: CUDA events around each decode step (every tier kernel + merge),
//! warm-up first, median of `iters` steps, several device copies of the cache
//! rotated so L2 cannot serve repeated reads, random (never zero) inputs, and the
//! kernels' output checked against the interpreter before any time counts.

use std::path::Path;

use cudarc::driver::sys::CUevent_flags;
use kvcc_compiler::back::interp::{Interpreter, Options as InterpOptions};
use kvcc_compiler::back::ptx;
use kvcc_compiler::Format;
use serde::{Deserialize, Serialize};

use crate::cache::{self, PagedCache};
use crate::cuda::{CudaError, DeviceCache, DeviceDecode, During, FormatKernels, Gpu};
use crate::encode::TrainOptions;
use crate::math::rng::{normal, seeded};
use crate::synth::{synthesize, SynthOptions};
use crate::table::Table;

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub contexts: Vec<usize>,
    pub warmup: usize,
    pub iters: usize,
    /// L2-defeating rotation: at least this many bytes of distinct caches.
    pub rotate_bytes: u64,
    pub seed: u64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            batch: 8,
            q_heads: 32,
            kv_heads: 8,
            contexts: vec![8192, 32768, 131072],
            warmup: 10,
            iters: 50,
            rotate_bytes: 512 << 20,
            seed: 11,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    pub format: String,
    pub tier: String,
    pub context: usize,
    /// Bytes one decode step reads per token per kv head (pages incl. headers, tables amortized).
    pub bytes_per_token: f64,
    pub ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    /// Bytes the layout says a step must read, over the median time.
    pub tb_per_s: f64,
    pub splits: Vec<u32>,
    pub max_rel_error: f64,
    pub sdpa_ms: Option<f64>,
    pub speedup_vs_sdpa: Option<f64>,
    /// 0.75 x (dense bytes / these bytes): the bar for formats up to 4x smaller.
    pub bar: f64,
    pub flashinfer_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub gpu: String,
    pub compute_capability: (i32, i32),
    pub driver_version: i32,
    pub shape: String,
    pub rows: Vec<BenchRow>,
    pub baselines: Option<Baselines>,
}

/// What `benches/gpu/baseline.py` writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Baselines {
    pub gpu: String,
    pub torch: String,
    pub rows: Vec<BaselineRow>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BaselineRow {
    pub baseline: String,
    pub ctx: usize,
    pub ms: Option<f64>,
    pub tb_per_s: Option<f64>,
    pub error: Option<String>,
}

impl Baselines {
    pub fn load(path: &Path) -> Result<Baselines, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
    fn ms(&self, baseline: &str, ctx: usize) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.baseline == baseline && r.ctx == ctx)
            .and_then(|r| r.ms)
    }
}

/// Encodes a few full pages per kv head of tier `tier` (structured synthetic K/V).
fn source_cache(
    format: &Format,
    tier: usize,
    kv_heads: usize,
    seed: u64,
) -> Result<PagedCache, Box<dyn std::error::Error>> {
    let items = format.spec().page.items as usize;
    let tokens = items * 8;
    let data = synthesize(&SynthOptions {
        seed,
        kv_heads,
        q_heads: kv_heads,
        tokens,
        head_dim: format.head_dim() as usize,
    });
    let tables = cache::train(
        format,
        &data.keys,
        &data.values,
        kv_heads,
        &TrainOptions {
            seed,
            ..TrainOptions::default()
        },
    )?;
    let mut cache = PagedCache::new(format, kv_heads, tables)?;
    cache.append_sequence(&data.keys, &data.values, |_| tier)?;
    Ok(cache)
}

fn random_queries(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = seeded(seed);
    (0..len).map(|_| normal(&mut rng)).collect()
}

/// Largest |got - want| over max |want|, per row, over all rows.
fn max_rel_error(got: &[f32], want: &[f32], row: usize) -> f64 {
    got.chunks(row)
        .zip(want.chunks(row))
        .map(|(g, w)| {
            let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
            g.iter()
                .zip(w)
                .map(|(a, b)| {
                    if a.is_finite() {
                        ((a - b).abs() / scale) as f64
                    } else {
                        f64::INFINITY
                    }
                })
                .fold(0.0, f64::max)
        })
        .fold(0.0, f64::max)
}

/// Runs one decode step on a small replica and compares with the interpreter.
fn verify(
    gpu: &Gpu,
    kernels: &FormatKernels,
    source: &PagedCache,
    options: &BenchOptions,
) -> Result<f64, Box<dyn std::error::Error>> {
    let items = source.format().spec().page.items as usize;
    let small = source.replicate(2, 5 * items + items / 3)?;
    let d = source.format().head_dim() as usize;
    let queries = random_queries(2 * options.q_heads * d, options.seed ^ 0x51);
    let want = Interpreter::new(source.format().tiers(), InterpOptions::default()).decode(
        &small.view(),
        &queries,
        options.q_heads,
    )?;
    let device = DeviceCache::upload(gpu, kernels, &small)?;
    let mut step = DeviceDecode::new(gpu, kernels, &device, options.q_heads, None)?;
    step.set_queries(gpu, kernels, &device, &queries)?;
    step.poison(gpu)?;
    step.launch(gpu, kernels, &device)?;
    Ok(max_rel_error(&step.output(gpu, &device, d)?, &want, d))
}

/// Median, min and max milliseconds of decode steps rotating over `steps`.
fn time_steps(
    gpu: &Gpu,
    kernels: &FormatKernels,
    caches: &[DeviceCache],
    steps: &mut [DeviceDecode],
    options: &BenchOptions,
) -> Result<(f64, f64, f64), CudaError> {
    let event = || {
        gpu.context
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .during(|| "creating an event".into())
    };
    for i in 0..options.warmup {
        let r = i % caches.len();
        steps[r].launch(gpu, kernels, &caches[r])?;
    }
    // One pair of events serves every step: each step is waited for before the next.
    let (start, end) = (event()?, event()?);
    let mut times = Vec::with_capacity(options.iters);
    for i in 0..options.iters {
        let r = i % caches.len();
        start
            .record(&gpu.stream)
            .during(|| "recording an event".into())?;
        steps[r].launch(gpu, kernels, &caches[r])?;
        end.record(&gpu.stream)
            .during(|| "recording an event".into())?;
        end.synchronize()
            .during(|| "waiting for a decode step".into())?;
        times.push(f64::from(
            start
                .elapsed_ms(&end)
                .during(|| "reading an event".into())?,
        ));
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], times[0], times[times.len() - 1]))
}

pub fn run(
    formats: &[Format],
    baselines: Option<Baselines>,
    options: &BenchOptions,
    mut progress: impl FnMut(&str),
) -> Result<BenchReport, Box<dyn std::error::Error>> {
    let gpu = Gpu::open()?;
    let mut rows = Vec::new();
    for format in formats {
        let d = format.head_dim() as usize;
        let group = (options.q_heads / options.kv_heads.max(1)) as u32;
        let kernel_options = ptx::Options {
            query_group: Some(group),
            ..ptx::Options::for_target(gpu.target())
        };
        let kernels = FormatKernels::load(&gpu, format, kernel_options)?;
        for tier in 0..format.tiers().len() {
            let name = format.layout(tier).name.clone();
            let source = source_cache(format, tier, options.kv_heads, options.seed)?;
            let error = verify(&gpu, &kernels, &source, options)?;
            if error > 1e-4 {
                return Err(format!("{}/{name}: GPU output differs from the interpreter (max relative error {error:.2e}); not timing a wrong kernel", format.name()).into());
            }
            for &context in &options.contexts {
                progress(&format!("{}/{name} @{context}", format.name()));
                let host = source.replicate(options.batch, context)?;
                let first = DeviceCache::upload(&gpu, &kernels, &host)?;
                let replicas = (options.rotate_bytes.div_ceil(first.bytes_per_step.max(1)))
                    .clamp(1, 8) as usize;
                let mut caches = vec![first];
                for _ in 1..replicas {
                    caches.push(DeviceCache::upload(&gpu, &kernels, &host)?);
                }
                drop(host);
                let mut steps = Vec::new();
                for (r, cache) in caches.iter().enumerate() {
                    let mut step = DeviceDecode::new(&gpu, &kernels, cache, options.q_heads, None)?;
                    let queries = random_queries(
                        options.batch * options.q_heads * d,
                        options.seed + r as u64,
                    );
                    step.set_queries(&gpu, &kernels, cache, &queries)?;
                    steps.push(step);
                }
                let (ms, min_ms, max_ms) =
                    time_steps(&gpu, &kernels, &caches, &mut steps, options)?;
                let bytes = caches[0].bytes_per_step as f64;
                let bytes_per_token = bytes / (options.batch * options.kv_heads * context) as f64;
                let dense = (4 * d) as f64;
                let sdpa_ms = baselines.as_ref().and_then(|b| b.ms("sdpa", context));
                rows.push(BenchRow {
                    format: format.name().to_string(),
                    tier: name.clone(),
                    context,
                    bytes_per_token,
                    ms,
                    min_ms,
                    max_ms,
                    tb_per_s: bytes / ms / 1e9,
                    splits: steps[0].splits.clone(),
                    max_rel_error: error,
                    sdpa_ms,
                    speedup_vs_sdpa: sdpa_ms.map(|s| s / ms),
                    bar: 0.75 * dense / bytes_per_token,
                    flashinfer_ms: baselines.as_ref().and_then(|b| b.ms("flashinfer", context)),
                });
            }
        }
    }
    Ok(BenchReport {
        gpu: gpu.name.clone(),
        compute_capability: gpu.compute_capability,
        driver_version: gpu.driver_version,
        shape: format!(
            "batch {}, {} query heads, {} kv heads, contexts {:?}",
            options.batch, options.q_heads, options.kv_heads, options.contexts
        ),
        rows,
        baselines,
    })
}

pub fn render(report: &BenchReport) -> String {
    let mut table = Table::new(&[
        "format",
        "tier",
        "ctx",
        "B/token",
        "ms",
        "TB/s",
        "SDPA ms",
        "vs SDPA",
        "bar",
        "FlashInfer ms",
        "max err",
    ]);
    for column in 2..11 {
        table.right_align(column);
    }
    let opt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
    for r in &report.rows {
        table.row(vec![
            r.format.clone(),
            r.tier.clone(),
            r.context.to_string(),
            format!("{:.1}", r.bytes_per_token),
            format!("{:.4}", r.ms),
            format!("{:.2}", r.tb_per_s),
            opt(r.sdpa_ms, 4),
            r.speedup_vs_sdpa.map_or("-".into(), |s| format!("{s:.2}x")),
            format!("{:.2}x", r.bar),
            opt(r.flashinfer_ms, 4),
            format!("{:.1e}", r.max_rel_error),
        ]);
    }
    let baseline = report
        .baselines
        .as_ref()
        .map_or("no baseline file".to_string(), |b| {
            format!("baselines: torch {} on {}", b.torch, b.gpu)
        });
    format!(
        "kvcc bench on {} (sm_{}{}, driver {}); {}; {}\nTB/s = bytes the layout says a step reads / median time; bar = 0.75 x dense bytes / format bytes\n{}",
        report.gpu, report.compute_capability.0, report.compute_capability.1, report.driver_version, report.shape, baseline, table
    )
}
