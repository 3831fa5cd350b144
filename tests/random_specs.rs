//! Randomly generated valid specs, end to end: TOML text -> `Format::parse`
//! (front end, checks, layout, lowering, IR validation) -> training -> paged
//! encoding with a random page->tier plan -> the interpreter, compared element
//! by element with dense attention over the reference decoder's keys and values.
//!
//! The generator (`common::random_specs`) only produces specs the checker must
//! accept; a rejection is a generator (or checker) bug and fails with the
//! spec's TOML. Seeded by `common::fresh_seed` (`KVCC_TEST_SEED` replays a run);
//! every failure prints the spec's TOML and its index.

mod common;

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use common::{assert_rows_close, random_specs, SplitMix64};
use kvcc::compiler::back::interp::{Interpreter, Options};
use kvcc::compiler::spec::{CodecSpec, FieldSpec, TransformSpec};
use kvcc::compiler::Format;
use kvcc::runtime::cache::{self, PagedCache};
use kvcc::runtime::encode::TrainOptions;
use kvcc::runtime::reference::dense_attention;
use kvcc::runtime::synth::{synthesize, SynthOptions};

/// Specs per run: the first six have fixed head_dims (64 and 256 with 3 tiers,
/// then 16, 32, 96, 128), the rest are fully random.
const SPECS: usize = 40;

/// Compiles, trains, encodes two sequences with a random page->tier plan and
/// checks the interpreter against dense attention over the decoded pages.
fn check_spec(format: &Format, rng: &mut SplitMix64) {
    let d = format.head_dim() as usize;
    let tiers = format.tiers().len();
    let kv_heads = 1 + rng.below(2);
    let group = rng.pick(&[1usize, 2, 4]);
    let q_heads = kv_heads * group;
    // 1..200 tokens per sequence: page items 1, 7, 16, 64 leave most last pages partial.
    let sets: Vec<_> = (0..2)
        .map(|_| {
            let tokens = 1 + rng.below(200);
            synthesize(&SynthOptions {
                seed: rng.next_u64(),
                kv_heads,
                q_heads,
                tokens,
                head_dim: d,
            })
        })
        .collect();
    // Tables fitted to the first sequence (sometimes a single token).
    let options = TrainOptions {
        seed: rng.next_u64(),
        max_samples: 2048,
        iterations: 4,
    };
    let tables =
        cache::train(format, &sets[0].keys, &sets[0].values, kv_heads, &options).expect("train");
    let mut cache = PagedCache::new(format, kv_heads, tables).expect("cache");
    let items = format.spec().page.items as usize;
    for set in &sets {
        let plan: Vec<usize> = (0..set.options.tokens.div_ceil(items))
            .map(|_| rng.below(tiers))
            .collect();
        cache
            .append_sequence(&set.keys, &set.values, |p| plan[p])
            .expect("append");
    }
    let queries: Vec<f32> = sets
        .iter()
        .flat_map(|s| s.queries.iter().copied())
        .collect();
    let interp = Interpreter::new(format.tiers(), Options::default());
    let got = interp
        .decode(&cache.view(), &queries, q_heads)
        .expect("decode");
    let mut want = Vec::with_capacity(got.len());
    for (s, set) in sets.iter().enumerate() {
        for h in 0..q_heads {
            let (keys, values) = cache.decode_dense(s, h / group);
            assert!(
                keys.iter().chain(&values).all(|v| v.is_finite()),
                "sequence {s}, kv head {}: decoded keys/values not finite",
                h / group
            );
            let q = &set.queries[h * d..(h + 1) * d];
            want.extend(dense_attention(q, &keys, &values, d, 1.0 / (d as f32).sqrt()).output);
        }
    }
    let what = format!(
        "tokens {} + {}, kv_heads {kv_heads}, GQA group {group}",
        sets[0].options.tokens, sets[1].options.tokens
    );
    assert_rows_close(&what, &got, &want, d, 1e-4);
}

/// Which transform and body kinds a codec uses, for the coverage check.
fn kinds(codec: &CodecSpec) -> (&'static str, &'static str) {
    let transform = match codec.transform {
        TransformSpec::Identity => "identity",
        TransformSpec::Hadamard => "hadamard",
        TransformSpec::Srht { .. } => "srht",
        TransformSpec::Pca { .. } => "pca",
    };
    let body = match codec.fields[..] {
        [FieldSpec::Radius { .. }, ..] => "radius",
        [FieldSpec::Codebook { .. }] => "codebook",
        [FieldSpec::Coeff { .. }] => "coeff",
        [FieldSpec::Bitmap { .. }] => "bitmap",
        [FieldSpec::Dense { .. }] => "dense",
        _ => "other",
    };
    (transform, body)
}

