//! Measuring decode steps the way `kvcc bench` and `kvcc tune` both do:
//! structured synthetic pages, outputs checked against the interpreter before
//! any time counts, CUDA events around each step, warm-up, the median of many
//! steps, and several device copies of the cache rotated so L2 cannot serve
//! repeated reads.

use std::time::{Duration, Instant};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaGraph;
use kvcc_compiler::back::interp::{DecodeError, Interpreter, Options as InterpOptions};
use kvcc_compiler::Format;
use serde::{Deserialize, Serialize};

use super::{CudaError, DeviceCache, DeviceDecode, During, FormatKernels, Gpu};
use crate::cache::{self, PagedCache};
use crate::encode::TrainOptions;
use crate::math::rng::{normal, seeded};
use crate::synth::{synthesize, SynthOptions};
use crate::tune::ShapeBucket;

/// Relative error above which a kernel's output is wrong (fp32 accumulation).
pub const TOLERANCE: f64 = 1e-4;

/// Least time the warm-up steps before a timing run back to back. The host's
/// work before it (encoding pages, the interpreter's check) idles the GPU
/// long enough for its clocks to drop, and a few steps did not bring them
/// back: on an H200 a tune sweep's first candidate timed up to 9 % slower
/// than the same kernel timed again later.
const MIN_WARMUP: Duration = Duration::from_millis(50);

