//! `[cache.select]` in the CPU live cache: each (sequence, kv head) reads its
//! exact sinks and tail and the budget's pages that the reference scores
//! highest (`back::interp::select`, on the pages' f16-rounded keys, computed
//! here from the source tokens); what it attends over those pages is what the
//! full cache attends over them, bit for bit; a budget past the pages reads
//! them all.

mod common;

use common::{data, fresh_seed, SplitMix64};
use half::f16;
use kvcc::compiler::back::interp::select;
use kvcc::compiler::spec::ExactDtype;
use kvcc::compiler::Format;
use kvcc::runtime::builtin::SPECS;
use kvcc::runtime::encode::TrainOptions;
use kvcc::runtime::exec::ExecutorKind;
use kvcc::runtime::live::{CachePolicy, LiveCache, LiveKv, LiveOptions, SequenceKv};

const SINKS: usize = 4;
const WINDOW: usize = 64;
const ITEMS: usize = 64;

/// A bundled spec with `select` appended as its `[cache.select]` table.
fn selecting(name: &str, select: &str) -> Format {
    let file = format!("specs/{name}.toml");
    let (_, source) = SPECS.iter().find(|(path, _)| *path == file).unwrap();
    let text = format!("{source}\n[cache.select]\n{select}\n");
    Format::parse(&text, &file).unwrap_or_else(|e| panic!("{e}"))
}

struct Filled {
    live: LiveCache,
    /// `[sequence]`: the source keys, `[kv_head][token][head_dim]`.
    keys: Vec<Vec<f32>>,
    tokens: Vec<usize>,
}

/// Two sequences of different lengths, prefilled then appended to, under
/// `policy` (tier 1 of `format`).
fn filled(format: &Format, policy: CachePolicy, seed: u64, executor: ExecutorKind) -> Filled {
    let (kv_heads, q_heads) = (2, 8);
    let d = format.head_dim() as usize;
    let lengths = [300 + (seed % 200) as usize, 900 + (seed % 300) as usize];
    let sets: Vec<_> = (0..2)
        .map(|s| data(format, seed + s, kv_heads, q_heads, lengths[s as usize]))
        .collect();
    let options = LiveOptions {
        policy,
        kv_heads,
        pages_per_tier: 64,
        executor,
    };
    // Prompts of 200 tokens, then the rest in appends of random sizes.
    let prompt = |s: usize, to: usize| {
        let pick = |data: &[f32]| -> Vec<f32> {
            (0..kv_heads)
                .flat_map(|h| data[h * lengths[s] * d..(h * lengths[s] + to) * d].to_vec())
                .collect()
        };
        (pick(&sets[s].keys), pick(&sets[s].values))
    };
    let (p0, p1) = (prompt(0, 200), prompt(1, 200));
    let prompts = [
        SequenceKv {
            keys: &p0.0,
            values: &p0.1,
            queries: Default::default(),
        },
        SequenceKv {
            keys: &p1.0,
            values: &p1.1,
            queries: Default::default(),
        },
    ];
    let (mut live, _) =
        LiveCache::train(format, &options, &prompts, &TrainOptions::default()).unwrap();
    let mut taken = [200, 200];
    let mut rng = SplitMix64(seed);
    while taken.iter().zip(&lengths).any(|(t, l)| t < l) {
        let mut chunks = Vec::new();
        for s in 0..2 {
            let n = (1 + rng.below(150)).min(lengths[s] - taken[s]);
            if n == 0 {
                continue;
            }
            let chunk = |data: &[f32]| -> Vec<f32> {
                (0..kv_heads)
                    .flat_map(|h| {
                        let row = h * lengths[s];
                        data[(row + taken[s]) * d..(row + taken[s] + n) * d].to_vec()
                    })
                    .collect()
            };
            chunks.push((s, chunk(&sets[s].keys), chunk(&sets[s].values)));
            taken[s] += n;
        }
        let batch = common::appends(&chunks);
        live.append(&batch).unwrap();
    }
    Filled {
        live,
        keys: sets.into_iter().map(|s| s.keys).collect(),
        tokens: lengths.to_vec(),
    }
}

