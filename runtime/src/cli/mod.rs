//! The `kvcc` command's subcommands, as library code the binary calls.

pub mod bench;
pub mod budget_eval;
pub mod check;
pub mod demo;
pub mod eval;
mod fidelity;
pub mod live_bench;
pub mod live_fidelity;
pub mod policy;
pub mod tune;
