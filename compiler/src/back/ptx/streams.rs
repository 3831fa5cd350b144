//! Where a tile's item streams (keys, values) sit: in their page, and in a
//! tile buffer in shared memory (row strides padded against bank conflicts,
//! alignment of an item's address).

use crate::layout::round_up;

/// Bytes a `cp.async` moves; pages, streams and tables are aligned to it.
pub const CHUNK: u32 = 16;

/// One item stream (key or value) of a tile.
#[derive(Debug, Clone, Copy)]
pub struct Stream {
    /// Byte offset of the stream in the page.
    pub page_offset: u32,
    /// Item stride in the page.
    pub stride: u32,
    /// Item stride in shared memory: `stride`, or `stride + 16` when the stride
    /// is an even number of 16-byte chunks (then lanes reading the same offset
    /// of consecutive items would hit the same banks) and the items are copied
    /// one by one (bulk copies move the stream as it is in the page).
    pub shared_stride: u32,
    /// Byte offset of the stream's items in a tile buffer.
    pub buffer_offset: u32,
    /// Loaded by tensor copies with the 128-byte swizzle (sm_90 bulk copies
    /// of rows a multiple of 128 bytes that only the tensor cores' fragment
    /// loads read; they swizzle their addresses alike): the rows are
    /// unpadded, yet a column of them spreads over every bank.
    pub swizzled: bool,
}

/// Row stride in shared memory for rows `stride` bytes long: `stride`, or
/// `stride + 16` when it is an even number of 16-byte chunks (then lanes
/// reading the same offset of consecutive rows would hit the same banks).
pub fn shared_stride(stride: u32) -> u32 {
    let padded = stride.is_multiple_of(CHUNK) && (stride / CHUNK).is_multiple_of(2);
    if padded {
        stride + CHUNK
    } else {
        stride
    }
}

/// Known alignment (1, 2, 4, 8 or 16) of rows `stride` bytes apart from a
/// 16-aligned start.
pub fn stride_align(stride: u32) -> u32 {
    1 << stride.trailing_zeros().min(4)
}

impl Stream {
    pub(super) fn new(page_offset: u32, stride: u32, bulk: bool) -> Stream {
        Stream {
            page_offset,
            stride,
            shared_stride: if bulk { stride } else { shared_stride(stride) },
            buffer_offset: 0,
            swizzled: false,
        }
    }

    /// Whether items are copied one by one to padded rows (else the stream is
    /// copied as one contiguous run of chunks).
    pub fn padded(&self) -> bool {
        self.shared_stride != self.stride
    }

    /// Known alignment of an item's shared address (1, 2, 4, 8 or 16).
    pub fn align(&self) -> u32 {
        stride_align(self.shared_stride)
    }

    /// Bytes of a tile of `items` items in shared memory.
    pub(super) fn capacity(&self, items: u32) -> u32 {
        round_up(items * self.shared_stride, CHUNK)
    }
}
