//! CPU decode throughput: the Cranelift JIT on every bundled spec and tier,
//! against the reference interpreter and hand-written dense decodes.
//!
//! Shape: 4 sequences x 8 kv heads x 4 query heads per kv head x 8192 tokens,
//! head_dim 128, every page of a run in one tier.
//!
//! - `jit/<spec>/<tier>`: `JitExecutor::decode` over the whole shape.
//! - `interp/<spec>/<tier>`: the interpreter on 1 sequence x 1 kv head (its 4
//!   query heads), 1/32 of the shape; the summary scales it by 32 (its cost is
//!   linear in rows x tokens and it runs on one thread).
//! - `dense/f16`, `dense/f32`: plain Rust dense decode reading f16 (converted
//!   to f32 by `half`'s slice conversion, F16C where the CPU has it) or f32
//!   keys and values, split over threads by (sequence, kv head) like the JIT,
//!   compiled for AVX2 and FMA when the CPU has them (the JIT also targets the
//!   host).
//! - `memory/read`: summing a 512 MiB buffer on every thread, the bandwidth
//!   reference for "memory-bound".
//!
//! `cargo bench --bench decode` prints a summary table (fastest iteration of
//! each benchmark) after criterion's output; criterion's filters
//! (`-- jit/kivi`) skip both the setup and the rows of what they exclude.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};
use half::f16;
use half::slice::HalfFloatSliceExt;
use kvcc::compiler::back::interp::{Interpreter, Options};
use kvcc::compiler::Format;
use kvcc::runtime::builtin::SPECS;
use kvcc::runtime::cache::{self, PagedCache};
use kvcc::runtime::encode::TrainOptions;
use kvcc::runtime::exec::{Executor, JitExecutor};
use kvcc::runtime::synth::{synthesize, SynthKv, SynthOptions};

const SEQUENCES: usize = 4;
const KV_HEADS: usize = 8;
const GROUP: usize = 4;
const Q_HEADS: usize = KV_HEADS * GROUP;
const TOKENS: usize = 8192;
const HEAD_DIM: usize = 128;
/// Bytes `memory/read` sums.
const MEMORY_BYTES: usize = 512 << 20;
/// The interpreter runs 1 of the shape's (sequence, kv head) pairs.
const INTERP_SCALE: f64 = (SEQUENCES * KV_HEADS) as f64;

/// The synthetic K/V/Q of every sequence (`[kv_head][token][d]`, `[q_head][d]`).
fn sequences() -> &'static [SynthKv] {
    static DATA: OnceLock<Vec<SynthKv>> = OnceLock::new();
    DATA.get_or_init(|| {
        (0..SEQUENCES)
            .map(|s| {
                synthesize(&SynthOptions {
                    seed: 0x6b76_6363 + s as u64,
                    kv_heads: KV_HEADS,
                    q_heads: Q_HEADS,
                    tokens: TOKENS,
                    head_dim: HEAD_DIM,
                })
            })
            .collect()
    })
}

fn queries() -> Vec<f32> {
    sequences()
        .iter()
        .flat_map(|s| s.queries.iter().copied())
        .collect()
}

/// Per-iteration seconds of every benchmark that ran, for the summary.
static TIMES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

/// A criterion group whose benchmarks also record their times under
/// `name/id` for the summary.
struct Group<'c> {
    name: &'static str,
    group: BenchmarkGroup<'c, WallTime>,
}

impl<'c> Group<'c> {
    fn new(
        c: &'c mut Criterion,
        name: &'static str,
        warm_up: Duration,
        measurement: Duration,
    ) -> Group<'c> {
        let mut group = c.benchmark_group(name);
        group
            .sample_size(10)
            .warm_up_time(warm_up)
            .measurement_time(measurement);
        Group { name, group }
    }

    /// Benchmarks `work`, which reads `bytes` per iteration.
    fn bench(&mut self, id: &str, bytes: u64, mut work: impl FnMut()) {
        let name = format!("{}/{id}", self.name);
        self.group.throughput(Throughput::Bytes(bytes));
        self.group.bench_function(id, |b| {
            // Untimed: builds the inputs on first use, compiles kernels.
            work();
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    work();
                }
                let elapsed = start.elapsed();
                let mut times = TIMES.lock().expect("times");
                times
                    .entry(name.clone())
                    .or_default()
                    .push(elapsed.as_secs_f64() / iters as f64);
                elapsed
            })
        });
    }

    fn finish(self) {
        self.group.finish();
    }
}

