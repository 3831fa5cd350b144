//! Opening the GPU without panicking when there is none.

use std::sync::Arc;

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use kvcc_compiler::target::Target;

use super::{CudaError, During};
use crate::tune::GpuId;

pub struct Gpu {
    pub(crate) context: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub name: String,
    pub compute_capability: (i32, i32),
    /// As cuDriverGetVersion reports it, e.g. 13000.
    pub driver_version: i32,
    pub multiprocessors: u32,
}

impl Gpu {
    /// GPU 0, or why there is none.
    pub fn open() -> Result<Gpu, CudaError> {
        Gpu::open_ordinal(0)
    }

    /// GPU `ordinal` in its primary context (the one CUDA's runtime, and so
    /// torch, uses), or why there is none.
    pub fn open_ordinal(ordinal: usize) -> Result<Gpu, CudaError> {
        // Probing the library first keeps cudarc from panicking on machines without it.
        // SAFETY: only tries to dlopen libcuda.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        let count = CudaContext::device_count().during(|| "counting devices".into())?;
        if count == 0 {
            return Err(CudaError::NoDevice);
        }
        if ordinal >= count as usize {
            return Err(CudaError::Shape(format!(
                "there is no GPU {ordinal}: the driver reports {count}"
            )));
        }
        let context = CudaContext::new(ordinal)
            .during(|| format!("retaining the primary context of GPU {ordinal}"))?;
        // Without this, every buffer argument of every launch records and
        // waits on events (cudarc's multi-stream bookkeeping): a dozen driver
        // calls before each kernel starts, GPU idle meanwhile.
        // SAFETY: every allocation, copy, launch and free goes through the one
        // stream below, in order, so no slice needs cross-stream tracking.
        unsafe { context.disable_event_tracking() };
        let stream = context.new_stream().during(|| "creating a stream".into())?;
        let name = context.name().during(|| "reading the device name".into())?;
        let compute_capability = context
            .compute_capability()
            .during(|| "reading the compute capability".into())?;
        let multiprocessors = context
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .during(|| "reading the multiprocessor count".into())?
            as u32;
        let mut driver_version = 0;
        // SAFETY: writes one int; the library is loaded (checked above).
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .during(|| "reading the driver version".into())?;
        Ok(Gpu {
            context,
            stream,
            name,
            compute_capability,
            driver_version,
            multiprocessors,
        })
    }

    /// What tuning results are keyed by.
    pub fn id(&self) -> GpuId {
        GpuId {
            name: self.name.clone(),
            compute_capability: self.compute_capability,
            driver_version: self.driver_version,
        }
    }

    /// `data` copied to a new device buffer (what `DeviceLiveCache::append_device`
    /// reads K/V from, for one).
    pub fn upload(&self, data: &[f32]) -> Result<CudaSlice<f32>, CudaError> {
        let mut buffer = (self.stream.alloc_zeros::<f32>(data.len().max(1)))
            .during(|| format!("allocating {} floats", data.len()))?;
        if !data.is_empty() {
            let mut part = buffer.slice_mut(0..data.len());
            (self.stream.memcpy_htod(data, &mut part)).during(|| "uploading".into())?;
        }
        Ok(buffer)
    }

    /// The PTX target to generate for this GPU.
    pub fn target(&self) -> Target {
        self.id().target()
    }

    /// What the tuning cost model knows of this GPU.
    pub fn machine(&self) -> crate::tune::model::Machine {
        crate::tune::model::Machine {
            target: self.target(),
            multiprocessors: self.multiprocessors,
        }
    }
}
