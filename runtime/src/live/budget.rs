//! `[cache.budget]`: Spherical KV's rate-distortion controller (seed 000
//! §2.2, Algorithm 1 steps 3–4, appendix C.3) for one (sequence, kv head).
//!
//! Every state leaving the exact window gets a distortion per tier and for
//! being dropped ([`distortions`]); [`allocate`] starts every state at the
//! most expensive tier, down-tiers by least distortion per saved byte until
//! the page-rounded bytes fit the budget, and only then drops; [`pack`]
//! groups the kept states into pages of one tier each. Ties break by state
//! position, then by move: the same input gives the same allocation.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use kvcc_compiler::spec::{BudgetScore, BudgetSpec};
use kvcc_compiler::Format;

use super::LiveError;
use crate::encode::decode_page;

/// A checked `[cache.budget]` table as a live cache runs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetPolicy {
    pub bytes_per_token: f64,
    pub drop: bool,
    pub score: BudgetScore,
    pub protect: f64,
    pub refresh: usize,
    pub observe: usize,
}

impl BudgetPolicy {
    pub fn of(spec: &BudgetSpec) -> BudgetPolicy {
        BudgetPolicy {
            bytes_per_token: spec.bytes_per_token,
            drop: spec.drop,
            score: spec.score,
            protect: spec.protect,
            refresh: spec.refresh as usize,
            observe: spec.observe as usize,
        }
    }

    /// "budget 180.0 B per compressed token and kv head" and [`rule`](Self::rule).
    pub fn describe(&self) -> String {
        format!(
            "budget {:.1} B per compressed token and kv head {}",
            self.bytes_per_token,
            self.rule()
        )
    }

    /// "by rd, drop allowed, protect the top 2% by attention, refresh every
    /// 256 steps, weigh by the last 32 queries".
    pub fn rule(&self) -> String {
        format!(
            "by {}, {}, protect the top {}% by attention, refresh every {} steps, weigh by the \
             last {} queries",
            self.score.name(),
            if self.drop {
                "drop allowed"
            } else {
                "never drop"
            },
            self.protect * 100.0,
            self.refresh,
            self.observe
        )
    }

    /// Whether scoring needs the queries' attention.
    pub fn needs_queries(&self) -> bool {
        self.score != BudgetScore::KeyNorm
    }
}

/// What a tier costs per state: its page bytes over its items (headers
/// included), and a page's bytes for the page-rounded total.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierCost {
    pub page_bytes: usize,
    pub items: usize,
}

impl TierCost {
    pub fn of(format: &Format, tier: usize) -> TierCost {
        let layout = format.layout(tier);
        TierCost {
            page_bytes: layout.page_bytes as usize,
            items: layout.items_per_page as usize,
        }
    }

    fn per_state(&self) -> f64 {
        self.page_bytes as f64 / self.items as f64
    }
}

/// The states of one (sequence, kv head) the controller allocates, and the
/// attention that weighs them.
pub struct States<'a> {
    /// `[state][head_dim]`.
    pub keys: &'a [f32],
    pub values: &'a [f32],
    /// The kv head's observed query rows `[row][head_dim]`, unit-scaled
    /// (the kernels' `1/sqrt(head_dim)` applies).
    pub queries: &'a [f32],
    /// The tokens held exact beside the states (sinks and window), which
    /// the observed queries also attend: `[token][head_dim]` each.
    pub exact_keys: &'a [f32],
    pub exact_values: &'a [f32],
}

/// Per state, the distortion at every tier (format order) and when dropped.
#[derive(Debug, Clone, PartialEq)]
pub struct Distortions {
    pub tiers: Vec<Vec<f64>>,
    pub dropped: Vec<f64>,
    /// What protection ranks states by: attention mass (key norm under
    /// `key_norm`).
    pub weight: Vec<f64>,
}

