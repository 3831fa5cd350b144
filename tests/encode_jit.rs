//! The Cranelift page encoders (`compiler::back::clif::compile_encoder`)
//! against the CPU encoder (`runtime::encode::encode_page`), every byte of
//! every page: each bundled tier and random specs (a fresh seed per run,
//! printed; `KVCC_TEST_SEED` replays), on fresh random rows with the
//! awkward cases the encoders' rounding rules are about: exact ties (equal
//! rows, equal coordinates, half-way codes), zero rows and an all-zero page,
//! large and tiny magnitudes, partial and empty pages, fp8 ties, subnormals
//! and saturation. Tables are trained on
//! ordinary rows of the same seed.

mod common;
#[path = "support/encode_check.rs"]
mod encode_check;

use common::{bundled, fresh_seed, random_specs, SplitMix64};
use kvcc::compiler::back::clif::{compile_encoder, EncodeError};
use kvcc::compiler::Format;
use kvcc::runtime::cache;
use kvcc::runtime::encode::{encode_page, TrainOptions};

/// Random specs per run.
const RANDOM_SPECS: usize = 12;

/// One row of `head_dim` values of a random kind.
fn row(rng: &mut SplitMix64, head_dim: usize, previous: Option<&[f32]>) -> Vec<f32> {
    let uniform = |rng: &mut SplitMix64| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
    match rng.below(10) {
        0 => vec![0.0; head_dim],
        1 if previous.is_some() => previous.unwrap().to_vec(),
        // Few distinct values, halves and quarters: ties in energies,
        // scores and half-way quantization steps.
        2 => (0..head_dim)
            .map(|_| (rng.below(9) as f32 - 4.0) * 0.25)
            .collect(),
        // One value repeated, sign flips.
        3 => {
            let v = 2.0 * uniform(rng) - 1.0;
            (0..head_dim)
                .map(|_| if rng.coin() { v } else { -v })
                .collect()
        }
        // Large magnitudes (f16 overflows, big radii and scales).
        4 => (0..head_dim)
            .map(|_| (2.0 * uniform(rng) - 1.0) * 1e5)
            .collect(),
        // Tiny magnitudes (subnormal f16 and bf16 results).
        5 => (0..head_dim)
            .map(|_| (2.0 * uniform(rng) - 1.0) * 1e-6)
            .collect(),
        // A single spike among zeros and -0.0.
        6 => {
            let mut r: Vec<f32> = (0..head_dim)
                .map(|_| if rng.coin() { 0.0 } else { -0.0 })
                .collect();
            r[rng.below(head_dim)] = 30.0 * (2.0 * uniform(rng) - 1.0);
            r
        }
        _ => (0..head_dim)
            .map(|_| 3.0 * (2.0 * uniform(rng) - 1.0))
            .collect(),
    }
}

/// `tokens` rows of awkward values.
fn rows(rng: &mut SplitMix64, tokens: usize, head_dim: usize) -> Vec<f32> {
    let mut out: Vec<f32> = Vec::with_capacity(tokens * head_dim);
    for t in 0..tokens {
        let previous = (t > 0).then(|| out[(t - 1) * head_dim..].to_vec());
        let r = row(rng, head_dim, previous.as_deref());
        out.extend(r);
    }
    out
}

/// `tokens` rows whose largest magnitude is `q / 2` for a code range `q`
/// of 1..=127 and every other value a multiple of 1/4: under a page, item
/// or component scale of exactly 1/2 half the codes fall half-way.
fn tie_rows(rng: &mut SplitMix64, tokens: usize, head_dim: usize) -> Vec<f32> {
    let q = rng.pick(&[1u32, 3, 7, 15, 31, 63, 127]);
    let mut out = Vec::with_capacity(tokens * head_dim);
    for _ in 0..tokens {
        let mut r: Vec<f32> = (0..head_dim)
            .map(|_| (rng.below(2 * q as usize + 1) as f32 - q as f32) * 0.25)
            .collect();
        for _ in 0..=head_dim / 8 {
            let at = rng.below(head_dim);
            r[at] = if rng.coin() { 0.5 } else { -0.5 } * q as f32;
        }
        out.extend(r);
    }
    out
}

