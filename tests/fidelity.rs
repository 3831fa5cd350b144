//! Fidelity bands: every bundled spec and tier, encoded by the runtime's
//! trainers and encoders and read back by the reference interpreter, scored
//! against dense fp32 attention on the ORIGINAL (unencoded) K/V of structured
//! synthetic data (`kvcc::runtime::synth`). Each (spec, tier) must stay inside a
//! band set from measured numbers with moderate headroom (`docs/fidelity.md`),
//! so that a regression in a trainer, an encoder or the lowering (say, one that
//! doubles the error) fails here instead of passing as "lossy anyway".
//!
//! Everything is deterministic (fixed data seeds, the default trainer seed), so
//! the numbers only move when code moves. Print them with
//! `cargo test --release --test fidelity -- --nocapture`, and the per-part
//! breakdown behind `docs/fidelity.md` with
//! `cargo test --release --test fidelity -- --ignored --nocapture`.

mod common;

use std::sync::OnceLock;

use common::bundled;
use kvcc::compiler::back::interp::{Interpreter, Options};
use kvcc::compiler::Format;
use kvcc::runtime::cache::{self, PagedCache};
use kvcc::runtime::encode::TrainOptions;
use kvcc::runtime::metrics::{Fidelity, FidelityAccumulator};
use kvcc::runtime::reference::dense_attention;
use kvcc::runtime::synth::{synthesize, SynthKv, SynthOptions, SINK_TOKENS};

/// Fixed data seeds; every band holds for the worst of them.
const SEEDS: [u64; 3] = [1, 2, 3];
const KV_HEADS: usize = 2;
/// Synth makes one decode query per query head, so query heads are the query
/// rows: 32 (groups of 16) give 32 rows per seed rather than 8, which keeps
/// the top-8 and output-error numbers from hinging on a handful of rows.
const Q_HEADS: usize = 32;
const TOKENS: usize = 1024;

/// The acceptance band of one (spec, tier), applied to the worst seed.
struct Band {
    spec: &'static str,
    /// A tier name, or "mixed" (pages cycling through every tier).
    tier: &'static str,
    max_output_rel_error: f64,
    max_logit_drift: f64,
    max_mean_logit_drift: f64,
    min_top8_overlap: f64,
}

const fn band(
    spec: &'static str,
    tier: &'static str,
    max_output_rel_error: f64,
    max_logit_drift: f64,
    max_mean_logit_drift: f64,
    min_top8_overlap: f64,
) -> Band {
    Band {
        spec,
        tier,
        max_output_rel_error,
        max_logit_drift,
        max_mean_logit_drift,
        min_top8_overlap,
    }
}

/// One row per bundled (spec, tier), plus "mixed" for multi-tier specs.
/// Columns: output rel error, max logit drift, mean logit drift (all upper
/// bounds), top-8 overlap (lower bound). Measured worst-of-3-seeds values are
/// in `docs/fidelity.md`. Rule: errors and drifts at about 1.5x measured
/// (output error capped at 1.2 where it is saturated near 1), top-8 at
/// measured minus about 0.1; dense_f16 at 1e-3 output error and top-8 1.0,
/// kivi int8 at 1% output error.
#[rustfmt::skip]
const BANDS: &[Band] = &[
    //    spec         tier        out err  max drift  mean drift  top-8
    band("dense_f16", "f16",       1e-3,    6e-3,      5e-4,       1.0),
    band("spherical", "high",      1.10,    11.5,      0.92,       0.40),
    band("spherical", "mid",       1.20,    16.0,      1.10,       0.16),
    band("spherical", "low",       1.20,    17.5,      1.38,       0.05),
    band("spherical", "mixed",     1.10,    11.5,      1.10,       0.40),
    band("kivi",      "int8",      0.01,    0.12,      0.011,      0.97),
    band("kivi",      "int4",      0.175,   1.8,       0.20,       0.82),
    band("kivi",      "mixed",     0.14,    1.05,      0.10,       0.86),
    band("subspace",  "rank32",    1.08,    5.2,       0.78,       0.58),
    band("shard",     "pca64_vq",  0.61,    3.6,       0.57,       0.64),
    band("mosaic",    "keep25",    1.20,    9.6,       0.83,       0.52),
    band("fp8",       "e4m3",      0.08,    0.76,      0.048,      0.85),
    band("kivi2",     "int2",      0.65,    6.2,       0.85,       0.61),
    band("kivi2",     "int3",      0.26,    2.7,       0.36,       0.75),
    band("kivi2",     "mixed",     0.68,    6.2,       0.62,       0.66),
];

