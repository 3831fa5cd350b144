//! Autotuning of the generated decode kernels: which page size, tile shape,
//! warps and splits are fastest for a tier on this GPU at a serving shape.
//!
//! - [`config`]: one point of the space ([`KernelConfig`]: a page size, the
//!   back end's [`Schedule`](kvcc_compiler::back::ptx::Schedule), splits) and
//!   how it becomes PTX options and a page format.
//! - [`key`]: what a result is valid for ([`TuneKey`]: GPU, driver, a hash of
//!   the generated code, tier, shape bucket).
//! - [`search`]: the candidate space and the search over it (exhaustive or
//!   coordinate descent), independent of how a candidate is measured.
//! - [`store`]: the on-disk cache of every candidate's timing, export/import.
//! - [`model`]: the defaults: the back end's cost model at a shape bucket.
//! - [`shipped`]: the tune results that ship with kvcc.
//! - [`lookup`]: what the runtime launches with: the tuned winner for the
//!   pages' page size (the user's cache, then the shipped results), or the
//!   model's defaults (saying why, once).
//!
//! Measuring candidates on the GPU is [`crate::sweep`]'s, above both this
//! module and [`crate::cuda`].

pub mod config;
pub mod key;
pub mod lookup;
pub mod model;
pub mod search;
pub mod shipped;
pub mod store;

pub use config::KernelConfig;
pub use key::{codegen_hash, GpuId, ShapeBucket, TuneKey};
pub use lookup::{resolve, Resolution, Source};
pub use search::{Measured, SearchReport, Space, Strategy};
pub use store::{Candidate, Entry, SweepRecord, TuneCache};

#[derive(Debug, thiserror::Error)]
pub enum TuneError {
    /// The pages were written with another page size than the kernel was tuned
    /// (and generated) for: its addressing would read the wrong bytes.
    #[error(
        "the kernel was tuned for {tuned}-item pages but the pages hold {pages} items each; \
         re-encode the cache with page.items = {tuned} or use a configuration for {pages}-item pages"
    )]
    PageSize { tuned: u32, pages: u32 },
    #[error("page size {items} is not valid for format {format}: {reason}")]
    PageVariant {
        format: String,
        items: u32,
        reason: String,
    },
    #[error("tune cache {path}: {message}")]
    Io { path: String, message: String },
}
