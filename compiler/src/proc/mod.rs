//! IR-to-IR passes and analyses shared by the backends.
//!
//! - [`inline_lut`]: a per-query lookup table's entries computed where the
//!   score reads them, the table and the stage that built it dropped.

pub mod inline_lut;
