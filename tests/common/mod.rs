//! Shared fixtures for the workspace integration tests.
#![allow(dead_code)]

use kvcc::compiler::Format;
use kvcc::runtime::builtin::SPECS;
use kvcc::runtime::cache::{self, PagedCache};
use kvcc::runtime::encode::TrainOptions;
use kvcc::runtime::synth::{synthesize, SynthKv, SynthOptions};

pub fn bundled() -> Vec<Format> {
    SPECS
        .iter()
        .map(|(file, source)| Format::parse(source, file).unwrap_or_else(|e| panic!("{file}: {e}")))
        .collect()
}

/// A fresh seed per run (so every run exercises new inputs), printed for replay;
/// `KVCC_TEST_SEED` pins it.
pub fn fresh_seed(test: &str) -> u64 {
    let seed = std::env::var("KVCC_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: KVCC_TEST_SEED={seed}");
    seed
}

pub fn data(format: &Format, seed: u64, kv_heads: usize, q_heads: usize, tokens: usize) -> SynthKv {
    synthesize(&SynthOptions {
        seed,
        kv_heads,
        q_heads,
        tokens,
        head_dim: format.head_dim() as usize,
    })
}

pub fn trained_cache(format: &Format, data: &SynthKv, seed: u64) -> PagedCache {
    let options = TrainOptions {
        seed,
        max_samples: 4096,
        iterations: 6,
    };
    let tables =
        cache::train(format, &data.keys, &data.values, data.kv_heads, &options).expect("train");
    PagedCache::new(format, data.kv_heads, tables).expect("cache")
}

/// Asserts every element of `got` is within `tolerance` relative to the largest
/// magnitude of `want`'s row (outputs are vectors; per-element relative error
/// is meaningless near zero).
pub fn assert_rows_close(what: &str, got: &[f32], want: &[f32], row: usize, tolerance: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (r, (g, w)) in got.chunks(row).zip(want.chunks(row)).enumerate() {
        let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
        for (c, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(a.is_finite(), "{what}: row {r} channel {c} is {a}");
            assert!(
                (a - b).abs() <= tolerance * scale,
                "{what}: row {r} channel {c}: got {a}, want {b} (row scale {scale})"
            );
        }
    }
}