/// Worst-over-seeds fidelity of one (spec, tier), and each seed's.
struct Measured {
    spec: String,
    tier: String,
    worst: Fidelity,
    per_seed: Vec<Fidelity>,
}

type Plan = Box<dyn Fn(usize) -> usize>;

/// The tier plans of `format`: each tier alone, then "mixed" when it has several.
fn plans(format: &Format) -> Vec<(String, Plan)> {
    let tiers = format.tiers().len();
    let mut plans: Vec<(String, Plan)> = (0..tiers)
        .map(|t| (format.layout(t).name.clone(), Box::new(move |_| t) as Plan))
        .collect();
    if tiers > 1 {
        plans.push(("mixed".to_string(), Box::new(move |p| p % tiers)));
    }
    plans
}

fn synth(format: &Format, seed: u64) -> SynthKv {
    synthesize(&SynthOptions {
        seed,
        kv_heads: KV_HEADS,
        q_heads: Q_HEADS,
        tokens: TOKENS,
        head_dim: format.head_dim() as usize,
    })
}

/// Trains tables on the data itself (as `kvcc demo` does) and encodes it.
fn encode(format: &Format, data: &SynthKv, tier_of_page: &dyn Fn(usize) -> usize) -> PagedCache {
    let tables = cache::train(
        format,
        &data.keys,
        &data.values,
        KV_HEADS,
        &TrainOptions::default(),
    )
    .expect("train");
    let mut cache = PagedCache::new(format, KV_HEADS, tables).expect("cache");
    cache
        .append_sequence(&data.keys, &data.values, tier_of_page)
        .expect("append");
    cache
}

/// Interpreter over the encoded pages vs dense attention over the original K/V.
fn score(format: &Format, seed: u64, tier_of_page: &dyn Fn(usize) -> usize) -> Fidelity {
    let d = format.head_dim() as usize;
    let data = synth(format, seed);
    let cache = encode(format, &data, tier_of_page);
    let interp = Interpreter::new(format.tiers(), Options::default());
    let view = cache.view();
    let scale = 1.0 / (d as f32).sqrt();
    let mut acc = FidelityAccumulator::default();
    for h in 0..Q_HEADS {
        let g = data.kv_head_of(h);
        let got = interp.attend(&view, 0, g, data.query(h)).expect("attend");
        let want = dense_attention(
            data.query(h),
            data.head_keys(g),
            data.head_values(g),
            d,
            scale,
        );
        acc.add_row(&got.output, &got.logits, &want.output, &want.logits);
    }
    acc.finish()
}

fn worst(per_seed: &[Fidelity]) -> Fidelity {
    Fidelity {
        output_rel_error: per_seed
            .iter()
            .map(|f| f.output_rel_error)
            .fold(0.0, f64::max),
        max_logit_drift: per_seed
            .iter()
            .map(|f| f.max_logit_drift)
            .fold(0.0, f64::max),
        mean_logit_drift: per_seed
            .iter()
            .map(|f| f.mean_logit_drift)
            .fold(0.0, f64::max),
        top8_overlap: per_seed.iter().map(|f| f.top8_overlap).fold(1.0, f64::min),
        attention_mass_recall: (per_seed.iter())
            .map(|f| f.attention_mass_recall)
            .fold(1.0, f64::min),
        rows: per_seed.iter().map(|f| f.rows).sum(),
    }
}

fn measure_all() -> Vec<Measured> {
    let mut out = Vec::new();
    for format in bundled() {
        for (tier, plan) in plans(&format) {
            let per_seed: Vec<Fidelity> =
                SEEDS.iter().map(|&s| score(&format, s, &*plan)).collect();
            out.push(Measured {
                spec: format.name().to_string(),
                tier,
                worst: worst(&per_seed),
                per_seed,
            });
        }
    }
    out
}

