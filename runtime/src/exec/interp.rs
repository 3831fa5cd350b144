//! The reference interpreter as an executor.

use kvcc_compiler::back::interp::{Interpreter, Options};

use super::{Decoded, ExecError, Executor, Request};

#[derive(Debug, Clone, Copy, Default)]
pub struct InterpExecutor;

impl Executor for InterpExecutor {
    fn name(&self) -> &'static str {
        "interp"
    }

    fn execute(&self, request: Request<'_>) -> Result<Decoded, ExecError> {
        let view = request.view();
        let Request {
            cache,
            queries,
            q_heads,
            logits,
            ..
        } = request;
        let interp = Interpreter::new(cache.format().tiers(), Options::default());
        if !logits {
            let outputs = interp.decode(&view, queries, q_heads)?;
            return Ok(Decoded {
                outputs,
                logits: Vec::new(),
            });
        }
        interp.check_queries(queries, view.page_tables.len(), q_heads, view.kv_heads)?;
        let d = cache.format().head_dim() as usize;
        let group = q_heads / view.kv_heads;
        let mut decoded = Decoded {
            outputs: Vec::with_capacity(queries.len()),
            logits: Vec::with_capacity(queries.len() / d),
        };
        for (row, query) in queries.chunks(d).enumerate() {
            let attended = interp.attend(&view, row / q_heads, row % q_heads / group, query)?;
            decoded.outputs.extend(attended.output);
            decoded.logits.push(attended.logits);
        }
        Ok(decoded)
    }
}
