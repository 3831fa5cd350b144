//! Executors: decode attention over a paged cache. Every executor computes what
//! the reference interpreter defines; they differ in where and how fast.

mod cuda;
mod interp;
mod jit;

pub use cuda::CudaExecutor;
pub use interp::InterpExecutor;
pub use jit::{page_encoder, JitExecutor};

use kvcc_compiler::page::{CacheView, PageRef};

use crate::cache::PagedCache;

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Decode(#[from] kvcc_compiler::back::interp::DecodeError),
    #[error("the {executor} executor is not available here: {reason}")]
    Unavailable {
        executor: &'static str,
        reason: String,
    },
    /// A backend failed to build or run a tier's kernels; names format and tier.
    #[error("{executor} executor, format {format}, tier {tier}: {message}")]
    Backend {
        executor: &'static str,
        format: String,
        tier: String,
        message: String,
    },
}

/// A decode's outputs (`[sequence][q_head][head_dim]`) and each row's logits:
/// `logits[sequence * q_heads + q_head]` holds the softmax-scaled logit of
/// every token of the sequence, in page-table order.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub outputs: Vec<f32>,
    pub logits: Vec<Vec<f32>>,
}

/// One decode: `queries` (`[sequence][q_head][head_dim]`) over `cache`, and
/// every row's logits when `logits` is set (they cost the JIT extra work).
#[derive(Clone, Copy)]
pub struct Request<'a> {
    pub cache: &'a PagedCache,
    pub queries: &'a [f32],
    pub q_heads: usize,
    pub logits: bool,
    /// The pages each (sequence, kv head) reads, `[sequence][kv_head]` in
    /// token order, where a step reads fewer than the cache holds (a
    /// selection); `None`: the cache's page tables.
    pub rows: Option<&'a [Vec<Vec<PageRef>>]>,
}

impl<'a> Request<'a> {
    /// What the request reads: the cache, through `rows` where given.
    pub fn view(&self) -> CacheView<'a> {
        let mut view = self.cache.view();
        if let Some(rows) = self.rows {
            view.page_tables = rows;
        }
        view
    }
}

/// Decode attention: `queries` and the result are `[sequence][q_head][head_dim]`.
/// Executors are `Send + Sync` so a cache holding one can move between threads
/// (a Python object, a server's worker).
pub trait Executor: Send + Sync {
    fn name(&self) -> &'static str;
    /// Runs `request`; `Decoded::logits` is empty unless `request.logits`.
    fn execute(&self, request: Request<'_>) -> Result<Decoded, ExecError>;
    fn decode(
        &self,
        cache: &PagedCache,
        queries: &[f32],
        q_heads: usize,
    ) -> Result<Vec<f32>, ExecError> {
        let request = Request {
            cache,
            queries,
            q_heads,
            logits: false,
            rows: None,
        };
        Ok(self.execute(request)?.outputs)
    }
    /// `decode` with every row's logits (what fidelity metrics compare).
    fn decode_with_logits(
        &self,
        cache: &PagedCache,
        queries: &[f32],
        q_heads: usize,
    ) -> Result<Decoded, ExecError> {
        self.execute(Request {
            cache,
            queries,
            q_heads,
            logits: true,
            rows: None,
        })
    }
}

/// An executor by name, as `--executor` takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExecutorKind {
    Interp,
    #[default]
    Jit,
    /// The generated PTX kernels on GPU 0.
    Cuda,
}

impl ExecutorKind {
    pub const ALL: [ExecutorKind; 3] =
        [ExecutorKind::Interp, ExecutorKind::Jit, ExecutorKind::Cuda];

    pub fn name(self) -> &'static str {
        match self {
            ExecutorKind::Interp => "interp",
            ExecutorKind::Jit => "jit",
            ExecutorKind::Cuda => "cuda",
        }
    }

    /// The executor (with its default options); `cuda` fails without a GPU.
    pub fn executor(self) -> Result<Box<dyn Executor>, ExecError> {
        Ok(match self {
            ExecutorKind::Interp => Box::new(InterpExecutor),
            ExecutorKind::Jit => Box::new(JitExecutor::default()),
            ExecutorKind::Cuda => {
                Box::new(CudaExecutor::open().map_err(|e| ExecError::Unavailable {
                    executor: "cuda",
                    reason: e.to_string(),
                })?)
            }
        })
    }
}

impl std::str::FromStr for ExecutorKind {
    type Err = String;
    fn from_str(name: &str) -> Result<ExecutorKind, String> {
        ExecutorKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| {
                let available: Vec<_> = ExecutorKind::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "no executor `{name}` in this build; available: {}",
                    available.join(", ")
                )
            })
    }
}