#[test]
fn random_valid_specs_match_dense_attention() {
    let seed = common::fresh_seed("random_valid_specs_match_dense_attention");
    let sources = random_specs(seed, SPECS);
    assert_eq!(sources.len(), SPECS);
    let mut seen = std::collections::BTreeSet::new();
    for (index, source) in sources.iter().enumerate() {
        let mut rng = SplitMix64(seed ^ (index as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let format = Format::parse(source, "random.toml").unwrap_or_else(|e| {
                panic!("generator bug: the checker rejected a generated spec:\n{e}")
            });
            check_spec(&format, &mut rng);
            format
        }));
        match outcome {
            Ok(format) => {
                let spec = format.spec();
                seen.insert(format!("head_dim {}", spec.head_dim));
                if index < 2 {
                    assert_eq!(
                        (spec.head_dim, spec.tiers.len()),
                        ([64, 256][index], 3),
                        "fixed spec {index}"
                    );
                }
                for tier in &spec.tiers {
                    for codec in [&tier.key, &tier.value] {
                        let (transform, body) = kinds(codec);
                        seen.insert(format!("transform {transform}"));
                        seen.insert(format!("body {body}"));
                    }
                }
            }
            Err(panic) => {
                eprintln!(
                    "random spec {index} failed (KVCC_TEST_SEED={seed}); its TOML:\n{source}"
                );
                resume_unwind(panic);
            }
        }
    }
    let want = [
        "head_dim 16",
        "head_dim 32",
        "head_dim 64",
        "head_dim 96",
        "head_dim 128",
        "head_dim 256",
        "transform identity",
        "transform hadamard",
        "transform srht",
        "transform pca",
        "body dense",
        "body coeff",
        "body codebook",
        "body radius",
        "body bitmap",
    ];
    for w in want {
        assert!(seen.contains(w), "{w} never generated (seen: {seen:?})");
    }
}

#[test]
fn generator_is_deterministic_and_seed_dependent() {
    assert_eq!(random_specs(42, 8), random_specs(42, 8));
    assert_ne!(random_specs(42, 8), random_specs(43, 8));
    // A prefix of a longer batch is the shorter batch.
    assert_eq!(random_specs(7, 10)[..6], random_specs(7, 6)[..]);
}

/// The GPU benchmark corpus (`benches/gpu/build.sh` writes it with
/// `KVCC_CORPUS_DIR`): a fixed seed, so runs compare, and at least 20 specs
/// with every transform and body between them, each a spec file that
/// compiles with no ragged names.
#[test]
fn the_benchmark_corpus_compiles_and_covers_every_kind() {
    const CORPUS_SEED: u64 = 0x6b76_6363_3333;
    const CORPUS_SPECS: usize = 24;
    let specs = random_specs(CORPUS_SEED, CORPUS_SPECS);
    let mut transforms = std::collections::BTreeSet::new();
    let mut bodies = std::collections::BTreeSet::new();
    for (index, text) in specs.iter().enumerate() {
        let format = Format::parse(text, &format!("random_{index}.toml"))
            .unwrap_or_else(|e| panic!("corpus spec {index}: {e}\n{text}"));
        for tier in &format.spec().tiers {
            for codec in [&tier.key, &tier.value] {
                transforms.insert(
                    format!("{:?}", codec.transform)
                        .split([' ', '{', '('])
                        .next()
                        .unwrap()
                        .to_string(),
                );
                for field in &codec.fields {
                    bodies.insert(
                        format!("{field:?}")
                            .split([' ', '{', '('])
                            .next()
                            .unwrap()
                            .to_string(),
                    );
                }
            }
        }
    }
    assert!(transforms.len() >= 4, "transforms {transforms:?}");
    assert!(bodies.len() >= 5, "field kinds {bodies:?}");
    if let Some(dir) = std::env::var_os("KVCC_CORPUS_DIR") {
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (index, text) in specs.iter().enumerate() {
            std::fs::write(dir.join(format!("random_{index}.toml")), text).unwrap();
        }
    }
}
