//! Fidelity under a cache policy: a block's K/V prefilled into a live cache
//! (exact sinks and window, the rest in whole pages of one tier), every query
//! decoded by it and scored against dense fp32 attention on the original K/V.

use std::time::{Duration, Instant};

use kvcc_compiler::Format;
use serde::Serialize;

use super::fidelity::Block;
use crate::cache::Tables;
use crate::exec::ExecutorKind;
use crate::live::{CachePolicy, LiveCache, LiveError, LiveKv, LiveOptions, Queries, SequenceKv};
use crate::metrics::{Fidelity, FidelityAccumulator};
use crate::reference::dense_attention;

/// A tier's score when a live cache holds the data under a policy.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyScore {
    pub sinks: usize,
    pub window: usize,
    pub exact: &'static str,
    /// Per token per kv head at the report's context: exact rows (K and V),
    /// whole pages and tables.
    pub bytes_per_token: f64,
    pub compression: f64,
    pub fidelity: Fidelity,
    /// Time of the live cache's decode steps.
    pub executor_ms: f64,
    /// `quest 16 pages`: the selection that chose the pages read, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub select: Option<String>,
}

impl PolicyScore {
    pub fn new(
        format: &Format,
        policy: &CachePolicy,
        acc: &FidelityAccumulator,
        elapsed: Duration,
        context: usize,
    ) -> PolicyScore {
        let bytes_per_token = policy.bytes_per_token(format.layout(policy.tier), context);
        PolicyScore {
            sinks: policy.sinks,
            window: policy.window,
            exact: policy.exact.name(),
            bytes_per_token,
            compression: f64::from(4 * format.head_dim()) / bytes_per_token,
            fidelity: acc.finish(),
            executor_ms: elapsed.as_secs_f64() * 1e3,
            select: (policy.select)
                .map(|s| format!("{} {} pages", s.method.name(), s.budget_pages)),
        }
    }

    /// How report tables name it under its tier's row: "+ sinks 4, window 64".
    pub fn label(&self) -> String {
        let select = match &self.select {
            Some(s) => format!(", {s}"),
            None => String::new(),
        };
        format!("+ sinks {}, window {}{select}", self.sinks, self.window)
    }

    /// Bytes, ratio and `digits`-digit fidelity cells, as the tier rows show them.
    pub fn cells(&self, digits: usize) -> Vec<String> {
        let mut cells = vec![
            format!("{:.2}", self.bytes_per_token),
            format!("{:.2}x", self.compression),
        ];
        cells.extend(self.fidelity.cells(digits));
        cells
    }
}

/// What a live cache held and how long its steps took.
#[derive(Debug, Clone, Default)]
pub struct Held {
    /// Time of the decode steps.
    pub elapsed: Duration,
    /// Bytes of the pages in use.
    pub page_bytes: usize,
    /// Tokens between the exact sinks and tail: compressed or dropped.
    pub allocated: usize,
    /// Per tier: tokens its pages hold.
    pub kept: Vec<usize>,
}

impl Held {
    pub fn add(&mut self, other: &Held) {
        self.elapsed += other.elapsed;
        self.page_bytes += other.page_bytes;
        self.allocated += other.allocated;
        if self.kept.len() < other.kept.len() {
            self.kept.resize(other.kept.len(), 0);
        }
        for (a, b) in self.kept.iter_mut().zip(&other.kept) {
            *a += b;
        }
    }
}

/// Scores `block` held by a live cache under `policy` (its pages in
/// `policy.tier`, or as its budget allocates them weighing states by the
/// `observed` queries), adding a row per (query head, query row) to `acc`.
pub fn run(
    format: &Format,
    tables: &Tables,
    block: &Block,
    policy: CachePolicy,
    observed: Queries,
    executor: ExecutorKind,
    acc: &mut FidelityAccumulator,
) -> Result<Held, LiveError> {
    let d = format.head_dim() as usize;
    let tokens = block.keys.len() / (block.kv_heads * d);
    let items = format.spec().page.items as usize;
    let options = LiveOptions {
        policy,
        kv_heads: block.kv_heads,
        pages_per_tier: tokens.div_ceil(items) * block.kv_heads,
        executor,
    };
    let mut live = LiveCache::new(format, &options, tables.clone())?;
    live.prefill(&[SequenceKv {
        keys: block.keys,
        values: block.values,
        queries: observed,
    }])?;
    let tiers = format.tiers().len();
    let page_bytes = (0..tiers)
        .map(|t| live.pool().used(t) * format.layout(t).page_bytes as usize)
        .sum();
    let state = live.sequence(0).expect("the prefilled sequence");
    let exact: usize = (state.sinks.iter().chain(&state.tail))
        .map(|rows| rows.tokens(d))
        .sum();
    let mut kept = vec![0; tiers];
    for refs in &live.pages().view().page_tables[0] {
        for r in refs {
            kept[r.tier as usize] += live
                .page_positions(r.tier as usize, r.page)
                .map_or(0, <[u32]>::len);
        }
    }
    let group = block.q_heads / block.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut elapsed = Duration::ZERO;
    for row in 0..block.query_rows {
        let query = |h: usize| {
            let at = (h * block.query_rows + row) * d;
            &block.queries[at..at + d]
        };
        let queries: Vec<f32> = (0..block.q_heads).flat_map(query).copied().collect();
        let start = Instant::now();
        let (attention, logits) = live.attend_with_logits(&queries, block.q_heads)?;
        elapsed += start.elapsed();
        for (h, logits) in logits.iter().enumerate() {
            let kv = (h / group) * tokens * d..(h / group + 1) * tokens * d;
            let want = dense_attention(
                query(h),
                &block.keys[kv.clone()],
                &block.values[kv],
                d,
                scale,
            );
            let output = &attention.outputs[h * d..(h + 1) * d];
            acc.add_row(output, logits, &want.output, &want.logits);
        }
    }
    Ok(Held {
        elapsed,
        page_bytes,
        allocated: tokens * block.kv_heads - exact,
        kept,
    })
}
