//! The contract between the generated kernels and the runtime that launches
//! them: kernel names, parameters in order, launch shape, dynamic shared memory,
//! and the layouts of every device buffer the kernels read or write.
//!
//! Per format there is one decode kernel per tier (each in its own PTX module)
//! and one merge kernel. A decode step is:
//!
//! 1. for every tier `t` with pages: launch its decode kernel on the grid
//!    [`DecodeKernel::launch`]`(splits_t, kv_heads, sequences)`; it writes
//!    `splits_t` partials per (sequence, query head) into slots
//!    `slot_base_t .. slot_base_t + splits_t` of the partials buffer
//!    ([`slot_bases`]);
//! 2. launch the merge kernel ([`MergeKernel::launch`]), which combines all
//!    `slot_count` partials of each (sequence, query head) into the output.
//!
//! Every slot of every (sequence, query head) must be written by some decode
//! launch before the merge: a tier launches even when a sequence has no page of
//! that tier (its CTAs write empty partials), or the runtime leaves that tier's
//! slots out of `slot_count` altogether.

use crate::ir::Module;
use crate::layout::{FieldLayout, Side, TierLayout, TransformLayout};
use crate::page::PageRef;
use crate::spec::DenseDtype;

/// Type of a kernel parameter as the launcher passes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamType {
    /// A device pointer (`u64`), 16-byte aligned.
    Pointer,
    U32,
    F32,
}

impl ParamType {
    /// PTX declaration type.
    pub fn ptx(self) -> &'static str {
        match self {
            ParamType::Pointer => ".u64",
            ParamType::U32 => ".u32",
            ParamType::F32 => ".f32",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    pub name: &'static str,
    pub ty: ParamType,
    pub doc: &'static str,
}

pub(crate) const fn param(name: &'static str, ty: ParamType, doc: &'static str) -> Param {
    Param { name, ty, doc }
}

/// Parameters of every decode kernel, in order; [`DecodeArgs`] holds values for them.
pub const DECODE_PARAMS: [Param; 13] = [
    param(
        "pool",
        ParamType::Pointer,
        "this tier's page pool: pages of `page_bytes` bytes back to back",
    ),
    param(
        "page_offsets",
        ParamType::Pointer,
        "u32[sequences * kv_heads + 1]: pages of row (sequence * kv_heads + kv_head) are page_ids[page_offsets[row] .. page_offsets[row + 1]]",
    ),
    param(
        "page_ids",
        ParamType::Pointer,
        "u32 page indices into this tier's pool, per row in token order (see `page_lists`)",
    ),
    param(
        "tables",
        ParamType::Pointer,
        "f32 tables of this tier, laid out as `TableBuffer`",
    ),
    param(
        "queries",
        ParamType::Pointer,
        "f32[sequences][q_heads][head_dim]",
    ),
    param(
        "partials",
        ParamType::Pointer,
        "f32 partial records, laid out as `PartialLayout`",
    ),
    param(
        "q_heads",
        ParamType::U32,
        "query heads per sequence: kv_heads * group, group <= max_query_group",
    ),
    param(
        "kv_heads",
        ParamType::U32,
        "kv heads per sequence (gridDim.y)",
    ),
    param(
        "splits",
        ParamType::U32,
        "CTAs per (sequence, kv head) (gridDim.x); each takes a contiguous share of the row's pages",
    ),
    param(
        "slot_base",
        ParamType::U32,
        "first partial slot of this launch; split s writes slot slot_base + s",
    ),
    param(
        "slot_count",
        ParamType::U32,
        "partial slots per (sequence, query head), over all launches",
    ),
    param(
        "softmax_scale",
        ParamType::F32,
        "multiplies every logit (1/sqrt(head_dim) for standard attention)",
    ),
    param(
        "tensor_maps",
        ParamType::Pointer,
        "CUtensorMap[2] (128 bytes each, 64-byte aligned) over this tier's pool: the key and the value stream's, for the streams `DecodeKernel::tensor_maps` lists (unread otherwise)",
    ),
];

/// Parameters of the merge kernel, in order; [`MergeArgs`] holds values for them.
pub const MERGE_PARAMS: [Param; 5] = [
    param(
        "partials",
        ParamType::Pointer,
        "f32 partial records, laid out as `PartialLayout`",
    ),
    param(
        "output",
        ParamType::Pointer,
        "f32[sequences][q_heads][head_dim]: the attention output",
    ),
    param(
        "lse",
        ParamType::Pointer,
        "f32[sequences][q_heads]: ln of the sum of exp of every scaled logit of the row (-inf when the row saw no item)",
    ),
    param("q_heads", ParamType::U32, "query heads per sequence"),
    param(
        "slot_count",
        ParamType::U32,
        "partial slots per (sequence, query head)",
    ),
];

/// Parameters of a live cache's append kernel (`append`), in order.
pub const APPEND_PARAMS: [Param; 7] = [
    param(
        "pool",
        ParamType::Pointer,
        "the exact tier's page pool: pages of `page_bytes` bytes back to back",
    ),
    param(
        "keys",
        ParamType::Pointer,
        "[source rows][head_dim] of the kernel's row dtype (f32, f16 or bf16): new keys, one row per (token, kv head)",
    ),
    param(
        "values",
        ParamType::Pointer,
        "[source rows][head_dim] of the row dtype: the new values",
    ),
    param(
        "rows",
        ParamType::Pointer,
        "u32[row_count][2]: (source row, page * items_per_page + item) - row r copies that key and value row into that item of the exact pool",
    ),
    param("row_count", ParamType::U32, "rows to write (CTAs 0..row_count)"),
    param(
        "headers",
        ParamType::Pointer,
        "u32[header_count][2]: (page, count) pairs; each page's header is rewritten with the exact tier, count and zero flags",
    ),
    param(
        "header_count",
        ParamType::U32,
        "header updates (CTAs 0..header_count); a page appears once",
    ),
];

/// Element type of the new K/V rows an append kernel reads: one kernel per
/// dtype, so rows arrive in the model's own dtype and are rounded once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowDtype {
    F32,
    F16,
    Bf16,
}

