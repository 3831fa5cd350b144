#[cfg(feature = "jit")]
pub mod clif;
pub mod interp;
pub mod ptx;
pub mod text;
