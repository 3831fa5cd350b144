pub mod builtin;

/// The compiler this runtime is built on (what `kv_format!`'s expansion names).
pub use kvcc_compiler as compiler;

#[doc(hidden)]
pub use kvcc_dsl_macros::kv_format as __kv_format;

/// `kv_format!("specs/my.toml")`: a spec file becomes a Rust module at compile
/// time (see `docs/kv-format-macro.md`). The expansion names only this crate.
#[macro_export]
macro_rules! kv_format {
    ($($input:tt)*) => {
        $crate::__kv_format!(crate = $crate; $($input)*);
    };
}

pub mod cache;
pub mod cli;
pub mod cuda;
pub mod encode;
pub mod exec;
pub mod live;
pub mod math;
pub mod metrics;
pub mod reference;
pub mod sweep;
pub mod synth;
pub mod table;
pub mod tensor_io;
pub mod tune;