/// Measured once per test binary, shared by the tests below; printed for the record.
fn measured() -> &'static [Measured] {
    static CELL: OnceLock<Vec<Measured>> = OnceLock::new();
    CELL.get_or_init(|| {
        let all = measure_all();
        eprintln!("fidelity: seeds {SEEDS:?}, {TOKENS} tokens, {KV_HEADS} kv heads, {Q_HEADS} query heads; worst over seeds");
        eprintln!(
            "{:<10} {:<9} {:>11} {:>10} {:>10} {:>6}  per seed: out err / mean drift / top-8",
            "spec", "tier", "out rel err", "max drift", "mean drift", "top-8"
        );
        for m in &all {
            let seeds: Vec<String> =
                m.per_seed.iter().map(|f| format!("{:.4}/{:.4}/{:.3}", f.output_rel_error, f.mean_logit_drift, f.top8_overlap)).collect();
            let w = &m.worst;
            eprintln!(
                "{:<10} {:<9} {:>11.5} {:>10.4} {:>10.4} {:>6.3}  {}",
                m.spec,
                m.tier,
                w.output_rel_error,
                w.max_logit_drift,
                w.mean_logit_drift,
                w.top8_overlap,
                seeds.join("  ")
            );
        }
        all
    })
}

fn get(spec: &str, tier: &str) -> &'static Measured {
    measured()
        .iter()
        .find(|m| m.spec == spec && m.tier == tier)
        .unwrap_or_else(|| panic!("no measurement for {spec}/{tier}"))
}