/// One spec's caches (one per tier, every page in that tier), built on first use.
struct Prepared {
    format: Format,
    caches: Vec<PagedCache>,
}

fn prepare(format: &Format) -> Prepared {
    let data = sequences();
    let options = TrainOptions {
        seed: 7,
        max_samples: 8192,
        iterations: 8,
    };
    let tables =
        cache::train(format, &data[0].keys, &data[0].values, KV_HEADS, &options).expect("train");
    let caches = (0..format.tiers().len())
        .map(|tier| {
            let mut cache = PagedCache::new(format, KV_HEADS, tables.clone()).expect("cache");
            for s in data {
                cache
                    .append_sequence(&s.keys, &s.values, |_| tier)
                    .expect("append");
            }
            cache
        })
        .collect();
    Prepared {
        format: format.clone(),
        caches,
    }
}

fn bench_formats(c: &mut Criterion) {
    let formats: Vec<Format> = SPECS
        .iter()
        .map(|(file, source)| Format::parse(source, file).expect("bundled spec"))
        .collect();
    let prepared: Vec<OnceLock<Prepared>> = formats.iter().map(|_| OnceLock::new()).collect();
    let queries = queries();
    let jit = JitExecutor::default();
    let mut g = Group::new(c, "jit", Duration::from_secs(1), Duration::from_secs(3));
    for (format, prepared) in formats.iter().zip(&prepared) {
        for tier in 0..format.tiers().len() {
            let id = format!("{}/{}", format.name(), format.layout(tier).name);
            let bytes = (SEQUENCES * KV_HEADS * TOKENS.div_ceil(format.spec().page.items as usize))
                as u64
                * u64::from(format.layout(tier).page_bytes);
            g.bench(&id, bytes, || {
                let cache = &prepared.get_or_init(|| prepare(format)).caches[tier];
                jit.decode(cache, &queries, Q_HEADS).expect("jit decode");
            });
        }
    }
    g.finish();
    let mut g = Group::new(
        c,
        "interp",
        Duration::from_millis(500),
        Duration::from_secs(2),
    );
    for (format, prepared) in formats.iter().zip(&prepared) {
        for tier in 0..format.tiers().len() {
            let id = format!("{}/{}", format.name(), format.layout(tier).name);
            let bytes = (TOKENS.div_ceil(format.spec().page.items as usize)) as u64
                * u64::from(format.layout(tier).page_bytes);
            g.bench(&id, bytes, || {
                let p = prepared.get_or_init(|| prepare(format));
                let interp = Interpreter::new(p.format.tiers(), Options::default());
                let view = p.caches[tier].view();
                // Sequence 0, kv head 0: query heads 0..GROUP.
                for query in sequences()[0].queries.chunks(HEAD_DIM).take(GROUP) {
                    interp.attend(&view, 0, 0, query).expect("interp");
                }
            });
        }
    }
    g.finish();
}

/// A stored K/V element type the dense baseline reads.
trait Stored: Copy + Send + Sync {
    /// Row `src` as f32: the row itself, or converted into `scratch`.
    fn row<'a>(src: &'a [Self], scratch: &'a mut [f32]) -> &'a [f32];
}

impl Stored for f32 {
    fn row<'a>(src: &'a [f32], _: &'a mut [f32]) -> &'a [f32] {
        src
    }
}

impl Stored for f16 {
    fn row<'a>(src: &'a [f16], scratch: &'a mut [f32]) -> &'a [f32] {
        src.convert_to_f32_slice(scratch);
        scratch
    }
}

