//! `kvcc bench --live`: a serving loop on the GPU live cache. Each step
//! appends one token per sequence (K/V already on the device, as a model's
//! projections leave them) and decodes every sequence; whole pages leaving
//! the window are compressed by the page encoders in the same stream. The
//! same cache's decode-only step is timed beside it, and the dense serving
//! loops of `benches/gpu/live_baseline.py` (SDPA over a preallocated cache,
//! FlashInfer `append_paged_kv_cache` + paged decode, f16 and fp8) give the
//! reference rows.
//!
//! Method: CUDA events around every step, steps enqueued back to back;
//! `steps` timed steps (a multiple of the page size, so every sequence
//! compresses the same number of pages per run) after `warmup` untimed ones;
//! the mean, which carries the compressions at their real rate.

use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use kvcc_compiler::Format;
use serde::Serialize;

use super::bench::Baselines;
use crate::cache;
use crate::cuda::measure::DecodeShape;
use crate::cuda::{DeviceAppend, DeviceLiveCache, DeviceLiveOptions, During, Gpu};
use crate::encode::TrainOptions;
use crate::live::{CachePolicy, LiveKv};
use crate::synth::{synthesize, SynthOptions};
use crate::table::Table;

#[derive(Debug, Clone)]
pub struct LiveBenchOptions {
    pub shape: DecodeShape,
    pub contexts: Vec<usize>,
    pub warmup: usize,
    /// Timed steps, rounded up to a multiple of the page size.
    pub steps: usize,
    /// Overrides of the spec's `[cache]` policy.
    pub sinks: Option<usize>,
    pub window: Option<usize>,
    pub seed: u64,
}

