//! kvcc compiler: a code-format spec (TOML) becomes a validated IR per tier, which
//! the backends consume.
//!
//! - [`spec`]: the spec as data; [`front`]: TOML parsing and spec checks with positions.
//! - [`layout`]: bit layout of items, page headers and tables of every tier.
//! - [`ir`]: the one IR (per tier: query prologue, score, accumulate, epilogue).
//! - [`lower`]: spec tier -> IR; [`valid`]: the IR validator every backend requires.
//! - [`proc`]: analyses of the IR the backends share (operands, known bits).
//! - [`page`]: page headers and the cache view executors read.
//! - [`proc`]: IR-to-IR passes backends apply.
//! - [`Format`]: the pipeline (check, layout, lower, validate) in one call.
//! - [`back`]: backends: `interp` (the reference interpreter that defines the
//!   semantics), `text` (readable IR, the snapshot format of `generated/`) and
//!   `clif` (Cranelift JIT for the host CPU).
//! - [`target`]: the GPU targets and what each offers (features, shared
//!   memory, multiprocessors), below both the front end and the back ends.
//! - [`build`]: PTX and layout reports for a user's `build.rs`.

pub mod back;
pub mod build;
mod format;
pub mod front;
pub mod ir;
pub mod layout;
pub mod lower;
pub mod page;
pub mod proc;
pub mod spec;
pub mod target;
pub mod valid;

pub use format::{CompileError, Format};
