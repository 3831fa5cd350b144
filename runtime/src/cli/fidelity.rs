//! Encode a block of K/V in one tier (or a mix), run the interpreter on every
//! query, and score it against dense fp32 attention on the original K/V.

use std::time::{Duration, Instant};

use kvcc_compiler::back::interp::{Interpreter, Options};
use kvcc_compiler::Format;

use crate::cache::{PagedCache, Tables};
use crate::encode::EncodeError;
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
    pub elapsed: Duration,
    pub page_bytes: usize,
}

/// Encodes `block` with pages placed by `tier_of_page` and measures fidelity of
/// the interpreter against dense attention on the unencoded K/V.
/// Rows are added to `acc`, so several layers can be scored together.
pub fn run(
    format: &Format,
    tables: &Tables,
    block: &Block,
    tier_of_page: impl Fn(usize) -> usize,
    acc: &mut FidelityAccumulator,
) -> Result<TierRun, EncodeError> {
    let d = format.head_dim() as usize;
    let mut cache = PagedCache::new(format, block.kv_heads, tables.clone())?;
    cache.append_sequence(block.keys, block.values, tier_of_page)?;
    let interp = Interpreter::new(format.tiers(), Options::default());
    let view = cache.view();
    let tokens = block.keys.len() / (block.kv_heads * d);
    let group = block.q_heads / block.kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut elapsed = Duration::ZERO;
    for q_head in 0..block.q_heads {
        let kv_head = q_head / group;
        let keys = &block.keys[kv_head * tokens * d..(kv_head + 1) * tokens * d];
        let values = &block.values[kv_head * tokens * d..(kv_head + 1) * tokens * d];
        for row in 0..block.query_rows {
            let at = (q_head * block.query_rows + row) * d;
            let query = &block.queries[at..at + d];
            let start = Instant::now();
            let got = interp
                .attend(&view, 0, kv_head, query)
                .expect("pages written by this cache are valid");
            elapsed += start.elapsed();
            let want = dense_attention(query, keys, values, d, scale);
            acc.add_row(&got.output, &got.logits, &want.output, &want.logits);
        }
    }
    Ok(TierRun {
        elapsed,
        page_bytes: cache.page_bytes(),
    })
}