impl Default for LiveBenchOptions {
    fn default() -> Self {
        LiveBenchOptions {
            shape: DecodeShape::default(),
            contexts: vec![8192, 32768, 131072],
            warmup: 64,
            steps: 256,
            sinks: None,
            window: None,
            seed: 11,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct LiveBenchRow {
    pub format: String,
    pub tier: String,
    pub context: usize,
    pub policy: String,
    /// Mean of an append + decode step.
    pub live_ms: f64,
    /// Mean of a decode step alone, over the same cache.
    pub decode_ms: f64,
    /// live_ms / decode_ms - 1.
    pub live_overhead: f64,
    /// Steps that compressed pages, and their mean.
    pub compress_steps: usize,
    pub compress_step_ms: f64,
    /// What the compressing steps cost beyond the others, amortized over
    /// every step, as a share of the mean live step.
    pub compress_share: f64,
    /// Bytes a decode step reads (pages, exact rows and tables).
    pub bytes_per_step: u64,
    pub sdpa_live_ms: Option<f64>,
    pub speedup_vs_sdpa: Option<f64>,
    pub flashinfer_live_ms: Option<f64>,
    pub flashinfer_fp8_live_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LiveBenchReport {
    pub gpu: String,
    pub shape: String,
    pub steps: usize,
    pub rows: Vec<LiveBenchRow>,
    pub baselines: Option<Baselines>,
}

/// Device K/V rows `[entry][kv_head][token][head_dim]` for `batch` entries
/// of `tokens` tokens each, from synthetic K/V of `kv_heads` heads.
fn device_rows(
    gpu: &Gpu,
    keys: &[f32],
    values: &[f32],
    kv_heads: usize,
    d: usize,
    batch: usize,
    tokens: usize,
) -> Result<[cudarc::driver::CudaSlice<f32>; 2], Box<dyn std::error::Error>> {
    let source_tokens = keys.len() / (kv_heads * d);
    let mut out = Vec::new();
    for data in [keys, values] {
        let mut host = Vec::with_capacity(batch * kv_heads * tokens * d);
        for entry in 0..batch {
            for h in 0..kv_heads {
                for t in 0..tokens {
                    let at = (h * source_tokens + (t + entry * 7) % source_tokens) * d;
                    host.extend_from_slice(&data[at..at + d]);
                }
            }
        }
        out.push(
            gpu.stream
                .clone_htod(&host)
                .during(|| "uploading K/V".into())?,
        );
    }
    let [k, v]: [_; 2] = out.try_into().map_err(|_| "two buffers")?;
    Ok([k, v])
}

/// Mean and per-step times of `steps` steps run by `step(i)` between events.
fn timed(
    gpu: &Gpu,
    steps: usize,
    mut step: impl FnMut(usize) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<Vec<f64>, Box<dyn std::error::Error>> {
    let event = || {
        (gpu.context.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)))
            .during(|| "creating an event".into())
    };
    let events = (0..steps)
        .map(|_| Ok((event()?, event()?)))
        .collect::<Result<Vec<_>, crate::cuda::CudaError>>()?;
    for (i, (start, end)) in events.iter().enumerate() {
        start.record(&gpu.stream).during(|| "recording".into())?;
        step(i)?;
        end.record(&gpu.stream).during(|| "recording".into())?;
    }
    let mut times = Vec::with_capacity(steps);
    for (start, end) in &events {
        end.synchronize().during(|| "waiting for a step".into())?;
        times.push(f64::from(
            start.elapsed_ms(end).during(|| "reading an event".into())?,
        ));
    }
    Ok(times)
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

pub fn run(
    formats: &[Format],
    baselines: Option<Baselines>,
    options: &LiveBenchOptions,
    mut progress: impl FnMut(&str),
) -> Result<LiveBenchReport, Box<dyn std::error::Error>> {
    let gpu = Arc::new(Gpu::open()?);
    let DecodeShape {
        batch,
        q_heads,
        kv_heads,
    } = options.shape;
    let mut report_rows = Vec::new();
    let mut steps_run = 0;
    for format in formats {
        let d = format.head_dim() as usize;
        let items = format.spec().page.items as usize;
        let steps = options.steps.max(1).div_ceil(items) * items;
        steps_run = steps;
        let synth = synthesize(&SynthOptions {
            seed: options.seed,
            kv_heads,
            q_heads,
            tokens: 4 * items.max(256),
            head_dim: d,
        });
        let tables = cache::train(
            format,
            &synth.keys,
            &synth.values,
            kv_heads,
            &TrainOptions::default(),
        )?;
        // Prefill chunks and per-step tokens, on the device once.
        let chunk = 8 * items;
        let prefill = device_rows(&gpu, &synth.keys, &synth.values, kv_heads, d, batch, chunk)?;
        let step_tokens = options.warmup + steps;
        // Step i's rows, `[entry][kv_head][d]`, one token each.
        let source_tokens = synth.keys.len() / (kv_heads * d);
        let mut step_rows = Vec::with_capacity(2);
        for data in [&synth.keys, &synth.values] {
            let mut host = Vec::with_capacity(step_tokens * batch * kv_heads * d);
            for i in 0..step_tokens {
                for entry in 0..batch {
                    for h in 0..kv_heads {
                        let at = (h * source_tokens + (13 * i + 7 * entry) % source_tokens) * d;
                        host.extend_from_slice(&data[at..at + d]);
                    }
                }
            }
            step_rows.push(gpu.stream.clone_htod(&host).during(|| "uploading".into())?);
        }
        let queries: Vec<f32> = (0..batch)
            .flat_map(|_| synth.queries.iter().copied())
            .collect();
        for tier in 0..format.tiers().len() {
            for &context in &options.contexts {
                let name = &format.layout(tier).name;
                progress(&format!("{}/{name} @{context}", format.name()));
                let policy = CachePolicy {
                    tier,
                    ..CachePolicy::of(format).with_overrides(options.sinks, options.window)
                };
                let pages = (context + step_tokens).div_ceil(items) + 2;
                let live_options = DeviceLiveOptions {
                    policy,
                    kv_heads,
                    max_sequences: batch,
                    pages_per_tier: batch * kv_heads * pages,
                    context,
                    q_heads,
                    fixed_plan: false,
                };
                let mut live =
                    DeviceLiveCache::new(gpu.clone(), format, &live_options, tables.clone())?;
                live.prefill(&vec![Default::default(); batch])?;
                let mut filled = 0;
                while filled < context {
                    let tokens = chunk.min(context - filled);
                    let len = batch * kv_heads * tokens * d;
                    let batch_entries: Vec<DeviceAppend> = (0..batch)
                        .map(|sequence| DeviceAppend { sequence, tokens })
                        .collect();
                    live.append_device(
                        &prefill[0].slice(0..len),
                        &prefill[1].slice(0..len),
                        &batch_entries,
                    )?;
                    filled += tokens;
                }
                live.set_queries(&queries, q_heads)?;
                let one: Vec<DeviceAppend> = (0..batch)
                    .map(|sequence| DeviceAppend {
                        sequence,
                        tokens: 1,
                    })
                    .collect();
                let step_len = batch * kv_heads * d;
                let mut appended = 0usize;
                let mut live_step =
                    |live: &mut DeviceLiveCache| -> Result<bool, Box<dyn std::error::Error>> {
                        let at = appended * step_len;
                        let before = live.pages_in_use()[tier];
                        live.append_device(
                            &step_rows[0].slice(at..at + step_len),
                            &step_rows[1].slice(at..at + step_len),
                            &one,
                        )?;
                        appended += 1;
                        live.launch_decode()?;
                        Ok(live.pages_in_use()[tier] != before)
                    };
                for _ in 0..options.warmup {
                    live_step(&mut live)?;
                }
                gpu.stream.synchronize().during(|| "warming up".into())?;
                let decode = timed(&gpu, steps, |_| Ok(live.launch_decode()?))?;
                let mut compressed = vec![false; steps];
                let live_times = timed(&gpu, steps, |i| {
                    compressed[i] = live_step(&mut live)?;
                    Ok(())
                })?;
                let check = live.attend(&queries, q_heads)?;
                if check.outputs.iter().any(|x| !x.is_finite()) {
                    return Err(format!(
                        "{}/{name}: the live step's output is not finite",
                        format.name()
                    )
                    .into());
                }
                let (with, without): (Vec<f64>, Vec<f64>) = {
                    let pick = |c: bool| -> Vec<f64> {
                        (live_times.iter().zip(&compressed))
                            .filter(|(_, &x)| x == c)
                            .map(|(&t, _)| t)
                            .collect()
                    };
                    (pick(true), pick(false))
                };
                let live_ms = mean(&live_times);
                let decode_ms = mean(&decode);
                let extra = (mean(&with) - mean(&without)).max(0.0) * with.len() as f64;
                let sdpa = baselines
                    .as_ref()
                    .and_then(|b| b.ms_of("sdpa_live", context));
                report_rows.push(LiveBenchRow {
                    format: format.name().to_string(),
                    tier: name.clone(),
                    context,
                    policy: policy.describe(format),
                    live_ms,
                    decode_ms,
                    live_overhead: live_ms / decode_ms - 1.0,
                    compress_steps: with.len(),
                    compress_step_ms: mean(&with),
                    compress_share: extra / steps as f64 / live_ms,
                    bytes_per_step: live.bytes_per_step(),
                    sdpa_live_ms: sdpa,
                    speedup_vs_sdpa: sdpa.map(|s| s / live_ms),
                    flashinfer_live_ms: baselines
                        .as_ref()
                        .and_then(|b| b.ms_of("flashinfer_live", context)),
                    flashinfer_fp8_live_ms: baselines
                        .as_ref()
                        .and_then(|b| b.ms_of("flashinfer_fp8_live", context)),
                });
            }
        }
    }
    Ok(LiveBenchReport {
        gpu: gpu.name.clone(),
        shape: format!(
            "batch {batch}, {q_heads} query heads, {kv_heads} kv heads, contexts {:?}",
            options.contexts
        ),
        steps: steps_run,
        rows: report_rows,
        baselines,
    })
}

pub fn render(report: &LiveBenchReport) -> String {
    let mut table = Table::new(&[
        "format",
        "tier",
        "ctx",
        "live ms",
        "decode ms",
        "live/decode",
        "compress share",
        "SDPA live ms",
        "vs SDPA",
        "FI f16 ms",
        "FI fp8 ms",
        "policy",
    ]);
    for column in 2..11 {
        table.right_align(column);
    }
    let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.4}"));
    for r in &report.rows {
        table.row(vec![
            r.format.clone(),
            r.tier.clone(),
            r.context.to_string(),
            format!("{:.4}", r.live_ms),
            format!("{:.4}", r.decode_ms),
            format!("{:+.1}%", 100.0 * r.live_overhead),
            format!("{:.2}%", 100.0 * r.compress_share),
            opt(r.sdpa_live_ms),
            r.speedup_vs_sdpa.map_or("-".into(), |s| format!("{s:.2}x")),
            opt(r.flashinfer_live_ms),
            opt(r.flashinfer_fp8_live_ms),
            r.policy.clone(),
        ]);
    }
    format!(
        "kvcc bench --live on {}; {}; {} timed steps (each appends one token per sequence, then decodes), mean ms\n{}",
        report.gpu, report.shape, report.steps, table
    )
}
