//! Where a live cache runs. This is the one place a device is chosen: a new
//! backend is one arm of [`open`].
//!
//! The CPU backend is the runtime's [`LiveCache`]: pages encoded by the CPU
//! encoder, attended by the JIT (or the interpreter), on host f32 slices that
//! numpy shares with torch's CPU tensors.
//!
//! The CUDA backend is not wired in yet, so `cuda:N` fails here, with a
//! `NotImplementedError`. What it plugs into: a `LiveKv` implementor on the
//! GPU whose calls take device memory instead of host slices, on torch's
//! current context and stream, so a decode step makes no host copies and can
//! be captured in a CUDA graph. The binding expects, per call,
//!
//! ```text
//! prefill_device(keys: DeviceTensor, values: DeviceTensor, stream) -> Vec<usize>
//! append_device(sequences: &[usize], keys: DeviceTensor, values: DeviceTensor, stream)
//! attend_device(queries: DeviceTensor, q_heads, out: DeviceTensor, lse: DeviceTensor, stream)
//! ```
//!
//! with `DeviceTensor { ptr: CUdeviceptr, dtype: f32 | f16 | bf16, shape }`
//! (`[batch][kv_head][token][head_dim]` for keys and values,
//! `[batch][q_head][head_dim]` for queries and outputs, `[batch][q_head]` f32
//! for the log-sum-exp) and `stream` a `CUstream` (torch's
//! `torch.cuda.current_stream().cuda_stream`); `attend_device` must not
//! allocate or synchronize, so it can be captured.

use kvcc_compiler::Format;
use kvcc_runtime::cache::Tables;
use kvcc_runtime::live::{LiveCache, LiveKv, LiveOptions};
use pyo3::exceptions::PyNotImplementedError;
use pyo3::prelude::*;

use crate::errors::{kvcc_error, to_py};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda { ordinal: usize },
}

impl Device {
    /// `cpu`, `cuda` or `cuda:N`, as torch names devices.
    pub fn parse(name: &str) -> PyResult<Device> {
        match name {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda { ordinal: 0 }),
            _ => name
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|ordinal| Device::Cuda { ordinal })
                .ok_or_else(|| {
                    kvcc_error(format!(
                        "no device `{name}`: a live cache runs on `cpu` or `cuda[:N]`"
                    ))
                }),
        }
    }
}

/// Opens a live cache of `format` on `device` with trained `tables`.
pub fn open(
    device: Device,
    format: &Format,
    options: &LiveOptions,
    tables: Tables,
) -> PyResult<Box<dyn LiveKv + Send>> {
    match device {
        Device::Cpu => Ok(Box::new(
            LiveCache::new(format, options, tables).map_err(to_py)?,
        )),
        Device::Cuda { ordinal } => Err(cuda_unavailable(ordinal)),
    }
}

/// Fails now, before any tables are trained, for a device [`open`] cannot serve.
#[pyfunction]
pub fn check_device(device: &str) -> PyResult<()> {
    match Device::parse(device)? {
        Device::Cpu => Ok(()),
        Device::Cuda { ordinal } => Err(cuda_unavailable(ordinal)),
    }
}

fn cuda_unavailable(ordinal: usize) -> PyErr {
    PyNotImplementedError::new_err(format!(
        "the CUDA live cache is not in this build of the kvcc package \
         (asked for cuda:{ordinal}); use CPU tensors and device=\"cpu\""
    ))
}
