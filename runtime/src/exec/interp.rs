//! The reference interpreter as an executor.

use kvcc_compiler::back::interp::{Interpreter, Options};

use super::{ExecError, Executor};
use crate::cache::PagedCache;

#[derive(Debug, Clone, Copy, Default)]
pub struct InterpExecutor;

impl Executor for InterpExecutor {
    fn name(&self) -> &'static str {
        "interp"
    }

    fn decode(&self, cache: &PagedCache, queries: &[f32], q_heads: usize) -> Result<Vec<f32>, ExecError> {
        let interp = Interpreter::new(cache.format().tiers(), Options::default());
        Ok(interp.decode(&cache.view(), queries, q_heads)?)
    }
}