impl RowDtype {
    pub const ALL: [RowDtype; 3] = [RowDtype::F32, RowDtype::F16, RowDtype::Bf16];

    pub fn name(self) -> &'static str {
        match self {
            RowDtype::F32 => "f32",
            RowDtype::F16 => "f16",
            RowDtype::Bf16 => "bf16",
        }
    }

    pub fn bytes(self) -> u32 {
        match self {
            RowDtype::F32 => 4,
            RowDtype::F16 | RowDtype::Bf16 => 2,
        }
    }
}

/// A live cache's append kernel: grid `max(rows, header_count)` CTAs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppendKernel {
    pub name: String,
    pub threads: u32,
    /// What its `keys` and `values` rows hold.
    pub rows: RowDtype,
}

impl AppendKernel {
    /// The grid for `rows` rows and `header_count` header updates.
    pub fn launch(&self, rows: u32, header_count: u32) -> Launch {
        Launch {
            grid: [rows.max(header_count).max(1), 1, 1],
            block: [self.threads, 1, 1],
            shared_bytes: 0,
        }
    }
}

/// Argument values of a decode launch, field order = [`DECODE_PARAMS`] order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeArgs {
    pub pool: u64,
    pub page_offsets: u64,
    pub page_ids: u64,
    pub tables: u64,
    pub queries: u64,
    pub partials: u64,
    pub q_heads: u32,
    pub kv_heads: u32,
    pub splits: u32,
    pub slot_base: u32,
    pub slot_count: u32,
    pub softmax_scale: f32,
    pub tensor_maps: u64,
}

/// Argument values of a merge launch, field order = [`MERGE_PARAMS`] order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MergeArgs {
    pub partials: u64,
    pub output: u64,
    pub lse: u64,
    pub q_heads: u32,
    pub slot_count: u32,
}

/// Grid, block and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory bytes. Above 48 KiB the kernel must first be
    /// allowed it (`cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)`).
    pub shared_bytes: u32,
}

/// Where a tier's tables live in its device buffer: f32 values, per kv head a
/// block of `stride` floats; table `k` of kv head `h` starts at float
/// `h * stride + offsets[k]` and holds `lens[k]` values. Offsets are multiples
/// of 4 floats (16 bytes): kernels copy tables with 16-byte loads, and read the
/// padding after a table, which the runtime should zero.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableBuffer {
    pub offsets: Vec<u32>,
    pub lens: Vec<u32>,
    pub stride: u32,
}

impl TableBuffer {
    /// Tables in module order (`Module::tables`, which is the layout's order).
    pub fn of(module: &Module) -> TableBuffer {
        TableBuffer::from_lens(module.tables.iter().map(|(_, decl)| decl.len))
    }

    /// Tables in the layout's order: the same buffer as [`TableBuffer::of`]
    /// of the tier's module (the module declares the layout's tables).
    pub fn of_layout(layout: &TierLayout) -> TableBuffer {
        TableBuffer::from_lens(layout.tables.iter().map(|t| t.len))
    }

