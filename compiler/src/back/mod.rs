#[cfg(feature = "jit")]
pub mod clif;
pub mod interp;
pub mod ptx;
pub mod shared_memory;
pub mod target;
pub mod text;
