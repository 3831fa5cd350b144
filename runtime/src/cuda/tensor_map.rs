//! Tensor maps of the streams a decode kernel copies with
//! `cp.async.bulk.tensor` (`abi::TensorMap`), encoded on the host by the
//! driver over a tier's resident pool.

use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DriverError};
use kvcc_compiler::back::ptx::abi::{
    TensorMap, SWIZZLE_LINE as LINE, TENSOR_MAP_BYTES, TENSOR_MAP_SLOTS,
};

/// The `tensor_maps` buffer of a kernel over `pool` (`pages` pages): each
/// of `maps` encoded in its slot, the other slots zero (never read).
pub fn encode(
    stream: &CudaStream,
    pool: &CudaSlice<u8>,
    pages: usize,
    maps: &[TensorMap],
) -> Result<Vec<u8>, DriverError> {
    let mut out = vec![0u8; (TENSOR_MAP_SLOTS * TENSOR_MAP_BYTES) as usize];
    let (base, _in_use) = pool.device_ptr(stream);
    for map in maps {
        let lines = map.row_bytes / LINE;
        let dims = [
            u64::from(LINE),
            u64::from(lines),
            u64::from(map.items_per_page),
            pages as u64,
        ];
        let strides = [
            u64::from(LINE),
            u64::from(map.row_bytes),
            u64::from(map.page_bytes),
        ];
        let boxes = [LINE, lines, map.box_items, 1];
        let element_strides = [1u32; 4];
        let mut encoded = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: `encoded` is writable and 128-byte aligned; dims, boxes and
        // element strides have the rank's 4 entries and strides 3. The driver
        // checks the values (16-byte aligned address and strides, boxes of at
        // most 256 and an inner box of 128 bytes for the swizzle) and returns
        // an error for any it refuses.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                encoded.as_mut_ptr(),
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
                4,
                (base + u64::from(map.page_offset)) as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                // 128-byte promotion: with 256 the H200 streamed these copies at
                // 4.00 TB/s, not 4.49 (benches/gpu/copy_paths.cu, 32 KB tiles).
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
            .result()?;
        }
        // SAFETY: initialized by the successful call above.
        let words = unsafe { encoded.assume_init() }.opaque;
        let at = map.slot as usize * TENSOR_MAP_BYTES as usize;
        for (i, word) in words.iter().enumerate() {
            out[at + 8 * i..at + 8 * i + 8].copy_from_slice(&word.to_le_bytes());
        }
    }
    Ok(out)
}
