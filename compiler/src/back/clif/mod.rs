//! The Cranelift JIT backend: each tier's four programs, and its page
//! encoder, become native functions for the host CPU, with the loops over a
//! page's items, channels and stage iterations inside the generated code (no
//! call per item).
//!
//! - `expr.rs`: IR expressions -> CLIF values, SIMD across lanes, constants
//!   folded with the interpreter's own evaluation.
//! - `stream.rs`: `ItemBits` -> loads that never leave the page.
//! - `program.rs`: the function shapes (score and accumulate over a page,
//!   prologue and epilogue over stage iterations) and the heads one call serves.
//! - `module.rs`: the JIT module, host ISA and settings, executable memory.
//! - `kernels.rs`: the compiled functions behind a safe, checked API.
//! - `encode/`: the page encoder of a tier (`compile_encoder`, `PageEncoder`):
//!   dense rows and tables in, the page `runtime::encode::encode_page` writes
//!   out, byte for byte; `side.rs` walks the layout, `num.rs` has the
//!   encoder's numbers (rounding, f16/bf16, NaN rules) as CLIF.
//!
//! Semantics are the interpreter's (`back::interp`), bit for bit: fused fma,
//! u32 wrapping arithmetic, binary16 conversion by integer ops; the online
//! softmax and the merge of tier partials stay with the executor.

mod encode;
mod expr;
mod kernels;
mod module;
mod program;
mod stream;

use cranelift_codegen::ir::types;

pub use encode::{compile_encoder, EncodeError, PageEncoder};
pub use kernels::{Kernels, Shape, Tables};

use crate::valid::ValidModule;

/// The most query heads one score/accumulate call serves.
pub const MAX_HEADS: u32 = 8;

/// What to generate. Part of the identity of compiled kernels: executors
/// cache kernels per (format, tier, options).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Options {
    /// Query heads (of one GQA group) each score/accumulate call serves,
    /// `1..=MAX_HEADS`: the item is decoded once for all of them.
    pub heads: u32,
    /// Items (score) or channels (accumulate) per vector: 4 (f32x4 SIMD) or
    /// 1 (scalar code).
    pub lanes: u32,
    /// Cranelift settings applied over the defaults (`opt_level = none`:
    /// the lowering schedules and hoists itself), e.g. `("opt_level", "speed")`.
    pub settings: Vec<(String, String)>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            heads: 4,
            lanes: expr::LANES as u32,
            settings: Vec::new(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("cranelift backend, format `{format}`, tier `{tier}`: {kind}")]
pub struct Error {
    pub format: String,
    pub tier: String,
    pub kind: ErrorKind,
}

#[derive(Debug, thiserror::Error)]
pub enum ErrorKind {
    #[error("unsupported options: {0}")]
    Options(String),
    #[error("Cranelift setting `{name}` = `{value}`: {message}")]
    Setting {
        name: String,
        value: String,
        message: String,
    },
    #[error("host ISA: {0}")]
    Isa(String),
    /// Cranelift rejected or failed to compile a function (verifier included).
    #[error("compiling {function}: {message}")]
    Compile {
        function: &'static str,
        message: String,
    },
    #[error("linking: {0}")]
    Link(String),
}

/// Compiles one tier's programs for the host.
pub fn compile(module: &ValidModule, options: &Options) -> Result<Kernels, Error> {
    let m = module.module();
    let error = |kind| Error {
        format: m.format.clone(),
        tier: m.tier.clone(),
        kind,
    };
    if !(1..=MAX_HEADS).contains(&options.heads) {
        return Err(error(ErrorKind::Options(format!(
            "heads must be 1..={MAX_HEADS}, not {}",
            options.heads
        ))));
    }
    if ![1, expr::LANES as u32].contains(&options.lanes) {
        return Err(error(ErrorKind::Options(format!(
            "lanes must be 1 or {}, not {}",
            expr::LANES,
            options.lanes
        ))));
    }
    let shape = Shape::new(m, options);
    let info = module.info();
    let (ptr, i32, f32) = (types::I64, types::I32, types::F32);
    let lanes = options.lanes as usize;
    let mut jit = module::Jit::new(&options.settings).map_err(error)?;
    let prologue = jit
        .define("key.prologue", &[ptr, ptr], 1, |fx, args| {
            program::kernel(fx, &m.key.prologue, &info.prologue, &shape, args)
        })
        .map_err(error)?;
    let score = jit
        .define(
            "key.score",
            &[ptr, i32, ptr, ptr, ptr],
            lanes,
            |fx, args| program::score(fx, m, &info.score, &shape, args),
        )
        .map_err(error)?;
    let accumulate = jit
        .define(
            "value.accumulate",
            &[ptr, i32, ptr, ptr, ptr, ptr],
            lanes,
            |fx, args| program::accumulate(fx, m, &info.accumulate, &shape, args),
        )
        .map_err(error)?;
    let epilogue = jit
        .define("value.epilogue", &[ptr, ptr, f32], 1, |fx, args| {
            program::kernel(fx, &m.value.epilogue, &info.epilogue, &shape, args)
        })
        .map_err(error)?;
    let (code, addresses) = jit
        .finish([prologue, score, accumulate, epilogue])
        .map_err(error)?;
    // SAFETY: the addresses are of the functions just defined with exactly
    // these signatures; `Kernels` keeps `code` alive as long as them.
    Ok(unsafe { Kernels::new(shape, code, addresses) })
}
