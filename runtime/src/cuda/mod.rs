//! The CUDA runtime: the GPU (through the driver API, loaded at run time), the
//! generated kernels of a format, a paged cache resident on the device, and a
//! decode step launched against the PTX backend's ABI.

mod device;
mod encode;
mod kernels;
mod live;
pub mod measure;
mod resident;
mod select;
mod tensor_map;

/// The driver crate this API's device types come from (`CudaSlice`,
/// `CudaView`, raw pointers of `DevicePtr`).
pub use cudarc;
pub use device::Gpu;
pub use encode::PageEncoders;
pub use kernels::FormatKernels;
pub use live::{DeviceAppend, DeviceLiveCache, DeviceLiveOptions};
pub use resident::{DeviceCache, DeviceDecode, StepIo};
pub use select::DeviceSelection;

use cudarc::driver::{DriverError, LaunchConfig};
use kvcc_compiler::back::ptx::abi;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver (libcuda) was found on this machine")]
    NoDriver,
    #[error("the CUDA driver reports no GPU")]
    NoDevice,
    #[error("CUDA driver error while {during}: {source}")]
    Driver {
        during: String,
        #[source]
        source: DriverError,
    },
    #[error(transparent)]
    Codegen(#[from] kvcc_compiler::back::ptx::Error),
    #[error(transparent)]
    Decode(#[from] kvcc_compiler::back::interp::DecodeError),
    #[error("{0}")]
    Shape(String),
    #[error(transparent)]
    Tune(#[from] crate::tune::TuneError),
}

/// Attaches what was being done to a driver error.
pub trait During<T> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T, CudaError>;
}

impl<T> During<T> for Result<T, DriverError> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T, CudaError> {
        self.map_err(|source| CudaError::Driver {
            during: what(),
            source,
        })
    }
}

/// The driver's launch configuration of an ABI launch shape.
pub(crate) fn config(launch: abi::Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (launch.grid[0], launch.grid[1], launch.grid[2]),
        block_dim: (launch.block[0], launch.block[1], launch.block[2]),
        shared_mem_bytes: launch.shared_bytes,
    }
}
