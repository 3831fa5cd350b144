//! The spec front end: TOML source -> checked [`FormatSpec`](crate::spec::FormatSpec),
//! with every error at a file:line:column and a document path.
//!
//! - [`toml`]: [`parse_spec`] / [`load_spec`] (syntax, shape, then semantic checks).
//! - [`cache`]: the `[cache]` table's rules (the live-cache policy).
//! - [`check`]: the semantic rules and the shared-memory estimate.
//! - [`problem`]: a problem's path into the document and its message.
//! - [`diagnostic`]: [`Diagnostic`] and [`SpecError`].

pub mod cache;
pub mod check;
pub mod diagnostic;
pub mod problem;
mod suggest;
pub mod toml;

pub use self::toml::{load_spec, parse_spec};
pub use diagnostic::{Diagnostic, SpecError};
