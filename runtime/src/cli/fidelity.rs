//! Encode a block of K/V in one tier (or a mix), decode every query with the
//! selected executor, and score it against dense fp32 attention on the
//! original K/V.

use std::time::{Duration, Instant};

use kvcc_compiler::Format;

use crate::cache::{PagedCache, Tables};
use crate::encode::EncodeError;
use crate::exec::{ExecError, Executor, InterpExecutor};
use crate::metrics::FidelityAccumulator;
use crate::reference::dense_attention;

/// One layer's data: `[kv_head][token][d]` keys and values, `[q_head][row][d]` queries.
pub struct Block<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub queries: &'a [f32],
    pub kv_heads: usize,
    pub q_heads: usize,
    pub query_rows: usize,
}

pub struct TierRun {
    /// Decoding every query with the selected executor.
    pub elapsed: Duration,
    /// The same with the reference interpreter, when asked for.
    pub interpreter: Option<Duration>,
    pub page_bytes: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum FidelityError {
    #[error(transparent)]
    Encode(#[from] EncodeError),
    #[error(transparent)]
    Exec(#[from] ExecError),
}

/// Encodes `block` with pages placed by `tier_of_page` and measures fidelity of
/// `executor` against dense attention on the unencoded K/V; with
/// `time_interpreter`, also times the interpreter on the same queries.
/// Rows are added to `acc`, so several layers can be scored together.
pub fn run(
    format: &Format,
    tables: &Tables,
    block: &Block,
    tier_of_page: impl Fn(usize) -> usize,
    executor: &dyn Executor,
    time_interpreter: bool,
    acc: &mut FidelityAccumulator,
) -> Result<TierRun, FidelityError> {
    let d = format.head_dim() as usize;
    let mut cache = PagedCache::new(format, block.kv_heads, tables.clone())?;
    cache.append_sequence(block.keys, block.values, tier_of_page)?;
    let tokens = block.keys.len() / (block.kv_heads * d);
    let group = block.q_heads / block.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    // One decode per query row index: every head's row `row` at once.
    let rows: Vec<Vec<f32>> = (0..block.query_rows)
        .map(|row| {
            (0..block.q_heads)
                .flat_map(|h| {
                    let at = (h * block.query_rows + row) * d;
                    block.queries[at..at + d].iter().copied()
                })
                .collect()
        })
        .collect();
    let timed = |executor: &dyn Executor| {
        let start = Instant::now();
        let decoded = rows
            .iter()
            .map(|queries| executor.decode_with_logits(&cache, queries, block.q_heads))
            .collect::<Result<Vec<_>, _>>();
        decoded.map(|d| (d, start.elapsed()))
    };
    let reference = executor.name() == InterpExecutor.name();
    if let (false, Some(queries)) = (reference, rows.first()) {
        // Untimed: executors compile or upload their kernels on first use.
        executor.decode_with_logits(&cache, queries, block.q_heads)?;
    }
    let (decoded, elapsed) = timed(executor)?;
    let interpreter = match (time_interpreter, reference) {
        (false, _) => None,
        (true, true) => Some(elapsed),
        (true, false) => Some(timed(&InterpExecutor)?.1),
    };
    for q_head in 0..block.q_heads {
        let kv_head = q_head / group;
        let keys = &block.keys[kv_head * tokens * d..(kv_head + 1) * tokens * d];
        let values = &block.values[kv_head * tokens * d..(kv_head + 1) * tokens * d];
        for (row, got) in decoded.iter().enumerate() {
            let at = (q_head * block.query_rows + row) * d;
            let want = dense_attention(&block.queries[at..at + d], keys, values, d, scale);
            let output = &got.outputs[q_head * d..(q_head + 1) * d];
            acc.add_row(output, &got.logits[q_head], &want.output, &want.logits);
        }
    }
    Ok(TierRun {
        elapsed,
        interpreter,
        page_bytes: cache.page_bytes(),
    })
}
