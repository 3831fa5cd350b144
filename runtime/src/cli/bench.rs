//! `kvcc bench`: time the generated decode kernels on the GPU at a serving shape
//! and compare with dense f16 decode baselines measured in the same run
//! (`benches/gpu/baseline.py`: PyTorch SDPA and FlashInfer).
//!
//! Method: CUDA events around each decode step (every tier kernel + merge),
//! steps enqueued back to back as a serving loop runs them (`StepTiming`),
//! warm-up first, median of `iters` steps, several device copies of the cache
//! rotated so L2 cannot serve repeated reads, random (never zero) inputs, and the
//! kernels' output checked against the interpreter before any time counts.

use std::path::Path;

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use kvcc_compiler::Format;
use serde::{Deserialize, Serialize};

use crate::cache::PagedCache;

use crate::cuda::measure::{
    decode_steps, source_cache, time_steps, upload_copies, DecodeShape, Reference, StepPlan,
    StepTiming, TOLERANCE,
};
use crate::cuda::{FormatKernels, Gpu};
use crate::table::Table;
use crate::tune::config::with_page_items;
use crate::tune::lookup::{self, Source};
use crate::tune::model;
use crate::tune::KernelConfig;

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub shape: DecodeShape,
    pub contexts: Vec<usize>,
    pub steps: StepPlan,
    pub seed: u64,
    /// Look tuned configurations up in the tune cache (else the defaults).
    pub tuned: bool,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            shape: DecodeShape::default(),
            contexts: vec![8192, 32768, 131072],
            steps: StepPlan::new(10, 50, StepTiming::Queued),
            seed: 11,
            tuned: true,
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
    /// The tier's kernel configuration, and whether it came from the tune cache.
    pub config: String,
    pub tuned: bool,
    /// Where the configuration came from: `tuned` (the user's tune cache),
    /// `shipped` (the results shipped with kvcc) or `model` (the cost model).
    pub source: &'static str,
    pub max_rel_error: f64,
    pub sdpa_ms: Option<f64>,
    pub speedup_vs_sdpa: Option<f64>,
    /// 0.75 x (dense bytes / these bytes): the issue's bar for formats up to 4x smaller.
    pub bar: f64,
    pub flashinfer_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct BenchReport {
    pub gpu: String,
    pub compute_capability: (i32, i32),
    pub driver_version: i32,
    pub shape: String,
    pub timing: StepTiming,
    pub rows: Vec<BenchRow>,
    pub baselines: Option<Baselines>,
}

/// What `benches/gpu/baseline.py` writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Baselines {
    pub gpu: String,
    pub torch: String,
    /// How its steps were timed; files from before the field timed each call
    /// synced.
    #[serde(default = "synced")]
    pub timing: StepTiming,
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

fn synced() -> StepTiming {
    StepTiming::Synced
}

impl Baselines {
    pub fn load(path: &Path) -> Result<Baselines, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
    /// The baseline's time at `ctx`, if it ran.
    pub fn ms_of(&self, baseline: &str, ctx: usize) -> Option<f64> {
        self.rows
            .iter()
            .find(|r| r.baseline == baseline && r.ctx == ctx)
            .and_then(|r| r.ms)
    }
}