/// `tokens` rows for the fp8 rounding rules: each row's first value is
/// `±448 · 2^k` (one `k` per page), so page and item scales are exactly
/// `2^k` (e4m3) or `2^(k-7)` (e5m2) and the other values, fp8 values and
/// exact ties between neighbouring ones (subnormal ones included) times
/// that scale, ±1 ulp, land exactly where they were put; under trained
/// (tensor, head) scales they saturate.
fn fp8_rows(rng: &mut SplitMix64, tokens: usize, head_dim: usize) -> Vec<f32> {
    use kvcc::compiler::spec::Fp8;
    let k = rng.below(7) as i32 - 3;
    let points: Vec<(Fp8, f32)> = [Fp8::E4m3, Fp8::E5m2]
        .into_iter()
        .flat_map(|format| {
            let values: Vec<f32> = (0..0x80)
                .map(|c| format.decode(c))
                .filter(|v| v.is_finite())
                .collect();
            let ties: Vec<f32> = values.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
            values.into_iter().chain(ties).map(move |v| (format, v))
        })
        .collect();
    let mut out = Vec::with_capacity(tokens * head_dim);
    for _ in 0..tokens {
        for c in 0..head_dim {
            let sign = if rng.coin() { 1.0 } else { -1.0 };
            if c == 0 {
                out.push(sign * 448.0 * 2f32.powi(k));
                continue;
            }
            let (format, p) = points[rng.below(points.len())];
            // The element's scale: 2^k for e4m3, 2^(k-7) for e5m2.
            let scale = 448.0 * 2f32.powi(k) / format.max();
            let v = sign * p * scale;
            let v = match rng.below(4) {
                0 => f32::from_bits(v.to_bits().wrapping_sub(1)),
                1 => f32::from_bits(v.to_bits() + 1),
                _ => v,
            };
            out.push(if v.is_finite() { v } else { 0.0 });
        }
    }
    out
}

/// Ordinary rows for training.
fn training_rows(rng: &mut SplitMix64, tokens: usize, head_dim: usize) -> Vec<f32> {
    (0..tokens * head_dim)
        .map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * 2.0)
        .collect()
}

/// Every tier of `format`: pages of several token counts, JIT against CPU.
fn check_format(format: &Format, seed: u64, what: &str) {
    let d = format.head_dim() as usize;
    let items = format.spec().page.items as usize;
    let mut rng = SplitMix64(seed);
    let tokens = (4 * items).max(64);
    let keys = training_rows(&mut rng, tokens, d);
    let values = training_rows(&mut rng, tokens, d);
    let options = TrainOptions {
        seed,
        max_samples: 2048,
        iterations: 3,
    };
    let tables = cache::train(format, &keys, &values, 1, &options).expect("train");
    for (t, tier_tables) in tables.iter().enumerate() {
        let layout = format.layout(t);
        let encoder = compile_encoder(format.name(), layout, &[])
            .unwrap_or_else(|e| panic!("{what}: compiling tier {}: {e}", layout.name));
        let tables = &tier_tables[0];
        let counts = [items, items, items, rng.below(items + 1), 0, items];
        for (case, &count) in counts.iter().enumerate() {
            let (k, v) = match case {
                1 => (tie_rows(&mut rng, count, d), tie_rows(&mut rng, count, d)),
                // An all-zero page: scales of 1, every score tied.
                2 => (vec![0.0; count * d], vec![0.0; count * d]),
                5 => (fp8_rows(&mut rng, count, d), fp8_rows(&mut rng, count, d)),
                _ => (rows(&mut rng, count, d), rows(&mut rng, count, d)),
            };
            let bytes = layout.page_bytes as usize;
            let mut want = vec![0u8; bytes];
            encode_page(layout, tables, &k, &v, &mut want).expect("CPU encode");
            // Stale bytes in the destination must not survive.
            let mut got = vec![0xA5u8; bytes];
            let n = encoder
                .encode(tables, &k, &v, &mut got)
                .unwrap_or_else(|e| panic!("{what}: tier {}: {e}", layout.name));
            assert_eq!(n, count);
            let problems: Vec<String> = got
                .iter()
                .zip(&want)
                .enumerate()
                .filter(|(_, (g, w))| g != w)
                .take(12)
                .map(|(at, (g, w))| {
                    format!(
                        "byte {at}: JIT {g:#04x}, CPU {w:#04x} — {}",
                        encode_check::describe(layout, at)
                    )
                })
                .collect();
            assert!(
                problems.is_empty(),
                "{what}: tier {} page {case} ({count} tokens): JIT page differs from the CPU encoder's:\n{}",
                layout.name,
                problems.join("\n")
            );
        }
    }
}