/// Encodes eight full pages per kv head of tier `tier` (structured synthetic
/// K/V, tables trained on them): the pages large caches are replicated from.
pub fn source_cache(
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

/// Standard normal queries (never all zero).
pub fn random_queries(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = seeded(seed);
    (0..len).map(|_| normal(&mut rng)).collect()
}

/// Largest |got - want| over max |want|, per row, over all rows (infinite for
/// a non-finite output).
pub fn max_rel_error(got: &[f32], want: &[f32], row: usize) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
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

/// The interpreter's decode, its (sequence, query head) rows spread over the
/// machine's threads: the same numbers as `Interpreter::decode`, row by row.
pub fn interpret_rows(
    format: &Format,
    cache: &PagedCache,
    queries: &[f32],
    q_heads: usize,
) -> Result<Vec<f32>, DecodeError> {
    let interpreter = Interpreter::new(format.tiers(), InterpOptions::default());
    let view = cache.view();
    interpreter.check_cache(&view)?;
    interpreter.check_queries(queries, cache.sequences(), q_heads, cache.kv_heads())?;
    let d = format.head_dim() as usize;
    let group = q_heads / cache.kv_heads();
    let rows: Vec<&[f32]> = queries.chunks(d).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = rows.len().div_ceil(threads).max(1);
    let parts: Vec<Result<Vec<f32>, DecodeError>> = std::thread::scope(|scope| {
        let workers: Vec<_> = rows
            .chunks(per_thread)
            .enumerate()
            .map(|(chunk, chunk_rows)| {
                let (interpreter, view) = (&interpreter, &view);
                scope.spawn(move || {
                    let mut out = Vec::with_capacity(chunk_rows.len() * d);
                    for (i, query) in chunk_rows.iter().enumerate() {
                        let row = chunk * per_thread + i;
                        let (sequence, head) = (row / q_heads, row % q_heads);
                        out.extend(
                            interpreter
                                .attend(view, sequence, head / group, query)?
                                .output,
                        );
                    }
                    Ok(out)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("interpreter thread"))
            .collect()
    });
    let mut out = Vec::with_capacity(queries.len());
    for part in parts {
        out.extend(part?);
    }
    Ok(out)
}

/// A small cache and queries with the interpreter's outputs: what every
/// kernel configuration is checked against before it is timed.
pub struct Reference {
    pub cache: PagedCache,
    pub queries: Vec<f32>,
    pub q_heads: usize,
    want: Vec<f32>,
}

impl Reference {
    /// Two sequences of `tokens` tokens replicated from `source`.
    pub fn new(
        source: &PagedCache,
        q_heads: usize,
        tokens: usize,
        seed: u64,
    ) -> Result<Reference, Box<dyn std::error::Error>> {
        let cache = source.replicate(2, tokens)?;
        let d = source.format().head_dim() as usize;
        let queries = random_queries(2 * q_heads * d, seed);
        let want = interpret_rows(source.format(), &cache, &queries, q_heads)?;
        Ok(Reference {
            cache,
            queries,
            q_heads,
            want,
        })
    }

    /// Runs one poisoned decode step with `kernels` (and `splits` per tier, or
    /// the kernels' own) and returns the largest relative error.
    pub fn check(
        &self,
        gpu: &Gpu,
        kernels: &FormatKernels,
        splits: Option<Vec<u32>>,
    ) -> Result<f64, CudaError> {
        let device = DeviceCache::upload(gpu, kernels, &self.cache)?;
        let mut step = DeviceDecode::new(gpu, kernels, &device, self.q_heads, splits)?;
        step.set_queries(gpu, kernels, &device, &self.queries)?;
        step.poison(gpu)?;
        step.launch(gpu, kernels, &device)?;
        let d = kernels.format.head_dim() as usize;
        Ok(max_rel_error(&step.output(gpu, &device, d)?, &self.want, d))
    }
}

/// Copies of `host` on the device, at least `rotate_bytes` in all (at most 8).
pub fn upload_copies(
    gpu: &Gpu,
    kernels: &FormatKernels,
    host: &PagedCache,
    rotate_bytes: u64,
) -> Result<Vec<DeviceCache>, CudaError> {
    let first = DeviceCache::upload(gpu, kernels, host)?;
    let copies = rotate_bytes
        .div_ceil(first.bytes_per_step.max(1))
        .clamp(1, 8) as usize;
    let mut caches = vec![first];
    for _ in 1..copies {
        caches.push(DeviceCache::upload(gpu, kernels, host)?);
    }
    Ok(caches)
}

/// One decode step per cache copy, with `kernels`' splits and its own random queries.
pub fn decode_steps(
    gpu: &Gpu,
    kernels: &FormatKernels,
    caches: &[DeviceCache],
    q_heads: usize,
    seed: u64,
) -> Result<Vec<DeviceDecode>, CudaError> {
    let d = kernels.format.head_dim() as usize;
    let mut steps = Vec::new();
    for (r, cache) in caches.iter().enumerate() {
        let mut step = DeviceDecode::new(gpu, kernels, cache, q_heads, None)?;
        let queries = random_queries(cache.sequences * q_heads * d, seed + r as u64);
        step.set_queries(gpu, kernels, cache, &queries)?;
        steps.push(step);
    }
    Ok(steps)
}

/// Median, fastest and slowest of the timed steps (milliseconds).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    pub ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
}

/// How timed steps meet the host (`--timing queued|synced|graph`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum StepTiming {
    /// Enqueued back to back, as a serving loop runs them: the host's launch
    /// work overlaps the step before, so each step's events time the GPU's
    /// work alone (kernels and the gaps between them).
    Queued,
    /// Each step waited for before the next is launched: the events also
    /// hold the host's launch latency, which the GPU idles through.
    Synced,
    /// Each cache copy's step captured once as a CUDA graph (as serving
    /// stacks run decode) and the graphs replayed queued: the GPU's work
    /// even where launching a step costs the host more than running it.
    Graph,
}

impl StepTiming {
    /// The name `--timing` takes (and the JSON writes).
    pub fn name(self) -> String {
        use clap::ValueEnum;
        let value = self.to_possible_value().expect("no variant is skipped");
        value.get_name().to_string()
    }
}

/// The serving shape a GPU run decodes: `batch` sequences whose `q_heads`
/// query heads share `kv_heads` kv heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct DecodeShape {
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    #[arg(long, default_value_t = 32)]
    pub q_heads: usize,
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
}

impl Default for DecodeShape {
    fn default() -> Self {
        DecodeShape {
            batch: 8,
            q_heads: 32,
            kv_heads: 8,
        }
    }
}

impl DecodeShape {
    /// The tune cache's bucket for this shape at `context` tokens.
    pub fn bucket(&self, context: usize) -> ShapeBucket {
        ShapeBucket::of(self.batch, self.q_heads, self.kv_heads, context)
    }
}

/// How a timing run steps: what [`upload_copies`] and [`time_steps`] take.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepPlan {
    pub warmup: usize,
    pub iters: usize,
    pub timing: StepTiming,
    /// L2-defeating rotation: at least this many bytes of distinct cache copies.
    pub rotate_bytes: u64,
}