pub fn run(
    formats: &[Format],
    baselines: Option<Baselines>,
    options: &BenchOptions,
    mut progress: impl FnMut(&str),
) -> Result<BenchReport, Box<dyn std::error::Error>> {
    if let Some(b) = &baselines {
        // Ratios only compare like with like: launch latency in both or in neither.
        if b.timing != options.steps.timing {
            let (theirs, ours) = (b.timing.name(), options.steps.timing.name());
            return Err(format!(
                "the baselines were timed {theirs}, this run times {ours}: pass --timing {theirs} or rerun baseline.py --timing {ours}"
            )
            .into());
        }
    }
    let gpu = Gpu::open()?;
    let mut rows = Vec::new();
    for format in formats {
        let d = format.head_dim() as usize;
        let group = (options.shape.q_heads / options.shape.kv_heads.max(1)) as u32;
        // Kernels per page size and configuration (contexts in one bucket share them).
        let mut loaded: Vec<(u32, Vec<KernelConfig>, FormatKernels)> = Vec::new();
        for tier in 0..format.tiers().len() {
            let name = format.layout(tier).name.clone();
            // Per page size: the format, its pages and the interpreter's reference.
            let mut pages: HashMap<u32, (Format, PagedCache, Reference)> = HashMap::new();
            for &context in &options.contexts {
                progress(&format!("{}/{name} @{context}", format.name()));
                let shape = options.shape.bucket(context);
                // Pages encoded at the page size the tuner chose, else the cost
                // model's, as a cache built for this GPU would have them.
                let items = if options.tuned {
                    lookup::page_items(&gpu.id(), gpu.machine(), format, tier, shape)
                } else {
                    model::page_items(format, tier, shape, gpu.machine())
                };
                let (paged, source, reference) = match pages.entry(items) {
                    Entry::Occupied(e) => e.into_mut(),
                    Entry::Vacant(e) => {
                        let paged = with_page_items(format, items)?;
                        let source =
                            source_cache(&paged, tier, options.shape.kv_heads, options.seed)?;
                        let n = items as usize;
                        let reference = Reference::new(
                            &source,
                            options.shape.q_heads,
                            5 * n + n / 3,
                            options.seed ^ 0x51,
                        )?;
                        e.insert((paged, source, reference))
                    }
                };
                let resolution = if options.tuned {
                    lookup::resolve_default_for_tier(&gpu.id(), gpu.machine(), paged, tier, shape)
                } else {
                    lookup::defaults(paged, shape, gpu.machine(), "--no-tune")
                };
                let at = match loaded
                    .iter()
                    .position(|(p, c, _)| *p == items && *c == resolution.configs)
                {
                    Some(at) => at,
                    None => {
                        let kernels =
                            FormatKernels::load_configs(&gpu, paged, &resolution.configs, group)?;
                        loaded.push((items, resolution.configs.clone(), kernels));
                        loaded.len() - 1
                    }
                };
                let kernels = &loaded[at].2;
                let error = reference.check(&gpu, kernels, None)?;
                if error > TOLERANCE {
                    return Err(format!("{}/{name}: GPU output differs from the interpreter (max relative error {error:.2e}); not timing a wrong kernel", format.name()).into());
                }
                let host = source.replicate(options.shape.batch, context)?;
                let caches = upload_copies(&gpu, kernels, &host, options.steps.rotate_bytes)?;
                drop(host);
                let mut steps =
                    decode_steps(&gpu, kernels, &caches, options.shape.q_heads, options.seed)?;
                let timing = time_steps(
                    &gpu,
                    kernels,
                    &caches,
                    &mut steps,
                    options.steps.warmup,
                    options.steps.iters,
                    options.steps.timing,
                )?;
                let bytes = caches[0].bytes_per_step as f64;
                let bytes_per_token =
                    bytes / (options.shape.batch * options.shape.kv_heads * context) as f64;
                let dense = (4 * d) as f64;
                let sdpa_ms = baselines.as_ref().and_then(|b| b.ms_of("sdpa", context));
                rows.push(BenchRow {
                    format: format.name().to_string(),
                    tier: name.clone(),
                    context,
                    bytes_per_token,
                    ms: timing.ms,
                    min_ms: timing.min_ms,
                    max_ms: timing.max_ms,
                    tb_per_s: bytes / timing.ms / 1e9,
                    splits: steps[0].splits.clone(),
                    config: resolution.configs[tier].to_string(),
                    tuned: matches!(resolution.sources[tier], Source::Tuned { .. }),
                    source: match resolution.sources[tier] {
                        Source::Tuned { shipped: false, .. } => "tuned",
                        Source::Tuned { shipped: true, .. } => "shipped",
                        Source::Default { .. } => "model",
                    },
                    max_rel_error: error,
                    sdpa_ms,
                    speedup_vs_sdpa: sdpa_ms.map(|s| s / timing.ms),
                    bar: 0.75 * dense / bytes_per_token,
                    flashinfer_ms: baselines
                        .as_ref()
                        .and_then(|b| b.ms_of("flashinfer", context)),
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
            options.shape.batch, options.shape.q_heads, options.shape.kv_heads, options.contexts
        ),
        timing: options.steps.timing,
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
        "config",
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
            format!("{} ({})", r.config, r.source),
        ]);
    }
    let baseline = report
        .baselines
        .as_ref()
        .map_or("no baseline file".to_string(), |b| {
            format!("baselines: torch {} on {}", b.torch, b.gpu)
        });
    format!(
        "kvcc bench on {} (sm_{}{}, driver {}); {}; steps timed {}; {}\nTB/s = bytes the layout says a step reads / median time; bar = 0.75 x dense bytes / format bytes\n{}",
        report.gpu, report.compute_capability.0, report.compute_capability.1, report.driver_version, report.shape, report.timing.name(), baseline, table
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baselines_timed_another_way_are_refused_before_any_gpu_work() {
        // A file from before the timing field: its steps were timed synced.
        let old: Baselines =
            serde_json::from_str(r#"{"gpu": "H200", "torch": "2.11", "rows": []}"#).unwrap();
        assert_eq!(old.timing, StepTiming::Synced);
        let queued = BenchOptions::default();
        let err = run(&[], Some(old.clone()), &queued, |_| {}).unwrap_err();
        assert!(err.to_string().contains("timed synced"), "{err}");
        let mut synced = BenchOptions::default();
        synced.steps.timing = StepTiming::Synced;
        // Same timing: the check passes and the run goes on to open the GPU
        // (which a machine without one refuses with its own error).
        if let Err(e) = run(&[], Some(old), &synced, |_| {}) {
            assert!(!e.to_string().contains("timed synced"), "{e}");
        }
    }
}