    fn from_lens(lens: impl Iterator<Item = u32>) -> TableBuffer {
        let mut offsets = Vec::new();
        let mut lengths = Vec::new();
        let mut at = 0;
        for len in lens {
            offsets.push(at);
            lengths.push(len);
            at += len.div_ceil(4) * 4;
        }
        TableBuffer {
            offsets,
            lens: lengths,
            stride: at,
        }
    }

    /// The buffer's contents from `[kv_head][table]` f32 tables (as in
    /// `page::TierView::tables`), padding zeroed. Panics if a table's length
    /// differs from the layout (the interpreter's `check_cache` reports that
    /// as an error first).
    pub fn fill(&self, tables: &[Vec<Vec<f32>>]) -> Vec<f32> {
        let mut out = vec![0.0; tables.len() * self.stride as usize];
        for (head, head_tables) in tables.iter().enumerate() {
            assert_eq!(head_tables.len(), self.lens.len(), "table count");
            for (k, values) in head_tables.iter().enumerate() {
                assert_eq!(values.len(), self.lens[k] as usize, "table {k} length");
                let at = head * self.stride as usize + self.offsets[k] as usize;
                out[at..at + values.len()].copy_from_slice(values);
            }
        }
        out
    }
}

/// The partials buffer: f32 records of `record` floats, one per
/// (sequence, query head, slot), record index
/// `(sequence * q_heads + q_head) * slot_count + slot`. A record holds the
/// unnormalized output (`head_dim` floats: the value epilogue applied to
/// Σ exp(s − m)·v), then `m` (the largest logit, −∞ if the slot saw no item)
/// and `l` (Σ exp(s − m), 0 if none), then padding to 16 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartialLayout {
    pub head_dim: u32,
    pub record: u32,
}

impl PartialLayout {
    pub fn new(head_dim: u32) -> PartialLayout {
        PartialLayout {
            head_dim,
            record: (head_dim + 2).div_ceil(4) * 4,
        }
    }
    /// Float offset of `m` in a record (`l` follows it).
    pub fn max_offset(&self) -> u32 {
        self.head_dim
    }
    pub fn sum_offset(&self) -> u32 {
        self.head_dim + 1
    }
    /// Float index of a record's first value.
    pub fn record_index(
        &self,
        sequence: usize,
        q_head: usize,
        slot: usize,
        q_heads: usize,
        slot_count: usize,
    ) -> usize {
        ((sequence * q_heads + q_head) * slot_count + slot) * self.record as usize
    }
    /// Floats of the whole buffer.
    pub fn len(&self, sequences: usize, q_heads: usize, slot_count: usize) -> usize {
        sequences * q_heads * slot_count * self.record as usize
    }
}

/// One tier's decode kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeKernel {
    /// Entry name in the tier's PTX module.
    pub name: String,
    pub tier: u32,
    pub threads: u32,
    /// Dynamic shared memory (bytes) of every launch.
    pub shared_bytes: u32,
    /// Largest query group (q_heads / kv_heads) the kernel serves.
    pub max_query_group: u32,
    /// Bytes per page of the pool.
    pub page_bytes: u32,
    /// Items per tile (a page is streamed as `ceil(items_per_page / tile_items)` tiles).
    pub tile_items: u32,
    pub tables: TableBuffer,
    pub partials: PartialLayout,
    /// The streams that load by tensor copies, each through the tensor map at
    /// its [`TensorMap::slot`] of the `tensor_maps` buffer.
    pub tensor_maps: Vec<TensorMap>,
}

/// A stream the kernel copies with `cp.async.bulk.tensor` (sm_90): the
/// runtime encodes, over the pool at `pool + page_offset`, a 4-d tensor of
/// bytes `[pages][items_per_page][row_bytes / 128][128]` (strides
/// `page_bytes`, `row_bytes`, 128) with boxes of `[1][box_items][row_bytes /
/// 128][128]` and the 128-byte swizzle (`CU_TENSOR_MAP_SWIZZLE_128B`): in
/// shared memory each 16-byte chunk of a 128-byte line moves to chunk
/// `chunk ^ (line % 8)`, which spreads a column of rows over every bank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorMap {
    /// 0: the key stream, 1: the value stream.
    pub slot: u32,
    pub page_offset: u32,
    /// Bytes per item: a multiple of 128.
    pub row_bytes: u32,
    pub items_per_page: u32,
    pub page_bytes: u32,
    /// Items per box: a tile.
    pub box_items: u32,
}

