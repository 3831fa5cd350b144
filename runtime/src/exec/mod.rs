//! Executors: decode attention over a paged cache. Every executor computes what
//! the reference interpreter defines; they differ in where and how fast.

mod interp;

pub use interp::InterpExecutor;

use crate::cache::PagedCache;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Decode(#[from] kvcc_compiler::back::interp::DecodeError),
    /// A backend failed to build or run a tier's kernels; names format and tier.
    #[error("{executor} executor, format {format}, tier {tier}: {message}")]
    Backend {
        executor: &'static str,
        format: String,
        tier: String,
        message: String,
    },
}

/// Decode attention: `queries` and the result are `[sequence][q_head][head_dim]`.
pub trait Executor {
    fn name(&self) -> &'static str;
    fn decode(&self, cache: &PagedCache, queries: &[f32], q_heads: usize) -> Result<Vec<f32>, ExecError>;
}