impl StepPlan {
    /// Rotating over 512 MiB of copies: several times any GPU's L2.
    pub fn new(warmup: usize, iters: usize, timing: StepTiming) -> StepPlan {
        StepPlan {
            warmup,
            iters,
            timing,
            rotate_bytes: 512 << 20,
        }
    }
}

/// Each copy's step captured as a CUDA graph and replayed once.
fn capture_steps(
    gpu: &Gpu,
    kernels: &FormatKernels,
    caches: &[DeviceCache],
    steps: &mut [DeviceDecode],
) -> Result<Vec<CudaGraph>, CudaError> {
    let graphs = (steps.iter_mut().zip(caches))
        .map(|(step, cache)| step.capture(gpu, kernels, cache))
        .collect::<Result<Vec<_>, CudaError>>()?;
    for graph in &graphs {
        graph
            .launch()
            .during(|| "replaying a captured decode step".into())?;
    }
    gpu.stream
        .synchronize()
        .during(|| "waiting for the captured steps".into())?;
    Ok(graphs)
}

/// `warmup` untimed steps, then `iters` steps each between two CUDA events,
/// rotating over the copies, launched as `timing` says.
pub fn time_steps(
    gpu: &Gpu,
    kernels: &FormatKernels,
    caches: &[DeviceCache],
    steps: &mut [DeviceDecode],
    warmup: usize,
    iters: usize,
    timing: StepTiming,
) -> Result<Timing, CudaError> {
    let copies = caches.len();
    // `warmup` steps, then more, each waited for, until MIN_WARMUP has passed.
    let started = Instant::now();
    let mut i = 0;
    while i < warmup || started.elapsed() < MIN_WARMUP {
        let r = i % copies;
        steps[r].launch(gpu, kernels, &caches[r])?;
        if i + 1 >= warmup {
            gpu.stream
                .synchronize()
                .during(|| "waiting for a warm-up step".into())?;
        }
        i += 1;
    }
    let event = || {
        gpu.context
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .during(|| "creating an event".into())
    };
    let iters = iters.max(1);
    let events = (0..iters)
        .map(|_| Ok((event()?, event()?)))
        .collect::<Result<Vec<_>, CudaError>>()?;
    let graphs = match timing {
        StepTiming::Graph => Some(capture_steps(gpu, kernels, caches, steps)?),
        _ => None,
    };
    for (i, (start, end)) in events.iter().enumerate() {
        let r = i % copies;
        start
            .record(&gpu.stream)
            .during(|| "recording an event".into())?;
        match &graphs {
            Some(graphs) => graphs[r]
                .launch()
                .during(|| "replaying a captured decode step".into())?,
            None => steps[r].launch(gpu, kernels, &caches[r])?,
        }
        end.record(&gpu.stream)
            .during(|| "recording an event".into())?;
        if timing == StepTiming::Synced {
            end.synchronize()
                .during(|| "waiting for a decode step".into())?;
        }
    }
    let mut times = events
        .iter()
        .map(|(start, end)| {
            end.synchronize()
                .during(|| "waiting for a decode step".into())?;
            start
                .elapsed_ms(end)
                .map(f64::from)
                .during(|| "reading an event".into())
        })
        .collect::<Result<Vec<_>, CudaError>>()?;
    times.sort_by(f64::total_cmp);
    Ok(Timing {
        ms: times[times.len() / 2],
        min_ms: times[0],
        max_ms: times[times.len() - 1],
    })
}