/// Every state's distortion under `score`. Coding errors are measured by
/// encoding the states, in order, into pages of each tier (`encode(tier,
/// keys, values)` returns one page per `items` states) and decoding them.
///
/// `rd`: per observed query `q` with attention `a` over the states and the
/// exact tokens and output `o`, coding state `i` with errors `Δk, Δv`
/// moves the output by `a_i (q·Δk/√d)(v_i − o) + a_i Δv` to first order,
/// dropping it by `a_i (o − v_i)`; the distortion is that change's squared
/// norm summed over the queries. `attention` and `key_norm`: the weight
/// (attention mass, or key norm) times the tier's mean relative coding error
/// (`‖Δk‖²/‖k‖² + ‖Δv‖²/‖v‖²` over the states, halved); dropping costs the
/// whole weight.
pub fn distortions(
    format: &Format,
    tables: &[&[Vec<f32>]],
    score: BudgetScore,
    states: &States,
    mut encode: impl FnMut(usize, &[f32], &[f32]) -> Result<Vec<Vec<u8>>, LiveError>,
) -> Result<Distortions, LiveError> {
    let d = format.head_dim() as usize;
    let n = states.keys.len() / d;
    let attention = (score != BudgetScore::KeyNorm).then(|| ObservedAttention::of(states, d));
    let mut errors = Vec::with_capacity(format.tiers().len());
    for (tier, tables) in tables.iter().enumerate() {
        let layout = format.layout(tier);
        let mut keys = Vec::with_capacity(n * d);
        let mut values = Vec::with_capacity(n * d);
        for page in encode(tier, states.keys, states.values)? {
            let (k, v) = decode_page(layout, tables, &page);
            keys.extend(k);
            values.extend(v);
        }
        errors.push((keys, values));
    }
    let delta = |coded: &[f32], exact: &[f32], i: usize| -> Vec<f32> {
        let (c, e) = (&coded[i * d..(i + 1) * d], &exact[i * d..(i + 1) * d]);
        c.iter().zip(e).map(|(c, e)| c - e).collect()
    };
    let norm2 = |x: &[f32]| x.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>();
    let key = |i: usize| &states.keys[i * d..(i + 1) * d];
    let value = |i: usize| &states.values[i * d..(i + 1) * d];
    let tiers = errors.len();
    let mut out = Distortions {
        tiers: vec![vec![0.0; n]; tiers],
        dropped: vec![0.0; n],
        weight: vec![0.0; n],
    };
    match &attention {
        Some(att) if score == BudgetScore::Rd => {
            let scale = 1.0 / (d as f64).sqrt();
            for i in 0..n {
                let deltas: Vec<(Vec<f32>, f64)> = (errors.iter())
                    .map(|(k, v)| (delta(k, states.keys, i), norm2(&delta(v, states.values, i))))
                    .collect();
                for (r, q) in states.queries.chunks(d).enumerate() {
                    let a = att.weights[r * n + i];
                    if a == 0.0 {
                        continue;
                    }
                    let o = &att.outputs[r * d..(r + 1) * d];
                    let spread: f64 = (value(i).iter().zip(o))
                        .map(|(&v, &o)| (f64::from(v) - o).powi(2))
                        .sum();
                    out.dropped[i] += a * a * spread;
                    out.weight[i] += a;
                    for (t, (dk, dv)) in deltas.iter().enumerate() {
                        let dl = scale * dot(q, dk);
                        out.tiers[t][i] += a * a * (dl * dl * spread + dv);
                    }
                }
            }
        }
        _ => {
            for i in 0..n {
                out.weight[i] = match &attention {
                    Some(att) => (0..states.queries.len() / d)
                        .map(|r| att.weights[r * n + i])
                        .sum(),
                    None => norm2(key(i)).sqrt(),
                };
            }
            for (t, (k, v)) in errors.iter().enumerate() {
                let relative = |coded: &[f32], exact: &[f32], i: usize| {
                    let e = norm2(&exact[i * d..(i + 1) * d]);
                    if e > 0.0 {
                        norm2(&delta(coded, exact, i)) / e
                    } else {
                        0.0
                    }
                };
                let mean = (0..n)
                    .map(|i| relative(k, states.keys, i) + relative(v, states.values, i))
                    .sum::<f64>()
                    / (2 * n.max(1)) as f64;
                for i in 0..n {
                    out.tiers[t][i] = out.weight[i] * mean;
                }
            }
            out.dropped.clone_from(&out.weight);
        }
    }
    Ok(out)
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum()
}