#[test]
fn jit_encoders_match_cpu_encoder_on_bundled_tiers() {
    let seed = fresh_seed("jit_encoders_bundled");
    for format in bundled() {
        let what = format!("{} (KVCC_TEST_SEED={seed})", format.name());
        check_format(&format, seed, &what);
    }
}

#[test]
fn jit_encoders_match_cpu_encoder_on_random_specs() {
    let seed = fresh_seed("jit_encoders_random_specs");
    for (i, source) in random_specs(seed, RANDOM_SPECS).iter().enumerate() {
        let format = Format::parse(source, "random.toml")
            .unwrap_or_else(|e| panic!("generated spec rejected: {e}\n{source}"));
        let what = format!("random spec {i} (KVCC_TEST_SEED={seed}):\n{source}");
        check_format(&format, seed.wrapping_add(i as u64), &what);
    }
}

/// Bad arguments are errors, never panics or reads out of bounds.
#[test]
fn jit_encoder_checks_its_arguments() {
    let format = bundled()
        .into_iter()
        .find(|f| f.name() == "kivi")
        .expect("bundled kivi");
    let layout = format.layout(0);
    let d = format.head_dim() as usize;
    let items = layout.items_per_page as usize;
    let encoder = compile_encoder(format.name(), layout, &[]).expect("compile");
    let mut rng = SplitMix64(7);
    let keys = training_rows(&mut rng, 2 * items, d);
    let tables = cache::train(&format, &keys, &keys, 1, &TrainOptions::default()).expect("train");
    let tables = &tables[0][0];
    let mut page = vec![0u8; layout.page_bytes as usize];
    let one = &keys[..d];
    let err = |r: Result<usize, EncodeError>| r.expect_err("refused");
    assert!(matches!(
        err(encoder.encode(tables, &keys[..d + 1], one, &mut page)),
        EncodeError::Ragged { .. }
    ));
    assert!(matches!(
        err(encoder.encode(tables, &keys[..2 * d], one, &mut page)),
        EncodeError::KeysValues { .. }
    ));
    assert!(matches!(
        err(encoder.encode(tables, &keys, &keys, &mut page)),
        EncodeError::PageOverflow { .. }
    ));
    let mut nan = one.to_vec();
    nan[3] = f32::NAN;
    assert!(matches!(
        err(encoder.encode(tables, one, &nan, &mut page)),
        EncodeError::NonFinite {
            row: 0,
            channel: 3,
            ..
        }
    ));
    let mut extra = tables.clone();
    extra.push(vec![1.0]);
    assert!(matches!(
        err(encoder.encode(&extra, one, one, &mut page)),
        EncodeError::Tables { .. }
    ));
    assert!(matches!(
        err(encoder.encode(tables, one, one, &mut page[1..])),
        EncodeError::Page { .. }
    ));
}