/// The dynamic shared memory symbol of every kvcc module.
pub const SHARED_SYMBOL: &str = "kvcc_smem";

/// Bytes of one encoded tensor map (`CUtensorMap`).
pub const TENSOR_MAP_BYTES: u32 = 128;
/// Tensor maps in the `tensor_maps` buffer: the key's and the value's.
pub const TENSOR_MAP_SLOTS: u32 = 2;
/// Bytes of the lines the 128-byte swizzle permutes chunks within: the
/// tensor's innermost dimension.
pub const SWIZZLE_LINE: u32 = 128;

/// The slot of a stream's tensor map in the `tensor_maps` buffer.
pub fn tensor_map_slot(side: Side) -> u32 {
    side.pick(0, 1)
}

impl DecodeKernel {
    /// Dynamic shared memory per CTA, bytes (the same for every launch shape).
    pub fn dynamic_shared_bytes(&self) -> u32 {
        self.shared_bytes
    }

    /// Grid (splits, kv_heads, sequences): one CTA per (sequence, kv head, split).
    pub fn launch(&self, splits: u32, kv_heads: u32, sequences: u32) -> Launch {
        Launch {
            grid: [splits, kv_heads, sequences],
            block: [self.threads, 1, 1],
            shared_bytes: self.shared_bytes,
        }
    }
}

/// The merge kernel of a format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MergeKernel {
    pub name: String,
    pub threads: u32,
    /// Dynamic shared memory (bytes) of every launch.
    pub shared_bytes: u32,
    pub partials: PartialLayout,
}

impl MergeKernel {
    /// Grid (q_heads, sequences): one CTA per output row.
    pub fn launch(&self, q_heads: u32, sequences: u32) -> Launch {
        Launch {
            grid: [q_heads, sequences, 1],
            block: [self.threads, 1, 1],
            shared_bytes: self.shared_bytes,
        }
    }
}

/// First slot of each tier's launch when tier `t` runs `splits[t]` splits
/// (0 for a tier that is not launched); the total is `slot_count`.
pub fn slot_bases(splits: &[u32]) -> (Vec<u32>, u32) {
    let mut bases = Vec::with_capacity(splits.len());
    let mut next = 0;
    for &s in splits {
        bases.push(next);
        next += s;
    }
    (bases, next)
}

/// The `page_offsets` / `page_ids` arrays of tier `tier` from a cache's page
/// tables (`[sequence][kv_head]`, as in `page::CacheView`): each row keeps its
/// pages of that tier, in token order.
pub fn page_lists(page_tables: &[Vec<Vec<PageRef>>], tier: u32) -> (Vec<u32>, Vec<u32>) {
    let mut offsets = vec![0];
    let mut ids = Vec::new();
    for row in page_tables.iter().flatten() {
        ids.extend(row.iter().filter(|r| r.tier == tier).map(|r| r.page));
        offsets.push(ids.len() as u32);
    }
    (offsets, ids)
}

/// Parameters of every page-compress (encode) kernel, in order; [`EncodeArgs`]
/// holds values for them.
pub const ENCODE_PARAMS: [Param; 5] = [
    param(
        "dst_pool",
        ParamType::Pointer,
        "this tier's page pool: pages of `page_bytes` bytes back to back; each job writes every byte of its destination page",
    ),
    param(
        "src_pool",
        ParamType::Pointer,
        "the source pool: full pages of a dense exact tier, laid out as the kernel's `DenseSource`",
    ),
    param(
        "tables",
        ParamType::Pointer,
        "f32 tables of this tier, laid out as `TableBuffer` (the values the CPU encoder is given)",
    ),
    param(
        "jobs",
        ParamType::Pointer,
        "u32[3 * job_count]: job j is (source page, destination page, kv head) at jobs[3 * j ..]",
    ),
    param(
        "job_count",
        ParamType::U32,
        "jobs in the list (gridDim.x: one CTA per job)",
    ),
];

/// u32 words of one encode job: source page, destination page, kv head.
pub const ENCODE_JOB_WORDS: u32 = 3;

/// Argument values of an encode launch, field order = [`ENCODE_PARAMS`] order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EncodeArgs {
    pub dst_pool: u64,
    pub src_pool: u64,
    pub tables: u64,
    pub jobs: u64,
    pub job_count: u32,
}

/// Element type of a dense source stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceDtype {
    F16,
    Bf16,
}

