//! kvcc facade: the compiler and the runtime under one name.
pub use kvcc_compiler as compiler;
pub use kvcc_runtime as runtime;
pub use kvcc_runtime::kv_format;