fn queries(format: &Format, seed: u64, sequences: usize, q_heads: usize) -> Vec<f32> {
    let mut rng = SplitMix64(seed ^ 0x5e1ec7);
    let n = sequences * q_heads * format.head_dim() as usize;
    (0..n)
        .map(|_| rng.below(2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// The pages (positions among the sequence's compressed pages) the reference
/// reads for `(sequence, kv head)`.
fn expected_pages(
    policy: &CachePolicy,
    filled: &Filled,
    queries: &[f32],
    (sequence, kv_head, q_heads): (usize, usize, usize),
) -> Vec<usize> {
    let layout = policy.select.unwrap();
    let d = layout.head_dim as usize;
    let tokens = filled.tokens[sequence];
    let pages = policy.split(tokens, ITEMS).pages;
    let group = q_heads / 2;
    let first = (sequence * q_heads + kv_head * group) * d;
    let group_queries = &queries[first..first + group * d];
    let scores: Vec<f32> = (0..pages)
        .map(|p| {
            let from = (kv_head * tokens + SINKS + p * ITEMS) * d;
            let keys: Vec<f32> = filled.keys[sequence][from..from + ITEMS * d]
                .iter()
                .map(|&x| f16::from_f32(x).to_f32())
                .collect();
            let summary = select::summarize(&layout, &keys);
            select::score(&layout, &summary, ITEMS, group_queries)
        })
        .collect();
    select::choose(&scores, layout.budget_pages as usize)
}

fn policy(format: &Format) -> CachePolicy {
    CachePolicy {
        sinks: SINKS,
        window: WINDOW,
        exact: ExactDtype::F16,
        tier: 1,
        ..CachePolicy::of(format)
    }
}

fn check(format: &Format, executor: ExecutorKind, seed: u64) {
    let q_heads = 8;
    let select = policy(format);
    let full = CachePolicy {
        select: None,
        ..select
    };
    let a = filled(format, select, seed, executor);
    let b = filled(format, full, seed, executor);
    assert_eq!(
        a.live.pages().view().page_tables,
        b.live.pages().view().page_tables
    );
    let q = queries(format, seed, 2, q_heads);
    let (selected, logits_a) = a.live.attend_with_logits(&q, q_heads).unwrap();
    let (_, logits_b) = b.live.attend_with_logits(&q, q_heads).unwrap();
    let layout = select.select.unwrap();
    for (row, (la, lb)) in logits_a.iter().zip(&logits_b).enumerate() {
        let (sequence, kv_head) = (row / q_heads, row % q_heads / (q_heads / 2));
        let chosen = expected_pages(&select, &a, &q, (sequence, kv_head, q_heads));
        assert!(chosen.len() <= layout.budget_pages as usize);
        let split = select.split(a.tokens[sequence], ITEMS);
        // The full cache's logits, -inf on the pages not chosen.
        let mut want = lb.clone();
        for p in (0..split.pages).filter(|p| !chosen.contains(p)) {
            let at = split.sinks + p * ITEMS;
            want[at..at + ITEMS].fill(f32::NEG_INFINITY);
        }
        assert_eq!(la, &want, "seed {seed}: row {row} reads other pages");
        // The step's softmax is over exactly the tokens read.
        let max = la.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = la.iter().map(|&x| f64::from(x - max).exp()).sum();
        let lse = (f64::from(max) + sum.ln()) as f32;
        assert!((selected.lse[row] - lse).abs() <= 1e-5 * lse.abs().max(1.0));
    }
    // A budget past every page reads them all: the full cache's step.
    let everything = select.with_select_budget(Some(1024));
    let c = filled(format, everything, seed, executor);
    let (all, _) = c.live.attend_with_logits(&q, q_heads).unwrap();
    let (unselected, _) = b.live.attend_with_logits(&q, q_heads).unwrap();
    assert_eq!(all, unselected);
    // Summaries are counted in the cache's bytes.
    let pages: usize = (0..format.tiers().len())
        .map(|t| a.live.pool().used(t))
        .sum();
    assert_eq!(
        a.live.bytes(),
        b.live.bytes() + pages * layout.bytes() as usize
    );
}

#[test]
fn quest_reads_the_pages_the_reference_bounds_highest() {
    let seed = fresh_seed("quest_reads_the_pages_the_reference_bounds_highest");
    for (group, executor) in [("max", ExecutorKind::Jit), ("sum", ExecutorKind::Interp)] {
        let format = selecting(
            "kivi",
            &format!("method = \"quest\"\ntokens = 256\ngroup = \"{group}\""),
        );
        check(&format, executor, seed);
    }
}

#[test]
fn block_means_read_the_pages_of_the_best_blocks() {
    let seed = fresh_seed("block_means_read_the_pages_of_the_best_blocks");
    let format = selecting("kivi", "method = \"block_mean\"\npages = 3\nblock = 16");
    check(&format, ExecutorKind::Jit, seed);
}

#[test]
fn the_policy_says_what_it_selects() {
    let format = selecting("kivi", "method = \"quest\"\npages = 4");
    let p = CachePolicy::of(&format);
    assert!(p.select.is_some());
    assert!(
        p.describe(&format).contains("reads 4 pages by quest"),
        "{}",
        p.describe(&format)
    );
}