/// Dense decode of one (sequence, kv head): the group's logits, a two-pass
/// softmax, the weighted sum of the values. `keys`, `values`: `[token][d]`;
/// `queries`, `out`: `[group][d]`.
#[inline(always)]
fn dense_group<T: Stored>(keys: &[T], values: &[T], queries: &[f32], out: &mut [f32]) {
    let d = HEAD_DIM;
    let scale = 1.0 / (d as f32).sqrt();
    let mut scratch = [0.0f32; HEAD_DIM];
    let mut weights = vec![0.0f32; GROUP * TOKENS];
    for (t, key) in keys.chunks_exact(d).enumerate() {
        let key = T::row(key, &mut scratch);
        for (h, q) in queries.chunks_exact(d).enumerate() {
            // 16 partial sums so the compiler can vectorize the reduction.
            let mut partial = [0.0f32; 16];
            for (q, k) in q.chunks_exact(16).zip(key.chunks_exact(16)) {
                for j in 0..16 {
                    partial[j] += q[j] * k[j];
                }
            }
            weights[h * TOKENS + t] = partial.iter().sum::<f32>() * scale;
        }
    }
    let mut sums = [0.0f32; GROUP];
    for (h, logits) in weights.chunks_exact_mut(TOKENS).enumerate() {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for l in logits.iter_mut() {
            *l = (*l - max).exp();
            sums[h] += *l;
        }
    }
    out.fill(0.0);
    for (t, value) in values.chunks_exact(d).enumerate() {
        let value = T::row(value, &mut scratch);
        for (h, o) in out.chunks_exact_mut(d).enumerate() {
            let w = weights[h * TOKENS + t];
            for (o, v) in o.iter_mut().zip(value) {
                *o += w * v;
            }
        }
    }
    for (o, sum) in out.chunks_exact_mut(d).zip(sums) {
        o.iter_mut().for_each(|x| *x /= sum);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dense_group_avx2<T: Stored>(keys: &[T], values: &[T], queries: &[f32], out: &mut [f32]) {
    dense_group(keys, values, queries, out)
}

fn dense_group_host<T: Stored>(keys: &[T], values: &[T], queries: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the features were just detected.
        return unsafe { dense_group_avx2(keys, values, queries, out) };
    }
    dense_group(keys, values, queries, out)
}

/// Keys and values `[sequence][kv_head][token][d]` as `T`.
fn dense_kv<T>(convert: impl Fn(f32) -> T) -> (Vec<T>, Vec<T>) {
    let data = sequences();
    let keys = data
        .iter()
        .flat_map(|s| s.keys.iter().map(|&x| convert(x)))
        .collect();
    let values = data
        .iter()
        .flat_map(|s| s.values.iter().map(|&x| convert(x)))
        .collect();
    (keys, values)
}

/// Every (sequence, kv head) over the machine's threads.
fn dense_decode<T: Stored>(keys: &[T], values: &[T], queries: &[f32], out: &mut [f32]) {
    let per_head = TOKENS * HEAD_DIM;
    let rows = GROUP * HEAD_DIM;
    let tasks = SEQUENCES * KV_HEADS;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(tasks);
    let next = AtomicUsize::new(0);
    let outputs: Vec<Mutex<&mut [f32]>> = out.chunks_exact_mut(rows).map(Mutex::new).collect();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let task = next.fetch_add(1, Ordering::Relaxed);
                if task >= tasks {
                    return;
                }
                let kv = task * per_head..(task + 1) * per_head;
                let mut out = outputs[task].lock().expect("output rows");
                dense_group_host(
                    &keys[kv.clone()],
                    &values[kv],
                    &queries[task * rows..(task + 1) * rows],
                    &mut out,
                );
            });
        }
    });
}

fn bench_dense(c: &mut Criterion) {
    let queries = queries();
    let mut out = vec![0.0f32; queries.len()];
    let mut g = Group::new(c, "dense", Duration::from_secs(1), Duration::from_secs(3));
    let elements = (SEQUENCES * KV_HEADS * TOKENS * HEAD_DIM * 2) as u64;
    let f16s: OnceLock<(Vec<f16>, Vec<f16>)> = OnceLock::new();
    g.bench("f16", 2 * elements, || {
        let (k, v) = f16s.get_or_init(|| dense_kv(f16::from_f32));
        dense_decode(k, v, &queries, &mut out);
    });
    let f32s: OnceLock<(Vec<f32>, Vec<f32>)> = OnceLock::new();
    g.bench("f32", 4 * elements, || {
        let (k, v) = f32s.get_or_init(|| dense_kv(|x| x));
        dense_decode(k, v, &queries, &mut out);
    });
    g.finish();
}

