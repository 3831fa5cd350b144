//! Analyses and passes on the IR that more than one backend needs, done once
//! here on the IR (as naga's `proc/` and Cranelift's `ir/dfg.rs`) rather than
//! in each backend.
//!
//! - [`operands`](mod@operands): the operands of an expression, what a program reads, and
//!   which expressions depend on a given kind of input.
//! - [`known_bits`]: bits of a value known from its expression alone
//!   (trailing zeros, significant bits).
//! - [`inline_lut`]: a per-query lookup table's entries computed where the
//!   score reads them, the table and the stage that built it dropped.

pub mod inline_lut;
pub mod known_bits;
pub mod operands;

pub use known_bits::{known_zeros, significant_bits};
pub use operands::{depends_on, operands, reads_header, reads_tables, shared_reads};
