//! What `[cache.select]` means: the summary a page keeps of its keys, a
//! query group's score of it, and the pages a step reads. Every other path
//! (the GPU's scoring kernel, the live caches) computes the same bits: the
//! scores in f32 in the order written here (products rounded, then summed;
//! no fused multiply-add), the choice by (score, then earlier page).

use half::f16;

use crate::layout::summary::SummaryLayout;
use crate::spec::{GroupScore, SelectMethod};

/// The f16 summary (`layout.values()` values, as bits) of one page's keys
/// (`[token][head_dim]`, at most a page, in the f16 range). Quest: each
/// channel's minimum rounded down and maximum rounded up (of the keys in
/// `f32::total_cmp` order), so the score bounds every stored key's `q · k`; block mean: each block's mean key
/// (summed in token order, divided by its tokens, rounded to nearest),
/// zero for blocks past the page's tokens.
pub fn summarize(layout: &SummaryLayout, keys: &[f32]) -> Vec<u16> {
    let d = layout.head_dim as usize;
    let tokens = keys.len() / d;
    let mut out = vec![0u16; layout.values()];
    match layout.method {
        SelectMethod::Quest => {
            let (min, max) = out.split_at_mut(d);
            for c in 0..d {
                // In `total_cmp`'s order, so -0 sits below +0 on every path.
                let column = (0..tokens).map(|t| keys[t * d + c]);
                let lo = column.clone().min_by(f32::total_cmp).unwrap_or(0.0);
                let hi = column.max_by(f32::total_cmp).unwrap_or(0.0);
                min[c] = f16_toward(lo, false).to_bits();
                max[c] = f16_toward(hi, true).to_bits();
            }
        }
        SelectMethod::BlockMean => {
            let block = layout.block as usize;
            for (b, row) in out.chunks_mut(d).enumerate() {
                let first = b * block;
                let count = tokens.saturating_sub(first).min(block);
                if count == 0 {
                    continue;
                }
                for (c, slot) in row.iter_mut().enumerate() {
                    let sum = (first..first + count).fold(0.0f32, |s, t| s + keys[t * d + c]);
                    *slot = f16::from_f32(sum / count as f32).to_bits();
                }
            }
        }
    }
    out
}

/// `x` as an f16 rounded toward +inf (`up`) or -inf, within ±65504.
fn f16_toward(x: f32, up: bool) -> f16 {
    let h = f16::from_f32(x);
    let past = match up {
        true => h.to_f32() < x,
        false => h.to_f32() > x,
    };
    let h = if past { step(h, up) } else { h };
    let limit = f16::MAX.to_f32();
    f16::from_f32(h.to_f32().clamp(-limit, limit))
}

/// The next f16 after `h` toward +inf (`up`) or -inf.
fn step(h: f16, up: bool) -> f16 {
    let bits = h.to_bits();
    let negative = bits & 0x8000 != 0;
    let magnitude = bits & 0x7fff;
    match (up, negative, magnitude) {
        (true, true, 0) | (false, false, 0) => f16::from_bits(if up { 0x0001 } else { 0x8001 }),
        (true, false, _) | (false, true, _) => f16::from_bits(bits + 1),
        (true, true, _) | (false, false, _) => f16::from_bits(bits - 1),
    }
}

/// The score of one page for the query heads of one kv head (`queries`:
/// `[head][head_dim]`): each head's score of the summary, combined by
/// `layout.group` in head order. `tokens`: the page's tokens (block mean
/// scores only the blocks that hold some).
pub fn score(layout: &SummaryLayout, summary: &[u16], tokens: usize, queries: &[f32]) -> f32 {
    let d = layout.head_dim as usize;
    let value = |i: usize| f16::from_bits(summary[i]).to_f32();
    let head_score = |q: &[f32]| -> f32 {
        match layout.method {
            SelectMethod::Quest => (0..d).fold(0.0f32, |s, c| {
                let (lo, hi) = (q[c] * value(c), q[c] * value(d + c));
                s + lo.max(hi)
            }),
            SelectMethod::BlockMean => {
                let blocks = tokens.div_ceil(layout.block as usize).max(1);
                (0..blocks.min(layout.rows as usize))
                    .map(|b| (0..d).fold(0.0f32, |s, c| s + q[c] * value(b * d + c)))
                    .fold(f32::NEG_INFINITY, f32::max)
            }
        }
    };
    let scores = queries.chunks(d).map(head_score);
    match layout.group {
        GroupScore::Max => scores.fold(f32::NEG_INFINITY, f32::max),
        GroupScore::Sum => scores.fold(0.0f32, |s, x| s + x),
    }
}

