//! The interpreter (IR semantics) against dense attention over the reference
//! decoder's K/V: the lowering and the encoders must agree bit for bit on what
//! the pages mean. Also GQA grouping and multi-tier merges.

mod common;

use common::{assert_rows_close, bundled, data, fresh_seed, trained_cache};
use kvcc::compiler::back::interp::{Interpreter, Options};
use kvcc::compiler::Format;
use kvcc::runtime::reference::dense_attention;

/// Several sequences of different lengths (not page multiples), pages placed
/// by `plan`; every query head's output checked against dense attention on
/// the decoded pages.
fn check_format(
    format: &Format,
    seed: u64,
    kv_heads: usize,
    group: usize,
    plan: &dyn Fn(usize, usize) -> usize,
) {
    let d = format.head_dim() as usize;
    let q_heads = kv_heads * group;
    let lengths = [1usize, 150, 333];
    let sets: Vec<_> = lengths
        .iter()
        .enumerate()
        .map(|(i, &t)| data(format, seed + i as u64, kv_heads, q_heads, t))
        .collect();
    let mut cache = trained_cache(format, &sets[2], seed);
    for (s, set) in sets.iter().enumerate() {
        cache
            .append_sequence(&set.keys, &set.values, |p| plan(s, p))
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
    let mut want = Vec::new();
    for (s, set) in sets.iter().enumerate() {
        for h in 0..q_heads {
            let (keys, values) = cache.decode_dense(s, h / group);
            let q = &set.queries[h * d..(h + 1) * d];
            want.extend(dense_attention(q, &keys, &values, d, 1.0 / (d as f32).sqrt()).output);
        }
    }
    assert_rows_close(format.name(), &got, &want, d, 1e-4);
}

#[test]
fn every_bundled_tier_matches_decoded_dense_attention() {
    let seed = fresh_seed("every_bundled_tier");
    for format in bundled() {
        for tier in 0..format.tiers().len() {
            check_format(&format, seed, 2, 4, &|_, _| tier);
        }
    }
}

#[test]
fn gqa_groups_of_1_4_8_and_mixed_tiers_merge_like_one_softmax() {
    let seed = fresh_seed("gqa_and_merge");
    for format in bundled() {
        let tiers = format.tiers().len();
        for group in [1, 4, 8] {
            // Tiers interleave page by page and differ per sequence.
            check_format(&format, seed, 2, group, &|s, p| (s + p) % tiers);
        }
    }
}
