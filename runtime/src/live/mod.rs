//! A live compressed KV cache of one layer: a batch of sequences of their own
//! lengths that grow token by token. Per sequence the first `sinks` tokens and
//! the recent tail stay exact (f16 or bf16); every whole page that leaves the
//! window is compressed into the policy's tier. A decode step attends over
//! all of it: the exact rows scored exactly, the pages through an executor,
//! joined by the log-sum-exp merge every executor uses between tiers.
//!
//! [`LiveKv`] is the API a backend implements; [`LiveCache`] is the CPU one
//! (pages encoded by the CPU encoder, attended by the JIT or the interpreter).

pub mod budget;
mod cpu;
pub mod exact;
pub mod exact_tier;
pub mod policy;
mod pool;

use kvcc_compiler::back::interp::DecodeError;
use kvcc_compiler::Format;

use crate::encode::EncodeError;
use crate::exec::ExecError;

pub(crate) use cpu::{check_exact, check_kv, train_tables};
pub use cpu::{LiveCache, LiveOptions, LiveState, SequenceState};
pub use exact_tier::{serving_format, ServingFormat};
pub use policy::{CachePolicy, Split};
pub use pool::PagePool;

/// Keys and values of one sequence, `[kv_head][token][head_dim]` each, and
/// the queries of its last tokens, which a `[cache.budget]` weighs the
/// compressed states by (none: empty).
#[derive(Debug, Clone, Copy, Default)]
pub struct SequenceKv<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub queries: Queries<'a>,
}

/// Query rows of one sequence, `[q_head][row][head_dim]`, oldest first,
/// unit-scaled (the kernels' `1/sqrt(head_dim)` applies).
#[derive(Debug, Clone, Copy, Default)]
pub struct Queries<'a> {
    pub data: &'a [f32],
    pub q_heads: usize,
}

/// New tokens for sequence `sequence`, `[kv_head][token][head_dim]` each.
#[derive(Debug, Clone, Copy)]
pub struct Append<'a> {
    pub sequence: usize,
    pub keys: &'a [f32],
    pub values: &'a [f32],
}

/// One decode step's result: `outputs` `[sequence][q_head][head_dim]` and, per
/// row, the log-sum-exp of its scaled logits over every token of its sequence
/// (`-inf` for a sequence without tokens).
#[derive(Debug, Clone, PartialEq)]
pub struct Attention {
    pub outputs: Vec<f32>,
    pub lse: Vec<f32>,
}

#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    #[error(transparent)]
    Encode(#[from] EncodeError),
    #[error(transparent)]
    Exec(#[from] ExecError),
    #[error(transparent)]
    Query(#[from] DecodeError),
    #[error("sequence {sequence} does not exist; the cache holds {sequences} sequences")]
    UnknownSequence { sequence: usize, sequences: usize },
    #[error("sequence {sequence} appears more than once in one append")]
    DuplicateSequence { sequence: usize },
    #[error("tier `{tier}` needs {needed} free pages but has {available} of {capacity}")]
    Capacity {
        tier: String,
        needed: usize,
        available: usize,
        capacity: usize,
    },
    #[error("{what} hold {value}, which {dtype} exact rows cannot represent")]
    ExactRange {
        what: &'static str,
        value: f32,
        dtype: &'static str,
    },
    #[error(
        "[cache.budget] score = {score} weighs states by the queries' attention, and none were \
         given: pass the prompt's queries at prefill (or use score = \"key_norm\")"
    )]
    NoQueries { score: &'static str },
    #[error("no prompt token to train the tables on")]
    NoTrainingData,
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
    /// A device live cache's shape or setup problem.
    #[error("{0}")]
    Device(String),
    /// A `[cache.budget]` that cannot be met, or misuse of one.
    #[error("{0}")]
    Budget(String),
    #[error("the policy's tier {tier} does not exist; the format has {tiers} tiers")]
    PolicyTier { tier: usize, tiers: usize },
}

/// Checks that every sequence of one append exists (`0..sequences`) and
/// appears once.
pub(crate) fn check_batch(
    sequences: usize,
    batch: impl IntoIterator<Item = usize>,
) -> Result<(), LiveError> {
    let mut seen = vec![false; sequences];
    for sequence in batch {
        let slot = seen.get_mut(sequence).ok_or(LiveError::UnknownSequence {
            sequence,
            sequences,
        })?;
        if std::mem::replace(slot, true) {
            return Err(LiveError::DuplicateSequence { sequence });
        }
    }
    Ok(())
}

/// What every live-cache backend offers. Calls check everything before they
/// change anything: a call that fails leaves the cache as it was.
pub trait LiveKv {
    fn format(&self) -> &Format;
    fn policy(&self) -> &CachePolicy;
    fn kv_heads(&self) -> usize;
    /// Tokens of every sequence, in sequence order.
    fn lengths(&self) -> Vec<usize>;
    /// Adds sequences (their prompts) and returns their indices.
    fn prefill(&mut self, sequences: &[SequenceKv]) -> Result<Vec<usize>, LiveError>;
    /// Adds tokens to existing sequences, any number per sequence; whole pages
    /// leaving the window are compressed.
    fn append(&mut self, batch: &[Append]) -> Result<(), LiveError>;
    /// One decode step: `queries` `[sequence][q_head][head_dim]`, every sequence.
    fn attend(&self, queries: &[f32], q_heads: usize) -> Result<Attention, LiveError>;
    /// Drops a sequence and frees its pages; later sequences move down by one.
    fn release(&mut self, sequence: usize) -> Result<(), LiveError>;
    /// The tier pages compressed from now on go to.
    fn set_tier(&mut self, tier: usize) -> Result<(), LiveError>;
    /// Records one decode step's queries (`[sequence][q_head][head_dim]`,
    /// unit-scaled) as the most recent a `[cache.budget]` weighs the next
    /// states by; a cache without a budget checks them and keeps nothing.
    fn observe(&mut self, queries: &[f32], q_heads: usize) -> Result<(), LiveError>;
}
