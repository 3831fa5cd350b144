//! The Cranelift JIT executor against the reference interpreter: every
//! element of every output row within 1e-5 of the row's scale (the JIT is in
//! fact bit-exact), for every bundled spec and tier, mixed-tier sequences,
//! GQA groups of 1, 4 and 8, partial last pages and several sequences of
//! different lengths; then for randomly generated valid specs. Each case runs
//! two code shapes: SIMD with 4 heads per call, and scalar code with 3 heads
//! per call (so groups split into calls of 3, 2 and 1 heads). Kernels are
//! compiled once per spec, tier and options (the executor's process-wide
//! cache). Also: Cranelift and option errors surface as typed errors naming
//! the format and tier.

mod common;

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use common::{
    assert_rows_close, bitmap_mask_specs, bundled, cache_and_queries, data, fresh_seed,
    random_specs, scrambled_bitmap_masks, trained_cache, SplitMix64,
};
use kvcc::compiler::back::clif;
use kvcc::compiler::Format;
use kvcc::runtime::cache::PagedCache;
use kvcc::runtime::encode::encode_page;
use kvcc::runtime::exec::{ExecError, Executor, InterpExecutor, JitExecutor};

const TOLERANCE: f32 = 1e-5;

/// Random specs per run (the generator's first six have fixed head_dims).
const RANDOM_SPECS: usize = 24;

fn shapes() -> [clif::Options; 2] {
    [
        clif::Options::default(),
        clif::Options {
            lanes: 1,
            heads: 3,
            ..Default::default()
        },
    ]
}

/// The JIT in every shape against the interpreter, outputs and logits.
fn check(what: &str, format: &Format, cache: &PagedCache, queries: &[f32], q_heads: usize) {
    let want = InterpExecutor
        .decode_with_logits(cache, queries, q_heads)
        .expect("interpreter");
    for options in shapes() {
        let what = format!("{what}, lanes {} heads {}", options.lanes, options.heads);
        let jit = JitExecutor { options };
        let got = jit
            .decode_with_logits(cache, queries, q_heads)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let d = format.head_dim() as usize;
        assert_rows_close(&what, &got.outputs, &want.outputs, d, TOLERANCE);
        assert_eq!(got.logits.len(), want.logits.len(), "{what}: logit rows");
        for (row, (g, w)) in got.logits.iter().zip(&want.logits).enumerate() {
            assert_rows_close(
                &format!("{what}, logits of row {row}"),
                g,
                w,
                g.len().max(1),
                TOLERANCE,
            );
        }
        assert_eq!(
            jit.decode(cache, queries, q_heads).expect("decode"),
            got.outputs,
            "{what}: decode and decode_with_logits"
        );
    }
}

/// Bitmap masks with any number of set bits
/// ([`common::scrambled_bitmap_masks`]).
#[test]
fn bitmap_masks_with_any_number_of_set_bits_match_the_interpreter() {
    let seed = fresh_seed("jit_bitmap_masks");
    let scramble = scrambled_bitmap_masks(seed);
    for (what, format) in bitmap_mask_specs() {
        let (cache, queries) =
            cache_and_queries(&format, seed, 2, 8, &[1, 150, 333], &|_, _| 0, &scramble);
        check(&what, &format, &cache, &queries, 8);
    }
}

#[test]
fn every_bundled_tier_and_mix_matches_the_interpreter() {
    let seed = fresh_seed("jit_every_bundled_tier");
    for format in bundled() {
        let tiers = format.tiers().len();
        for group in [1, 4, 8] {
            let kv_heads = 2;
            // One sequence per tier, one mixing the tiers page by page, and a
            // single token; none a whole number of pages.
            let mut lengths = vec![150; tiers];
            lengths.extend([333, 1]);
            let plan = |s: usize, p: usize| if s < tiers { s } else { (s + p) % tiers };
            let (cache, queries) = cache_and_queries(
                &format,
                seed,
                kv_heads,
                kv_heads * group,
                &lengths,
                &plan,
                &encode_page,
            );
            let what = format!("{} group {group}", format.name());
            check(&what, &format, &cache, &queries, kv_heads * group);
        }
    }
}