fn bench_memory(c: &mut Criterion) {
    let words: OnceLock<Vec<u64>> = OnceLock::new();
    let len = MEMORY_BYTES / 8;
    let mut g = Group::new(c, "memory", Duration::from_secs(1), Duration::from_secs(2));
    g.bench("read", MEMORY_BYTES as u64, || {
        let words = words.get_or_init(|| (0..len as u64).collect());
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let total: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = words
                .chunks(len.div_ceil(threads))
                .map(|part| s.spawn(move || part.iter().fold(0u64, |a, &w| a.wrapping_add(w))))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("reader"))
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
    });
    g.finish();
}

/// The fastest per-iteration time: on a machine shared with other work, the
/// least disturbed run estimates the code's cost best (criterion's own
/// report above keeps mean and spread).
fn fastest(times: &[f64]) -> f64 {
    times.iter().copied().fold(f64::INFINITY, f64::min)
}

/// A markdown table of what ran: per spec and tier the JIT's time and
/// bandwidth, and its speedup over the interpreter and the dense baselines.
fn summary() {
    let times = TIMES.lock().expect("times");
    let time = |id: &str| times.get(id).map(|t| fastest(t));
    let formats: Vec<Format> = SPECS
        .iter()
        .map(|(file, source)| Format::parse(source, file).expect("bundled spec"))
        .collect();
    let (dense16, dense32) = (time("dense/f16"), time("dense/f32"));
    let elements = (SEQUENCES * KV_HEADS * TOKENS * HEAD_DIM * 2) as f64;
    println!("\n| spec | tier | B/token | MB read | JIT ms | JIT GB/s | interp ms (x{INTERP_SCALE}) | vs interp | vs dense f16 | vs dense f32 |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let ratio = |a: Option<f64>, b: f64| a.map_or("-".to_string(), |a| format!("{:.1}x", a / b));
    for format in &formats {
        for tier in 0..format.tiers().len() {
            let id = format!("{}/{}", format.name(), format.layout(tier).name);
            let Some(jit) = time(&format!("jit/{id}")) else {
                continue;
            };
            let layout = format.layout(tier);
            let pages = SEQUENCES * KV_HEADS * TOKENS.div_ceil(layout.items_per_page as usize);
            let bytes = (pages * layout.page_bytes as usize) as f64;
            let interp = time(&format!("interp/{id}")).map(|t| t * INTERP_SCALE);
            println!(
                "| {} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {} | {} | {} | {} |",
                format.name(),
                layout.name,
                bytes / (SEQUENCES * KV_HEADS * TOKENS) as f64,
                bytes / 1e6,
                jit * 1e3,
                bytes / jit / 1e9,
                interp.map_or("-".to_string(), |t| format!("{:.0}", t * 1e3)),
                ratio(interp, jit),
                ratio(dense16, jit),
                ratio(dense32, jit),
            );
        }
    }
    for (name, t, bytes) in [
        ("dense f16", dense16, 2.0 * elements),
        ("dense f32", dense32, 4.0 * elements),
    ] {
        if let Some(t) = t {
            println!(
                "| {name} baseline | - | {:.0} | {:.1} | {:.2} | {:.2} | | | | |",
                bytes / (SEQUENCES * KV_HEADS * TOKENS) as f64,
                bytes / 1e6,
                t * 1e3,
                bytes / t / 1e9
            );
        }
    }
    if let Some(t) = time("memory/read") {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        println!(
            "\nmemory/read: {:.2} GB/s on {threads} threads",
            MEMORY_BYTES as f64 / t / 1e9
        );
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench_memory(&mut c);
    bench_dense(&mut c);
    bench_formats(&mut c);
    c.final_summary();
    summary();
}