/// The observed queries' attention over the states: weights `[row][state]`
/// (softmax over the states and the exact tokens) and outputs `[row][d]`.
struct ObservedAttention {
    weights: Vec<f64>,
    outputs: Vec<f64>,
}

impl ObservedAttention {
    fn of(states: &States, d: usize) -> ObservedAttention {
        let n = states.keys.len() / d;
        let rows = states.queries.len() / d;
        let scale = 1.0 / (d as f64).sqrt();
        let mut weights = vec![0.0; rows * n];
        let mut outputs = vec![0.0; rows * d];
        for (r, q) in states.queries.chunks(d).enumerate() {
            let logits: Vec<f64> = (states.keys.chunks(d).chain(states.exact_keys.chunks(d)))
                .map(|k| scale * dot(q, k))
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let exp: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let sum: f64 = exp.iter().sum();
            let o = &mut outputs[r * d..(r + 1) * d];
            for (p, v) in exp
                .iter()
                .zip(states.values.chunks(d).chain(states.exact_values.chunks(d)))
            {
                let a = p / sum;
                for (o, &v) in o.iter_mut().zip(v) {
                    *o += a * f64::from(v);
                }
            }
            for (w, p) in weights[r * n..(r + 1) * n].iter_mut().zip(&exp) {
                *w = p / sum;
            }
        }
        ObservedAttention { weights, outputs }
    }
}

/// Each state's tier (format order), `None` where dropped.
pub type Allocation = Vec<Option<usize>>;

/// A move of one state down the ladder, ordered so the heap's top is the
/// least distortion per saved byte, then the earliest state.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Move {
    ratio: f64,
    state: usize,
}

impl Eq for Move {}

impl Ord for Move {
    fn cmp(&self, other: &Move) -> Ordering {
        (other.ratio.total_cmp(&self.ratio)).then(other.state.cmp(&self.state))
    }
}