#[test]
fn random_valid_specs_match_the_interpreter() {
    let seed = fresh_seed("jit_random_valid_specs");
    for (index, source) in random_specs(seed, RANDOM_SPECS).iter().enumerate() {
        let mut rng = SplitMix64(seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let format = Format::parse(source, "random.toml").expect("generated specs are valid");
            let tiers = format.tiers().len();
            let kv_heads = 1 + rng.below(2);
            let group = rng.pick(&[1usize, 4, 8]);
            let lengths: Vec<usize> = (0..2 + rng.below(2)).map(|_| 1 + rng.below(200)).collect();
            let plans: Vec<Vec<usize>> = lengths
                .iter()
                .map(|&t| {
                    (0..t.div_ceil(format.spec().page.items as usize))
                        .map(|_| rng.below(tiers))
                        .collect()
                })
                .collect();
            let (cache, queries) = cache_and_queries(
                &format,
                rng.next_u64(),
                kv_heads,
                kv_heads * group,
                &lengths,
                &|s, p| plans[s][p],
                &encode_page,
            );
            let what = format!(
                "random spec {index}: tokens {lengths:?}, kv_heads {kv_heads}, group {group}"
            );
            check(&what, &format, &cache, &queries, kv_heads * group);
        }));
        if let Err(panic) = outcome {
            eprintln!("random spec {index} failed (KVCC_TEST_SEED={seed}); its TOML:\n{source}");
            resume_unwind(panic);
        }
    }
}

#[test]
fn cranelift_and_option_errors_are_typed_and_name_format_and_tier() {
    let format = bundled()
        .into_iter()
        .find(|f| f.name() == "kivi")
        .expect("kivi");
    let tier = &format.tiers()[1];
    let bad_setting = clif::Options {
        settings: vec![("opt_level".into(), "fastest".into())],
        ..Default::default()
    };
    let error = clif::compile(tier, &bad_setting).expect_err("opt_level fastest does not exist");
    assert_eq!(
        (error.format.as_str(), error.tier.as_str()),
        ("kivi", "int4")
    );
    assert!(
        matches!(&error.kind, clif::ErrorKind::Setting { name, value, .. } if name == "opt_level" && value == "fastest"),
        "{error:?}"
    );
    let unknown = clif::Options {
        settings: vec![("no_such_setting".into(), "1".into())],
        ..Default::default()
    };
    assert!(matches!(
        clif::compile(tier, &unknown).map_err(|e| e.kind),
        Err(clif::ErrorKind::Setting { .. })
    ));
    for options in [
        clif::Options {
            heads: 0,
            ..Default::default()
        },
        clif::Options {
            lanes: 3,
            ..Default::default()
        },
    ] {
        assert!(matches!(
            clif::compile(tier, &options).map_err(|e| e.kind),
            Err(clif::ErrorKind::Options(_))
        ));
    }

    // Through the executor: the first tier that fails is named.
    let set = data(&format, 1, 1, 1, 10);
    let mut cache = trained_cache(&format, &set, 1);
    cache
        .append_sequence(&set.keys, &set.values, |_| 0)
        .expect("append");
    let jit = JitExecutor {
        options: bad_setting,
    };
    match jit.decode(&cache, &set.queries, 1) {
        Err(ExecError::Backend {
            executor,
            format,
            tier,
            message,
        }) => {
            assert_eq!(
                (executor, format.as_str(), tier.as_str()),
                ("jit", "kivi", "int8")
            );
            assert!(message.contains("opt_level"), "{message}");
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
    // Host-side checks come first and are the interpreter's.
    assert_eq!(
        jit.decode(&cache, &set.queries[1..], 1)
            .map_err(|e| e.to_string()),
        InterpExecutor
            .decode(&cache, &set.queries[1..], 1)
            .map_err(|e| e.to_string())
    );
}