#[test]
fn every_bundled_tier_stays_inside_its_fidelity_band() {
    let all = measured();
    // The table covers exactly the bundled (spec, tier) set.
    for m in all {
        assert!(
            BANDS.iter().any(|b| b.spec == m.spec && b.tier == m.tier),
            "no band for {}/{}: add one to BANDS",
            m.spec,
            m.tier
        );
    }
    for b in BANDS {
        assert!(
            all.iter().any(|m| m.spec == b.spec && m.tier == b.tier),
            "band {}/{} names no bundled tier",
            b.spec,
            b.tier
        );
    }
    let mut failures = Vec::new();
    for b in BANDS {
        let m = &get(b.spec, b.tier).worst;
        let name = format!("{}/{}", b.spec, b.tier);
        assert!(
            m.output_rel_error.is_finite()
                && m.max_logit_drift.is_finite()
                && m.mean_logit_drift.is_finite()
                && m.top8_overlap.is_finite(),
            "{name}: non-finite fidelity {m:?}"
        );
        if m.output_rel_error > b.max_output_rel_error {
            failures.push(format!(
                "{name}: output rel error {:.5} > {}",
                m.output_rel_error, b.max_output_rel_error
            ));
        }
        if m.max_logit_drift > b.max_logit_drift {
            failures.push(format!(
                "{name}: max logit drift {:.4} > {}",
                m.max_logit_drift, b.max_logit_drift
            ));
        }
        if m.mean_logit_drift > b.max_mean_logit_drift {
            failures.push(format!(
                "{name}: mean logit drift {:.4} > {}",
                m.mean_logit_drift, b.max_mean_logit_drift
            ));
        }
        if m.top8_overlap < b.min_top8_overlap {
            failures.push(format!(
                "{name}: top-8 overlap {:.3} < {}",
                m.top8_overlap, b.min_top8_overlap
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "fidelity outside its band (see docs/fidelity.md):\n{}",
        failures.join("\n")
    );
}

/// More bits, less error. Spherical's tiers differ only in their keys, and
/// for mid and low the output error is saturated (near 1, driven by how the
/// sink tokens' logits move), so mid vs low is not ordered reliably by output
/// error on this data; it is by the logit metrics, which are checked per seed.
#[test]
fn tier_ordering_matches_bit_budgets() {
    let m = |spec: &str, tier: &str| &get(spec, tier).worst;
    let (high, mid, low) = (
        m("spherical", "high"),
        m("spherical", "mid"),
        m("spherical", "low"),
    );
    assert!(
        high.output_rel_error <= mid.output_rel_error
            && high.output_rel_error <= low.output_rel_error,
        "spherical: high should have the lowest output error: high {:.4}, mid {:.4}, low {:.4}",
        high.output_rel_error,
        mid.output_rel_error,
        low.output_rel_error
    );
    let (int8, int4) = (m("kivi", "int8"), m("kivi", "int4"));
    assert!(
        int8.output_rel_error < int4.output_rel_error,
        "kivi: int8 {:.5} >= int4 {:.5}",
        int8.output_rel_error,
        int4.output_rel_error
    );
    for (i, seed) in SEEDS.iter().enumerate() {
        let f = |spec: &str, tier: &str| &get(spec, tier).per_seed[i];
        let (high, mid, low) = (
            f("spherical", "high"),
            f("spherical", "mid"),
            f("spherical", "low"),
        );
        assert!(
            high.mean_logit_drift <= mid.mean_logit_drift
                && mid.mean_logit_drift <= low.mean_logit_drift,
            "seed {seed}: spherical mean logit drift not high <= mid <= low: {:.4}, {:.4}, {:.4}",
            high.mean_logit_drift,
            mid.mean_logit_drift,
            low.mean_logit_drift
        );
        assert!(
            high.top8_overlap >= mid.top8_overlap && mid.top8_overlap >= low.top8_overlap,
            "seed {seed}: spherical top-8 overlap not high >= mid >= low: {:.3}, {:.3}, {:.3}",
            high.top8_overlap,
            mid.top8_overlap,
            low.top8_overlap
        );
        let (int8, int4) = (f("kivi", "int8"), f("kivi", "int4"));
        assert!(
            int8.output_rel_error < int4.output_rel_error
                && int8.mean_logit_drift < int4.mean_logit_drift,
            "seed {seed}: kivi int8 not better than int4: {int8:?} vs {int4:?}"
        );
    }
}

/// Where each format's error comes from (the numbers behind the notes in
/// `docs/fidelity.md`): relative reconstruction error of keys and values
/// (sink tokens apart), attention error with only the keys or only the values
/// decoded, and the sinks' share of attention before and after. Dense
/// attention over the decoded pages stands in for the interpreter (which
/// `tests/interpreter.rs` shows agrees with it).
#[test]
#[ignore = "diagnostic printout; run with --ignored --nocapture"]
fn error_breakdown() {
    eprintln!("spec/tier seed: key rel err sinks|rest; value rel err sinks|rest; out err keys-only|values-only; sink attention share ref -> keys decoded");
    for format in bundled() {
        let d = format.head_dim() as usize;
        let scale = 1.0 / (d as f32).sqrt();
        let sink = SINK_TOKENS * d;
        let rel = |a: &[f32], b: &[f32]| {
            let e: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
            let n: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
            (e / n).sqrt()
        };
        let sink_share = |logits: &[f32]| {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let w: Vec<f64> = logits.iter().map(|&l| f64::from(l - max).exp()).collect();
            w[..SINK_TOKENS].iter().sum::<f64>() / w.iter().sum::<f64>()
        };
        for (tier, plan) in plans(&format) {
            for &seed in &SEEDS {
                let data = synth(&format, seed);
                let cache = encode(&format, &data, &*plan);
                let (mut key_err, mut value_err) = ([0.0; 2], [0.0; 2]);
                let (mut keys_only, mut values_only) = (
                    FidelityAccumulator::default(),
                    FidelityAccumulator::default(),
                );
                let mut share = [0.0; 2];
                for g in 0..KV_HEADS {
                    let (keys, values) = cache.decode_dense(0, g);
                    let (k0, v0) = (data.head_keys(g), data.head_values(g));
                    key_err[0] += rel(&keys[..sink], &k0[..sink]) / KV_HEADS as f64;
                    key_err[1] += rel(&keys[sink..], &k0[sink..]) / KV_HEADS as f64;
                    value_err[0] += rel(&values[..sink], &v0[..sink]) / KV_HEADS as f64;
                    value_err[1] += rel(&values[sink..], &v0[sink..]) / KV_HEADS as f64;
                    for h in (0..Q_HEADS).filter(|&h| data.kv_head_of(h) == g) {
                        let q = data.query(h);
                        let want = dense_attention(q, k0, v0, d, scale);
                        let a = dense_attention(q, &keys, v0, d, scale);
                        keys_only.add_row(&a.output, &a.logits, &want.output, &want.logits);
                        let b = dense_attention(q, k0, &values, d, scale);
                        values_only.add_row(&b.output, &b.logits, &want.output, &want.logits);
                        share[0] += sink_share(&want.logits) / Q_HEADS as f64;
                        share[1] += sink_share(&a.logits) / Q_HEADS as f64;
                    }
                }
                eprintln!(
                    "{}/{} seed {seed}: key {:.3}|{:.3}; value {:.3}|{:.3}; out {:.4}|{:.4}; sinks {:.3} -> {:.3}",
                    format.name(),
                    tier,
                    key_err[0],
                    key_err[1],
                    value_err[0],
                    value_err[1],
                    keys_only.finish().output_rel_error,
                    values_only.finish().output_rel_error,
                    share[0],
                    share[1]
                );
            }
        }
    }
}
