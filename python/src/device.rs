//! Where a live cache runs. This is the one place a device is chosen: a new
//! backend is one arm of [`open`].
//!
//! The CPU backend is the runtime's [`LiveCache`]: pages encoded by the CPU
//! encoder, attended by the JIT (or the interpreter), on host f32 slices that
//! numpy shares with torch's CPU tensors.
//!
//! The CUDA backend is the runtime's [`DeviceLiveCache`] on the device's
//! primary context (torch's). Its calls take torch's tensors as device
//! pointers ([`DeviceRows`]) and torch's current stream: each call waits for
//! that stream's work so far and makes the stream wait for its own (events,
//! no host wait), so nothing is copied to the host and a decode step can be
//! captured in a CUDA graph. Decode steps are planned for capacity
//! (`fixed_plan`): a captured step stays valid while appends fill and
//! compress pages.

use std::sync::{Arc, Mutex};

use kvcc_compiler::back::ptx::abi::RowDtype;
use kvcc_compiler::Format;
use kvcc_runtime::cache::Tables;
use kvcc_runtime::cuda::{DeviceAppend, DeviceLiveCache, DeviceLiveOptions, Gpu, StepIo};
use kvcc_runtime::live::{LiveCache, LiveKv, LiveOptions};
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

/// A live cache on its device.
pub enum Backend {
    Host(Box<dyn LiveKv + Send>),
    Cuda(Box<DeviceLiveCache>),
}

impl Backend {
    pub fn live(&self) -> &dyn LiveKv {
        match self {
            Backend::Host(live) => live.as_ref(),
            Backend::Cuda(live) => live.as_ref(),
        }
    }

    pub fn live_mut(&mut self) -> &mut dyn LiveKv {
        match self {
            Backend::Host(live) => live.as_mut(),
            Backend::Cuda(live) => live.as_mut(),
        }
    }

    /// The CUDA cache, or the error for device calls on a CPU cache.
    pub fn cuda(&mut self) -> PyResult<&mut DeviceLiveCache> {
        match self {
            Backend::Cuda(live) => Ok(live),
            Backend::Host(_) => Err(kvcc_error(
                "device memory was passed to a live cache on the CPU",
            )),
        }
    }
}

/// New K/V rows in device memory: torch tensors' `data_ptr()`s, `len`
/// elements each of `dtype`.
#[derive(Debug, Clone, Copy)]
pub struct DeviceRows {
    pub keys: u64,
    pub values: u64,
    pub len: usize,
    pub dtype: RowDtype,
}

/// `float32`, `float16` or `bfloat16`, as torch names them.
pub fn row_dtype(name: &str) -> PyResult<RowDtype> {
    match name.strip_prefix("torch.").unwrap_or(name) {
        "float32" => Ok(RowDtype::F32),
        "float16" => Ok(RowDtype::F16),
        "bfloat16" => Ok(RowDtype::Bf16),
        other => Err(kvcc_error(format!(
            "device K/V rows are float32, float16 or bfloat16, not {other}"
        ))),
    }
}

/// Runs `work` on the CUDA cache ordered against `stream` (torch's current
/// stream, as an integer).
pub fn on_stream<T>(
    live: &mut DeviceLiveCache,
    stream: usize,
    work: impl FnOnce(&mut DeviceLiveCache) -> Result<T, kvcc_runtime::live::LiveError>,
) -> PyResult<T> {
    // SAFETY: torch's streams live as long as the process (its pool) or are
    // the legacy default stream (0), all in the primary context; the Python
    // side passes the stream that is current during this call.
    unsafe { live.on_stream(stream as _, work) }.map_err(to_py)
}

/// Appends device rows (see [`DeviceLiveCache::append_rows`]).
pub fn append(
    live: &mut DeviceLiveCache,
    stream: usize,
    rows: DeviceRows,
    batch: &[DeviceAppend],
) -> PyResult<()> {
    on_stream(live, stream, |live| {
        // SAFETY: the pointers are contiguous torch tensors of `len`
        // elements of `dtype` on this device (checked by the Python side),
        // kept alive by the caller until the stream has read them.
        unsafe { live.append_rows(rows.keys, rows.values, rows.len, rows.dtype, batch) }
    })
}

/// Prefills device rows: `tokens` per new sequence.
pub fn prefill(
    live: &mut DeviceLiveCache,
    stream: usize,
    rows: DeviceRows,
    tokens: &[usize],
) -> PyResult<Vec<usize>> {
    on_stream(live, stream, |live| {
        // SAFETY: as in `append`.
        unsafe { live.prefill_rows(rows.keys, rows.values, rows.len, rows.dtype, tokens) }
    })
}

/// One decode step into torch's buffers.
pub fn attend(
    live: &mut DeviceLiveCache,
    stream: usize,
    io: StepIo,
    q_heads: usize,
) -> PyResult<()> {
    on_stream(live, stream, |live| {
        // SAFETY: the Python side allocated the three f32 tensors on this
        // device with `sequences * q_heads * head_dim` and `sequences *
        // q_heads` elements and keeps them alive (torch's caching allocator
        // orders their reuse on the stream).
        unsafe { live.attend_into(io, q_heads) }
    })
}

/// One `Gpu` (context and stream) per device, shared by its caches.
fn gpu(ordinal: usize) -> PyResult<Arc<Gpu>> {
    static GPUS: Mutex<Vec<(usize, Arc<Gpu>)>> = Mutex::new(Vec::new());
    let mut gpus = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, gpu)) = gpus.iter().find(|(o, _)| *o == ordinal) {
        return Ok(gpu.clone());
    }
    let gpu = Arc::new(Gpu::open_ordinal(ordinal).map_err(to_py)?);
    gpus.push((ordinal, gpu.clone()));
    Ok(gpu)
}

/// Opens a live cache of `format` on `device` with trained `tables`, for at
/// most `batch` sequences; `q_heads` is the query heads the CUDA kernels are
/// first loaded for (others reload them).
pub fn open(
    device: Device,
    format: &Format,
    options: &LiveOptions,
    tables: Tables,
    batch: usize,
    q_heads: usize,
) -> PyResult<Backend> {
    match device {
        Device::Cpu => Ok(Backend::Host(Box::new(
            LiveCache::new(format, options, tables).map_err(to_py)?,
        ))),
        Device::Cuda { ordinal } => {
            let gpu = gpu(ordinal)?;
            let items = format.spec().page.items as usize;
            let rows = (batch * options.kv_heads).max(1);
            let device_options = DeviceLiveOptions {
                policy: options.policy,
                kv_heads: options.kv_heads,
                max_sequences: batch.max(1),
                pages_per_tier: options.pages_per_tier,
                // The context the capacity holds: what tuned kernels are looked up for.
                context: (options.pages_per_tier * items / rows).max(items),
                q_heads,
                fixed_plan: true,
            };
            let live = DeviceLiveCache::new(gpu, format, &device_options, tables).map_err(to_py)?;
            Ok(Backend::Cuda(Box::new(live)))
        }
    }
}

/// Fails now, before any tables are trained, for a device [`open`] cannot
/// serve (a CUDA device without a driver or of another ordinal).
#[pyfunction]
pub fn check_device(device: &str) -> PyResult<()> {
    match Device::parse(device)? {
        Device::Cpu => Ok(()),
        Device::Cuda { ordinal } => gpu(ordinal).map(|_| ()),
    }
}