impl PartialOrd for Move {
    fn partial_cmp(&self, other: &Move) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Allocates the states of `distortions` under `budget` (its bytes per
/// token times the states, in page-rounded bytes of `costs`), by the seed's
/// greedy-by-ratio solver (appendix C.3). Each state's options are the rungs
/// of the tier ladder (tiers of equal cost form one rung, the state taking
/// its least distorted tier of it) and, where allowed, being dropped (cost
/// 0). Every state starts on the top rung; the move applied next is, over
/// all states, the one to a cheaper option with the least added distortion
/// per saved byte, until the pages fit. A state so walks its lower convex
/// hull: it is down-tiered before it is dropped wherever a cheaper tier
/// loses less per byte than dropping. Protected states (the top `protect`
/// fraction by weight, earlier first on ties) stay on the top rung. The
/// budget is met unless protection or `drop = false` forbid it; then the
/// allocation is the cheapest they allow.
pub fn allocate(
    distortions: &Distortions,
    costs: &[TierCost],
    budget: &BudgetPolicy,
) -> Allocation {
    let n = distortions.dropped.len();
    let budget_bytes = budget.bytes_per_token * n as f64;
    // Rungs: tiers grouped by cost per state, most expensive first.
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| (costs[b].per_state().total_cmp(&costs[a].per_state())).then(a.cmp(&b)));
    let mut rungs: Vec<Vec<usize>> = Vec::new();
    for t in order {
        match rungs.last_mut() {
            Some(rung) if costs[rung[0]].per_state() == costs[t].per_state() => rung.push(t),
            _ => rungs.push(vec![t]),
        }
    }
    // A state's options, most expensive first: (tier or None, bytes, distortion).
    let options = |i: usize| -> Vec<(Option<usize>, f64, f64)> {
        let mut out: Vec<(Option<usize>, f64, f64)> = (rungs.iter())
            .map(|rung| {
                let d = |t: usize| distortions.tiers[t][i];
                let t = *(rung.iter())
                    .min_by(|&&a, &&b| d(a).total_cmp(&d(b)).then(a.cmp(&b)))
                    .expect("a rung holds a tier");
                (Some(t), costs[t].per_state(), d(t))
            })
            .collect();
        if budget.drop {
            out.push((None, 0.0, distortions.dropped[i]));
        }
        out
    };
    // The best move of state `i` from option `at`: least distortion per saved
    // byte, the nearer option on ties.
    let next =
        |i: usize, at: usize, options: &[(Option<usize>, f64, f64)]| -> Option<(Move, usize)> {
            let (_, bytes, distortion) = options[at];
            (at + 1..options.len())
                .map(|to| {
                    let ratio = (options[to].2 - distortion) / (bytes - options[to].1);
                    (Move { ratio, state: i }, to)
                })
                .min_by(|a, b| a.0.ratio.total_cmp(&b.0.ratio).then(a.1.cmp(&b.1)))
        };
    let all: Vec<Vec<(Option<usize>, f64, f64)>> = (0..n).map(options).collect();
    let mut at = vec![0usize; n];
    let mut target = vec![0usize; n];
    let mut tier: Allocation = all.iter().map(|o| o[0].0).collect();
    let mut counts = vec![0usize; costs.len()];
    for t in tier.iter().flatten() {
        counts[*t] += 1;
    }
    let protected = protected(&distortions.weight, budget.protect);
    let mut heap = BinaryHeap::new();
    for i in (0..n).filter(|&i| !protected[i]) {
        if let Some((m, to)) = next(i, 0, &all[i]) {
            target[i] = to;
            heap.push(m);
        }
    }
    while paged_bytes(&counts, costs) as f64 > budget_bytes {
        let Some(m) = heap.pop() else { break };
        let i = m.state;
        if let Some(t) = tier[i] {
            counts[t] -= 1;
        }
        at[i] = target[i];
        tier[i] = all[i][at[i]].0;
        if let Some(t) = tier[i] {
            counts[t] += 1;
        }
        if let Some((m, to)) = next(i, at[i], &all[i]) {
            target[i] = to;
            heap.push(m);
        }
    }
    tier
}

/// The top `fraction` of states by `weight` (earlier first on ties).
fn protected(weight: &[f64], fraction: f64) -> Vec<bool> {
    let count = (fraction * weight.len() as f64).floor() as usize;
    let mut order: Vec<usize> = (0..weight.len()).collect();
    order.sort_by(|&a, &b| weight[b].total_cmp(&weight[a]).then(a.cmp(&b)));
    let mut out = vec![false; weight.len()];
    for &i in &order[..count] {
        out[i] = true;
    }
    out
}

/// The kept states as pages: per tier (format order), its states in order,
/// `items` to a page (the last one may be partial).
pub fn pack(allocation: &Allocation, tiers: usize, items: usize) -> Vec<(usize, Vec<usize>)> {
    let mut pages = Vec::new();
    for t in 0..tiers {
        let states: Vec<usize> = (0..allocation.len())
            .filter(|&i| allocation[i] == Some(t))
            .collect();
        for chunk in states.chunks(items) {
            pages.push((t, chunk.to_vec()));
        }
    }
    pages
}

/// The page-rounded bytes of `allocation` under `costs`.
pub fn allocated_bytes(allocation: &Allocation, costs: &[TierCost]) -> usize {
    let mut counts = vec![0usize; costs.len()];
    for t in allocation.iter().flatten() {
        counts[*t] += 1;
    }
    paged_bytes(&counts, costs)
}

/// Bytes of whole pages holding `counts[t]` states of each tier `t`.
fn paged_bytes(counts: &[usize], costs: &[TierCost]) -> usize {
    (counts.iter().zip(costs))
        .map(|(&c, cost)| c.div_ceil(cost.items) * cost.page_bytes)
        .sum()
}
