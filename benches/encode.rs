//! Page encoding: the encoders `kv_format!` generates (specialized per tier:
//! constant sizes and bit offsets, word-at-a-time packing) and the
//! Cranelift-compiled ones (`clif::compile_encoder`, what the JIT live cache
//! uses) against the generic runtime encoder
//! (`kvcc_runtime::encode::encode_page`, which walks the tier's layout at
//! run time), on the same pages with the same tables. All three write
//! byte-identical pages (`tests/kv_format.rs`, `tests/encode_jit.rs`).
//!
//! Per bundled spec and tier: `encode/<spec>/<tier>/generic`,
//! `.../kv_format` and `.../jit`, each encoding `PAGES` full pages of one kv
//! head of structured synthetic K/V. `cargo bench --bench encode` prints a
//! summary table (µs per page, speedups over generic) after criterion's
//! output; results and the machine they came from are in
//! `docs/kv-format-macro.md` and `docs/page-encoders.md`.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::Criterion;
use kvcc::compiler::back::clif::compile_encoder;
use kvcc::compiler::layout::TierLayout;
use kvcc::compiler::Format;
use kvcc::kv_format;
use kvcc::runtime::cache;
use kvcc::runtime::encode::{encode_page, EncodeError, TrainOptions};
use kvcc::runtime::synth::{synthesize, SynthOptions};

kv_format!("specs/dense_f16.toml");
kv_format!("specs/spherical.toml");
kv_format!("specs/kivi.toml");
kv_format!("specs/subspace.toml");
kv_format!("specs/shard.toml");
kv_format!("specs/mosaic.toml");

/// Full pages encoded per iteration.
const PAGES: usize = 8;

type EncodeFn = fn(&TierLayout, &[Vec<f32>], &[f32], &[f32], &mut [u8]) -> Result<(), EncodeError>;
type DynEncode =
    dyn Fn(&TierLayout, &[Vec<f32>], &[f32], &[f32], &mut [u8]) -> Result<(), EncodeError>;

/// Every generated format with its specialized encoder.
fn formats() -> [(&'static Format, EncodeFn); 6] {
    [
        (dense_f16::format(), dense_f16::encode_page),
        (spherical::format(), spherical::encode_page),
        (kivi::format(), kivi::encode_page),
        (subspace::format(), subspace::encode_page),
        (shard::format(), shard::encode_page),
        (mosaic::format(), mosaic::encode_page),
    ]
}

/// Per-iteration seconds of every benchmark that ran, for the summary.
static TIMES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

fn bench_encoders(c: &mut Criterion) {
    let mut group = c.benchmark_group("encode");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for (format, specialized) in formats() {
        let d = format.head_dim() as usize;
        let items = format.spec().page.items as usize;
        let kv = synthesize(&SynthOptions {
            seed: 0x6b76_6363,
            kv_heads: 1,
            q_heads: 1,
            tokens: PAGES * items,
            head_dim: d,
        });
        let tables =
            cache::train(format, &kv.keys, &kv.values, 1, &TrainOptions::default()).expect("train");
        for t in 0..format.tiers().len() {
            let layout = format.layout(t);
            let tables = &tables[t][0];
            let mut page = vec![0u8; layout.page_bytes as usize];
            let generic: EncodeFn = encode_page;
            let jit = compile_encoder(format.name(), layout, &[]).expect("compile the encoder");
            let jit = move |_: &TierLayout,
                            tables: &[Vec<f32>],
                            k: &[f32],
                            v: &[f32],
                            page: &mut [u8]| {
                jit.encode(tables, k, v, page)
                    .map(|_| ())
                    .map_err(|e| panic!("jit: {e}"))
            };
            let encoders: [(&str, &DynEncode); 3] = [
                ("generic", &generic),
                ("kv_format", &specialized),
                ("jit", &jit),
            ];
            for (encoder, encode) in encoders {
                let id = format!("{}/{}/{encoder}", format.name(), layout.name);
                group.bench_function(&id, |b| {
                    b.iter_custom(|iters| {
                        let start = Instant::now();
                        for _ in 0..iters {
                            for p in 0..PAGES {
                                let rows = p * items * d..(p + 1) * items * d;
                                encode(
                                    layout,
                                    tables,
                                    &kv.keys[rows.clone()],
                                    &kv.values[rows],
                                    &mut page,
                                )
                                .expect("encode");
                                std::hint::black_box(&page);
                            }
                        }
                        let elapsed = start.elapsed();
                        TIMES
                            .lock()
                            .expect("times")
                            .entry(id.clone())
                            .or_default()
                            .push(elapsed.as_secs_f64() / iters as f64);
                        elapsed
                    })
                });
            }
        }
    }
    group.finish();
}

fn median(times: &[f64]) -> f64 {
    let mut t = times.to_vec();
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// A markdown table of what ran: µs per page of each encoder and the
/// speedups over the generic one.
fn summary() {
    let times = TIMES.lock().expect("times");
    let time = |id: String| times.get(&id).map(|t| median(t) / PAGES as f64);
    println!(
        "\n| spec | tier | page B | generic µs/page | kv_format µs/page | speedup | jit µs/page | speedup |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for (format, _) in formats() {
        for t in 0..format.tiers().len() {
            let layout = format.layout(t);
            let id = format!("{}/{}", format.name(), layout.name);
            let (Some(generic), Some(specialized), Some(jit)) = (
                time(format!("{id}/generic")),
                time(format!("{id}/kv_format")),
                time(format!("{id}/jit")),
            ) else {
                continue;
            };
            println!(
                "| {} | {} | {} | {:.1} | {:.1} | {:.1}x | {:.1} | {:.1}x |",
                format.name(),
                layout.name,
                layout.page_bytes,
                generic * 1e6,
                specialized * 1e6,
                generic / specialized,
                jit * 1e6,
                generic / jit
            );
        }
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench_encoders(&mut c);
    c.final_summary();
    summary();
}
