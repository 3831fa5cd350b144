//! The Python exceptions: every runtime error reaches Python with its
//! `Display` text, the message the `kvcc` command prints after `error: `.
//!
//! `KvccError` (a `ValueError`) is the base; `SpecError` is a bad spec,
//! `CapacityError` a live cache out of page slots. Shape, NaN and range
//! problems are `KvccError` itself.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use kvcc_runtime::live::LiveError;

pyo3::create_exception!(
    _kvcc,
    KvccError,
    PyValueError,
    "An error of the kvcc runtime."
);
pyo3::create_exception!(
    _kvcc,
    SpecError,
    KvccError,
    "A spec that does not parse or check."
);
pyo3::create_exception!(
    _kvcc,
    CapacityError,
    KvccError,
    "A live cache out of page slots."
);

pub fn kvcc_error(message: impl Into<String>) -> PyErr {
    KvccError::new_err(message.into())
}

pub fn spec_error(message: String) -> PyErr {
    SpecError::new_err(message)
}

/// Any runtime error (live cache, encoder, executor) as a Python exception.
pub fn to_py(error: impl Into<LiveError>) -> PyErr {
    let error = error.into();
    match error {
        LiveError::Capacity { .. } => CapacityError::new_err(error.to_string()),
        other => KvccError::new_err(other.to_string()),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvccError", py.get_type::<KvccError>())?;
    m.add("SpecError", py.get_type::<SpecError>())?;
    m.add("CapacityError", py.get_type::<CapacityError>())?;
    Ok(())
}