/// Where the exact rows of a source page lie: a page of a dense tier (no
/// transform, one `dense` field of f16 or bf16 per side), `items` rows per
/// stream of `head_dim` elements each. Derived from that tier's layout by
/// [`DenseSource::of_layout`], so the runtime's pages and the kernels agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DenseSource {
    pub head_dim: u32,
    /// Rows per page (every source page is full).
    pub items: u32,
    /// Byte offset of the key stream in a page.
    pub key_offset: u32,
    /// Byte offset of the value stream in a page.
    pub value_offset: u32,
    /// Bytes from one key row to the next.
    pub key_stride: u32,
    /// Bytes from one value row to the next.
    pub value_stride: u32,
    /// Bytes per source page (the source pool's page stride).
    pub page_bytes: u32,
    pub dtype: SourceDtype,
}

impl DenseSource {
    /// The source description of a dense exact tier: both codecs without a
    /// transform and with one `dense` field of the same f16 or bf16 dtype;
    /// `None` for any other tier.
    pub fn of_layout(layout: &TierLayout) -> Option<DenseSource> {
        let dtype = |side: Side| {
            let codec = layout.codec(side);
            match (codec.transform, codec.fields.as_slice()) {
                (
                    TransformLayout::Identity,
                    [FieldLayout::Dense {
                        offset: 0, dtype, ..
                    }],
                ) => match dtype {
                    DenseDtype::F16 => Some(SourceDtype::F16),
                    DenseDtype::Bf16 => Some(SourceDtype::Bf16),
                    DenseDtype::F32 | DenseDtype::Fp8e4m3 | DenseDtype::Fp8e5m2 => None,
                },
                _ => None,
            }
        };
        let key = dtype(Side::Key)?;
        (dtype(Side::Value)? == key).then_some(DenseSource {
            head_dim: layout.head_dim,
            items: layout.items_per_page,
            key_offset: layout.key_stream_offset,
            value_offset: layout.value_stream_offset,
            key_stride: layout.key.stride,
            value_stride: layout.value.stride,
            page_bytes: layout.page_bytes,
            dtype: key,
        })
    }

    /// Byte offset and row stride of a side's stream.
    pub fn stream(&self, side: Side) -> (u32, u32) {
        side.pick(
            (self.key_offset, self.key_stride),
            (self.value_offset, self.value_stride),
        )
    }
}

/// A tier's page-compress kernel: one CTA per job of the job list turns the
/// `items` exact key and value rows of one source page (one sequence, one kv
/// head) and that head's tables into one page of the tier, header included
/// (`tier`, `count = items_per_page`, `flags = 0`, scales), byte-identical
/// to the CPU encoder's page of the same rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodeKernel {
    /// Entry name in the tier's encode module.
    pub name: String,
    pub tier: u32,
    pub threads: u32,
    /// Dynamic shared memory (bytes) of every launch.
    pub shared_bytes: u32,
    /// Bytes per page of the destination pool.
    pub page_bytes: u32,
    pub items_per_page: u32,
    /// Items transformed and packed at once (all of a page when they fit the
    /// shared memory; otherwise a multiple of 16, and the transform is done
    /// twice where the page has header scales).
    pub chunk_items: u32,
    pub tables: TableBuffer,
    pub source: DenseSource,
}

impl EncodeKernel {
    /// Grid (jobs): one CTA per job.
    pub fn launch(&self, jobs: u32) -> Launch {
        Launch {
            grid: [jobs, 1, 1],
            block: [self.threads, 1, 1],
            shared_bytes: self.shared_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_lists_split_rows_by_tier() {
        let r = |tier, page| PageRef { tier, page };
        let tables = vec![
            vec![vec![r(0, 0), r(1, 0), r(0, 1)], vec![r(1, 1)]],
            vec![vec![], vec![r(0, 2)]],
        ];
        assert_eq!(page_lists(&tables, 0), (vec![0, 2, 2, 2, 3], vec![0, 1, 2]));
        assert_eq!(page_lists(&tables, 1), (vec![0, 1, 2, 2, 2], vec![0, 1]));
        assert_eq!(slot_bases(&[2, 0, 3]), (vec![0, 2, 2], 5));
    }

    #[test]
    fn records_are_16_byte_aligned() {
        for d in [8, 16, 100, 128, 1024] {
            let p = PartialLayout::new(d);
            assert_eq!(p.record % 4, 0);
            assert!(p.record >= d + 2);
            assert_eq!(
                p.record_index(1, 2, 3, 4, 5),
                (((4 + 2) * 5) + 3) * p.record as usize
            );
        }
    }
}