/// The positions (ascending) of the `budget` highest `scores`; of equal
/// scores the earlier page wins. Every position when there are at most
/// `budget`.
pub fn choose(scores: &[f32], budget: usize) -> Vec<usize> {
    if scores.len() <= budget {
        return (0..scores.len()).collect();
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut chosen = order[..budget].to_vec();
    chosen.sort_unstable();
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngExt, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn layout(method: SelectMethod, group: GroupScore, block: u32) -> SummaryLayout {
        SummaryLayout {
            method,
            group,
            head_dim: 16,
            items_per_page: 32,
            block,
            rows: match method {
                SelectMethod::Quest => 2,
                SelectMethod::BlockMean => 32 / block,
            },
            budget_pages: 4,
        }
    }

    fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    #[test]
    fn quest_scores_bound_every_keys_dot_product() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for group in [GroupScore::Max, GroupScore::Sum] {
            let l = layout(SelectMethod::Quest, group, 32);
            for tokens in [1, 7, 32] {
                let keys = random(&mut rng, tokens * 16, 40.0);
                let summary = summarize(&l, &keys);
                let queries = random(&mut rng, 4 * 16, 3.0);
                let bound = score(&l, &summary, tokens, &queries);
                for q in queries.chunks(16) {
                    for k in keys.chunks(16) {
                        let dot: f32 = q.iter().zip(k).map(|(a, b)| a * b).sum();
                        // Max: each head's bound; sum: a head's share is its own bound.
                        if group == GroupScore::Max {
                            assert!(dot <= bound + 1e-3 * bound.abs(), "{dot} > {bound}");
                        }
                    }
                }
                if group == GroupScore::Sum {
                    let heads: f32 = queries
                        .chunks(16)
                        .map(|q| {
                            let one = SummaryLayout {
                                group: GroupScore::Max,
                                ..l
                            };
                            score(&one, &summary, tokens, q)
                        })
                        .fold(0.0, |s, x| s + x);
                    assert_eq!(bound, heads);
                }
            }
        }
    }

    #[test]
    fn quest_rounds_outward_within_the_f16_range() {
        let l = layout(SelectMethod::Quest, GroupScore::Max, 32);
        let mut keys = vec![0.0f32; 2 * 16];
        keys[0] = 0.1; // not an f16: min rounds down, max up
        keys[16] = 0.1;
        keys[1] = 65504.0;
        keys[17] = -65504.0;
        keys[2] = -1e-9; // below the smallest subnormal
        keys[18] = -1e-9;
        let s = summarize(&l, &keys);
        let v = |i: usize| f16::from_bits(s[i]).to_f32();
        assert!(v(0) < 0.1 && v(16) > 0.1);
        assert_eq!((v(1), v(17)), (-65504.0, 65504.0));
        assert!(v(2) < 0.0 && v(18) == 0.0, "{} {}", v(2), v(18));
    }

    #[test]
    fn block_means_score_the_blocks_a_page_holds() {
        let l = layout(SelectMethod::BlockMean, GroupScore::Max, 8);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let keys = random(&mut rng, 12 * 16, 2.0);
        let s = summarize(&l, &keys);
        // Blocks 0 (8 tokens) and 1 (4 tokens); blocks 2 and 3 empty.
        assert!(s[2 * 16..].iter().all(|&b| b == 0));
        for c in 0..16 {
            let mean = (8..12).map(|t| keys[t * 16 + c]).sum::<f32>() / 4.0;
            assert_eq!(s[16 + c], f16::from_f32(mean).to_bits());
        }
        let q = random(&mut rng, 16, 1.0);
        let block = |b: usize| {
            (0..16).fold(0.0f32, |acc, c| {
                acc + q[c] * f16::from_bits(s[b * 16 + c]).to_f32()
            })
        };
        assert_eq!(score(&l, &s, 12, &q), block(0).max(block(1)));
    }

    #[test]
    fn the_highest_scores_win_and_ties_go_to_the_earlier_page() {
        assert_eq!(choose(&[1.0, 5.0, 3.0, 5.0, 0.0], 2), vec![1, 3]);
        assert_eq!(choose(&[2.0, 2.0, 2.0, 2.0], 2), vec![0, 1]);
        assert_eq!(choose(&[3.0, 1.0, 2.0], 3), vec![0, 1, 2]);
        assert_eq!(choose(&[3.0, f32::NEG_INFINITY, 2.0], 2), vec![0, 2]);
        assert_eq!(choose(&[], 4), Vec::<usize>::new());
    }
}
