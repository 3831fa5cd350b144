//! Which tiers the tensor cores serve, and the fragment geometry they share
//! with the decode kernel's tensor-core phases (`kernel/score_mma.rs`,
//! `kernel/accumulate_mma.rs`; docs/ptx-backend.md, Tensor cores).
//!
//! A tier qualifies when its key score is a dot product of one query array
//! with the key item's elements — f16 values or 2/4/8-bit integers,
//! optionally times a per-element page-header scale, plus a page-header zero
//! point (unsigned codes) — and its value channel `c` is the
//! value item's element `c`, optionally times one f16 scale per item. Such
//! elements are exact f16 numbers, so they are `mma.sync` operands (f16 as
//! stored; integers through two or three bit operations). The header scales
//! fold into the query and the item scales into the softmax weights; those
//! f32 operands enter as two f16 parts, `x = hi + lo` to about 2⁻²²
//! relative, so every product is exact and the sums are f32: the
//! interpreter's results within the backends' tolerance, at a fraction of
//! the per-thread fma chains' instructions. Integer keys score on the
//! integer tensor cores instead (`m16n8k32`): 8-bit codes as
//! stored, 4- and 2-bit codes as 16 or 64 times the code by one or two bit
//! operations, and the query as a 24-bit integer of three signed bytes; the
//! s32 sums are exact. Zero points add `Σ query · zero` per head and page.
//!
//! Bitmap fields of f16 groups (MosaicKV) qualify too: their elements are
//! stored f16 numbers, but at data-dependent places (a group's slot is the
//! popcount of the mask below it). Each warp expands its tokens' rows once
//! per tile into dense f16 rows in shared memory, one lane per row walking
//! the mask's set bits, and the fragments read those rows as they read
//! dense f16 items (`kernel/expand.rs`). Groups of whole
//! words skip the dense rows: each fragment register is one packed word,
//! loaded from the tile's items at its rank (`kernel/gather.rs`). These fields are recognised from the layout the
//! programs were lowered against: their IR spells out the popcount prefixes
//! the expansion replaces.
//!
//! - `score_pattern`: the key scores that qualify (the IR patterns) and the
//!   bitmap bodies whose fragments are gathered;
//! - `value_pattern`: the value channels that qualify and where their codes sit;
//! - `lookup`: value codebooks looked up as f16 books;
//! - here: the fragment geometry of the score and the accumulate ([`plan`]).

use super::streams::{shared_stride, stride_align, Stream, CHUNK};
use crate::ir::{ArrayDecl, BinaryOp, Expr, Function, Handle, Input, Literal, Module, UnaryOp};
use crate::layout::{
    bitmap_elem_bits, round_up, CodecLayout, FieldLayout, SlotRole, TableLayout, TableStorage,
    TransformLayout,
};
use crate::spec::{BitmapElem, CodewordKind, Fp8};

mod lookup;
mod score_pattern;
#[cfg(test)]
mod tests;
mod value_pattern;

pub use lookup::*;
use score_pattern::*;
pub use value_pattern::*;

/// The key row chunk lane `quad` loads as its `c`-th is a lane part plus
/// this constant part: `quad` plus `4 · c`, or `spread` (swizzled rows)
/// `(quad & 1) + 4 · (quad >> 1)` plus `2 · (c & 1) + 8 · (c >> 1)` (the
/// lane part: `Fragments::lane_chunk_part` in `kernel/fragments.rs`). Spread, a load's two rows (lanes
/// 0 to 3 and 4 to 7 of a phase) cover one 128-byte line's chunks
/// {0, 1, 4, 5} or {2, 3, 6, 7}, which the swizzle of neighbouring rows (two
/// lines apart for 256-byte rows) maps onto each other's complement: no
/// bank conflict, where contiguous chunks would conflict twice.
pub fn lane_chunk(spread: bool, c: u32) -> u32 {
    match spread {
        false => ROW_LANES * c,
        true => 2 * (c & 1) + 8 * (c >> 1),
    }
}

/// Bytes of one line of shared memory's 32 banks.
const BANK_LINE: u32 = 128;

/// Bytes from a chunk of `elements` f32 elements to the next in a padded
/// row: its bytes and 16 more, so the four lanes of a fragment row, each
/// reading its chunk's 16-byte vector `v`, meet four different banks, and
/// a warp copying a row's vectors in order writes eight lanes' vectors
/// to eight different banks.
pub fn padded_chunk_bytes(elements: u32) -> u32 {
    4 * elements + CHUNK
}

/// Rows (tokens or channels) of one `m16n8k16` tile, and its reduction depth
/// (an integer `m16n8k32` step is two of them deep).
pub const TILE: u32 = 16;
/// Columns of one tile: (head, part) pairs, so [`TILE_HEADS`] heads per tile.
pub const COLUMNS: u32 = 8;
/// Heads of one column tile.
pub const TILE_HEADS: u32 = COLUMNS / 2;
/// Lanes sharing one fragment row (`lane % 4`), each loading its chunks of it.
pub const ROW_LANES: u32 = 4;
/// Lanes of a warp.
pub const WARP_LANES: u32 = 32;
/// Registers a lane holds for the whole stream on the tensor cores (its
/// accumulators and query fragments) at most: past this the tile's working
/// set spills (192, head_dim 256 with 8 query heads, spilled on sm_80), and
/// the tier takes the fma path instead.
const MAX_HELD_REGISTERS: u32 = 128;

/// How an item element enters the tensor cores: as an exact f16 (values,
/// f16 keys) or an 8-bit integer (integer keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Element {
    /// Stored f16 bits.
    Half,
    /// A `bits`-wide integer (2, 4 or 8), two's complement when `signed`.
    Int { bits: u32, signed: bool },
    /// An fp8 byte, widened to an exact f16 by `cvt.rn.f16x2.{e4m3,e5m2}x2`
    /// (sm_89+), two at a time: it then enters as [`Element::Half`] does.
    Fp8(Fp8),
}

impl Element {
    pub fn bits(self) -> u32 {
        match self {
            Element::Half => 16,
            Element::Int { bits, .. } => bits,
            Element::Fp8(_) => 8,
        }
    }

    /// Whether the element enters the `mma` as an f16 (stored or widened).
    pub fn is_half(self) -> bool {
        matches!(self, Element::Half | Element::Fp8(_))
    }
}

/// A bitmap field of f16 groups: group `j` is kept when bit `j` of the mask
/// is set, and its `group_size` elements are then the `min(rank, keep − 1)`-th
/// packed group, `rank` being the set bits below `j`; dropped groups are 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gather {
    pub mask_bit: u32,
    pub groups: u32,
    pub group_size: u32,
    pub keep: u32,
    pub elems_bit: u32,
}

impl Gather {
    /// Bytes of one group's elements.
    pub fn group_bytes(&self) -> u32 {
        2 * self.group_size
    }

    /// Bytes of a dense row's elements.
    pub fn dense_bytes(&self) -> u32 {
        self.groups * self.group_bytes()
    }

    /// 32-bit words of the mask.
    pub fn mask_words(&self) -> u32 {
        self.groups.div_ceil(32)
    }

    /// Whether a group's elements are copied as 32-bit words (else halves).
    pub fn word_copies(&self, item_stride: u32) -> bool {
        self.group_bytes().is_multiple_of(4)
            && self.elems_bit.is_multiple_of(32)
            && item_stride.is_multiple_of(4)
    }

    /// Fragment registers (f16 pairs) per group.
    pub fn group_registers(&self) -> u32 {
        self.group_bytes() / 4
    }

    /// Whether fragments can be gathered from the packed groups
    /// (`kernel/gather.rs`) when a lane holds `lane_pairs` f16 pairs of a
    /// row: groups of one or two whole words, whole groups per lane, in runs
    /// [`lane_runs`] takes.
    pub fn gathers_rows(&self, lane_pairs: u32, item_stride: u32) -> bool {
        let per_group = self.group_registers();
        self.word_copies(item_stride)
            && matches!(per_group, 1 | 2)
            && lane_pairs.is_multiple_of(per_group)
            && self.runs(lane_pairs).is_some()
    }

    /// [`lane_runs`] of a lane holding `lane_pairs` f16 pairs of a row that
    /// [`Self::gathers_rows`] admits.
    pub fn lane_runs(&self, lane_pairs: u32) -> (u32, u32) {
        self.runs(lane_pairs)
            .expect("the plan gathers only runs that fit (Gather::gathers_rows)")
    }

    fn runs(&self, lane_pairs: u32) -> Option<(u32, u32)> {
        lane_runs(lane_pairs / self.group_registers(), self.mask_words())
    }
}

/// Most groups of a gathered run: a byte of the words packing four runs.
pub const RUN_BITS: u32 = 8;

/// A lane's `lane_groups` groups of a row as `(runs, groups per run)`: one
/// run of a power of two up to `RUN_BITS` groups (inside one mask word, as
/// the lane's first group is a multiple of it), or up to four whole bytes of
/// a one- or two-word mask; `None` otherwise.
fn lane_runs(lane_groups: u32, mask_words: u32) -> Option<(u32, u32)> {
    match lane_groups {
        n if n.is_power_of_two() && n <= RUN_BITS => Some((1, n)),
        n if n.is_multiple_of(RUN_BITS) && n / RUN_BITS <= 4 && mask_words <= 2 => {
            Some((n / RUN_BITS, RUN_BITS))
        }
        _ => None,
    }
}

/// Where the fragments read one side's rows: the tile buffer's stream, or
/// the dense rows a gather expanded into the staging area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rows {
    /// Byte offset of row 0: in a tile buffer, or (`staged`) in shared memory.
    pub offset: u32,
    pub stride: u32,
    pub staged: bool,
    /// The rows' 16-byte chunks are swizzled ([`Stream::swizzled`]).
    pub swizzled: bool,
    /// The side's bitmap field: expanded into the staged rows each tile, or
    /// (rows not staged) gathered into the fragments.
    pub gather: Option<Gather>,
    /// The side's codebook field, whose codewords the fragment loads look
    /// up in the stream's codes.
    pub lookup: Option<Lookup>,
}

impl Rows {
    fn of(stream: &Stream) -> Rows {
        Rows {
            offset: stream.buffer_offset,
            stride: stream.shared_stride,
            staged: false,
            swizzled: stream.swizzled,
            gather: None,
            lookup: None,
        }
    }

    /// The stream's rows, whose groups the fragments gather in place: a
    /// group at a time, so unswizzled.
    fn gathered(stream: &Stream, gather: Gather) -> Rows {
        Rows {
            swizzled: false,
            gather: Some(gather),
            ..Rows::of(stream)
        }
    }

    /// Dense f16 rows of `dense_bytes` in the staging area, 16-byte aligned
    /// (zeroed and read 16 bytes at a time) and padded like a stream's rows;
    /// placed by the plan.
    fn dense(dense_bytes: u32) -> Rows {
        Rows {
            offset: 0,
            stride: shared_stride(round_up(dense_bytes, CHUNK)),
            staged: true,
            swizzled: false,
            gather: None,
            lookup: None,
        }
    }

    /// The dense f16 rows `gather` expands into.
    fn staged(gather: Gather) -> Rows {
        Rows {
            gather: Some(gather),
            ..Rows::dense(gather.dense_bytes())
        }
    }

    /// The stream's codes, whose codewords the fragment loads look up.
    fn looked_up(stream: &Stream, lookup: Lookup) -> Rows {
        Rows {
            swizzled: false,
            lookup: Some(lookup),
            ..Rows::of(stream)
        }
    }

    /// Whether the fragments read the stream's rows as stored.
    pub fn as_stored(&self) -> bool {
        !self.staged && self.gather.is_none() && self.lookup.is_none()
    }

    /// The bitmap whose groups the fragments gather.
    pub fn fragments(&self) -> Option<Gather> {
        self.gather.filter(|_| !self.staged)
    }

    /// The bitmap expanded into the staged rows.
    pub fn expanded(&self) -> Option<Gather> {
        self.gather.filter(|_| self.staged)
    }

    pub(crate) fn align(&self) -> u32 {
        stride_align(self.stride)
    }
}

/// Channels of `dims` each of a warp's 8 lane groups (fragment rows) holds:
/// two per 16-channel tile of the accumulate.
fn lane_group_channels(dims: u32) -> u32 {
    2 * (dims / TILE)
}

/// The tensor-core geometry of one tier's kernel: the accumulate, and the
/// score when the key qualifies too.
#[derive(Debug, Clone)]
pub struct MmaPlan {
    pub score: Option<MmaScore>,
    /// How a value row holds its channels.
    pub channel: Channel,
    pub value_dims: u32,
    /// The rows the fragments read, per side.
    pub key_rows: Rows,
    pub value_rows: Rows,
    /// Whether every lane group's value channels start 16-byte aligned in
    /// shared memory (else they are read as 32-bit words).
    pub value_aligned: bool,
    /// Column tiles: `ceil(2 · heads / 8)`.
    pub column_tiles: u32,
    /// Token tiles per tile of items.
    pub token_tiles: u32,
}

/// The score on the tensor cores: a dot product of `query` with the key
/// item's `dims` elements (times header slots `key_scale + i`).
#[derive(Debug, Clone)]
pub struct MmaScore {
    pub query: Handle<ArrayDecl>,
    pub key: Element,
    pub key_scale: Option<u32>,
    /// Zero points (asymmetric codes): element `i` is `code · scale + zero`
    /// with the zero in header slot `key_zero + i` ([`affine_element`]); the
    /// score is then the codes' dot product plus `Σ query · zero` per head.
    pub key_zero: Option<u32>,
    /// A per-head term added to the score, element 0 of this shared array
    /// (a PCA key's query times the mean, from the key prologue).
    pub key_bias: Option<Handle<ArrayDecl>>,
    pub key_dims: u32,
    /// Key fragments gathered from a bitmap's groups: the runs of groups a
    /// lane holds ([`lane_runs`]), its chunks, every fourth run of the row
    /// ([`MmaScore::chunk_elements`]); `None`: rows loaded whole.
    pub gathered_runs: Option<u32>,
}

impl MmaPlan {
    /// Bytes of the staged rows of a tile of `items` items (0 without gathers).
    pub fn staging_bytes(&self, items: u32) -> u32 {
        let side = |rows: &Rows| if rows.staged { items * rows.stride } else { 0 };
        side(&self.key_rows) + side(&self.value_rows)
    }

    /// Places the staged rows at `offset` in shared memory: key rows first.
    pub fn place_staging(&mut self, offset: u32, items: u32) {
        let mut at = offset;
        for rows in [&mut self.key_rows, &mut self.value_rows] {
            if rows.staged {
                rows.offset = at;
                at += items * rows.stride;
            }
        }
    }

    /// Registers a lane holds for the whole stream: per column tile, its
    /// accumulators (4 per channel tile), query fragments and (zero points)
    /// the page's score bias.
    pub fn held_registers(&self) -> u32 {
        let queries = (self.score.as_ref()).map_or(0, |s| {
            s.query_tiles() * s.key_registers() + u32::from(s.biased())
        });
        // Page-scaled values sum a tile apart first.
        let tile_sums = match self.channel.page_scale {
            Some(_) => 4 * self.channel_tiles(),
            None => 0,
        };
        self.column_tiles * (4 * self.channel_tiles() + tile_sums + self.zero_sums() + queries)
    }

    /// Whether integer value codes enter the `mma` as f16 subnormals: the
    /// code's bits as stored, at [`subnormal_shift`], are `code · 2^(shift −
    /// 24)` by one `and`, and each accumulator takes `2^(24 − shift)` once,
    /// at the store. Unsigned codes only: signed ones would carry an offset
    /// times the weights' sum (H200: KIVI int4 unchanged, int8 1–2 % faster,
    /// at twice the rounding error); page-scaled values meet their scales
    /// every tile. The others take `1024 + code`.
    pub fn subnormal_codes(&self) -> bool {
        matches!(self.channel.element, Element::Int { signed: false, .. })
            && self.channel.page_scale.is_none()
            && self.value_rows.gather.is_none()
            && self.value_rows.lookup.is_none()
    }

    /// Byte offset of value channel 0 in a value row.
    pub fn value_offset(&self) -> u32 {
        self.channel.base / 8
    }

    /// Whether the weights take value scales (item or group ones) and σ.
    pub fn scaled_values(&self) -> bool {
        self.channel.scale.is_some() || self.channel.groups.is_some()
    }

    /// Value groups ([`ValueGroups`]; one without).
    pub fn value_groups(&self) -> u32 {
        self.value_dims / self.group_size()
    }

    /// Channels of a value group: all of them without groups.
    pub fn group_size(&self) -> u32 {
        self.channel.groups.map_or(self.value_dims, |g| g.size)
    }

    /// Zero-point sums a lane holds per column tile: one per value group.
    pub fn zero_sums(&self) -> u32 {
        match self.channel.groups {
            Some(ValueGroups { zero: Some(_), .. }) => self.value_groups(),
            _ => 0,
        }
    }

    /// Channel tiles of the accumulate (16 channels each).
    pub fn channel_tiles(&self) -> u32 {
        self.value_dims / TILE
    }

    /// Output sums a lane holds after the stream: its lane group's channels
    /// of one head per column tile.
    pub fn lane_sums(&self) -> u32 {
        self.column_tiles * self.group_channels()
    }

    /// Bytes of one warp's output sums ([`Self::lane_sums`] floats a lane).
    pub fn warp_sums_bytes(&self) -> u32 {
        self.lane_sums() * WARP_LANES * 4
    }

    /// Value channels per lane group (`lane / 4`): 2 per channel tile. With
    /// value groups a lane group holds `2 · size / 16` channels of each
    /// group, consecutive: channel `c` of the lane group in row `r` is
    /// channel `size · (c / n) + n · r + c % n` of the row, `n` those per group
    /// (`kernel/accumulate_mma.rs` stores them so).
    pub fn group_channels(&self) -> u32 {
        lane_group_channels(self.value_dims)
    }

    /// 32-bit words of one token's channels of a lane group.
    pub fn group_words(&self) -> u32 {
        self.group_channels() * self.channel.element.bits() / 32
    }
}

impl MmaScore {
    /// Whether the score adds a per-head bias to the codes' dot product.
    pub fn biased(&self) -> bool {
        self.key_zero.is_some() || self.key_bias.is_some()
    }

    /// Whether each page's query preparation reads padded copies of the
    /// query and of the page's header scales
    /// ([`crate::back::ptx::plan::PageQueries`]): page-scaled keys whose
    /// lanes load whole chunks of a power-of-two number of elements, and
    /// whose f32 chunks, unpadded, start the four lanes of a fragment row on
    /// the same banks (32 or more elements: KIVI int4, kivi2 at batch 8 ×
    /// 32K on an H200, 1.02× and 1.10× faster; subspace's 8-element chunks
    /// do not conflict, and its copies cost it 1.5 %).
    pub fn padded_page_queries(&self) -> bool {
        let chunk = self.chunk_elements();
        self.key_scale.is_some()
            && self.gathered_runs.is_none()
            && chunk.is_power_of_two()
            && (4 * chunk).is_multiple_of(BANK_LINE)
            && self.key_dims.is_multiple_of(ROW_LANES * chunk)
    }

    /// Bytes from a chunk of a padded row to the next ([`padded_chunk_bytes`]).
    pub fn padded_chunk_bytes(&self) -> u32 {
        padded_chunk_bytes(self.chunk_elements())
    }

    /// Bytes of a padded row of `key_dims` elements.
    pub fn padded_row_bytes(&self) -> u32 {
        self.key_dims / self.chunk_elements() * self.padded_chunk_bytes()
    }

    /// Header rows a page's query preparation reads: scales, and zero points.
    pub fn header_rows(&self) -> u32 {
        1 + u32::from(self.key_zero.is_some())
    }

    /// Reduction steps of the score: `m16n8k16` steps of 16 f16 elements, or
    /// (integer keys) `m16n8k32` steps of 32 8-bit integers.
    pub fn key_steps(&self) -> u32 {
        // Each of a row's 4 lanes holds two registers of a step.
        self.key_dims / (ROW_LANES * 2 * self.register_elements())
    }

    /// Key elements in one fragment register: two f16, or four 8-bit
    /// integers (4- and 2-bit codes enter as 8-bit integers, 16 or 64 times
    /// the code).
    pub fn register_elements(&self) -> u32 {
        match self.key {
            Element::Half | Element::Fp8(_) => 2,
            Element::Int { .. } => 4,
        }
    }

    /// The f16 pairs of a key row each of its four lanes holds (gathered
    /// keys).
    pub fn lane_pairs(&self) -> u32 {
        self.key_dims / ROW_LANES / 2
    }

    /// Whether the key's codes straddle bytes (3-bit): a lane's chunk is then
    /// 12 bytes whose registers are transposed ([`triplet_register`]).
    pub fn straddling(&self) -> bool {
        !whole_bytes(self.key)
    }

    /// Bytes of a key row's elements.
    pub fn row_bytes(&self) -> u32 {
        self.key_dims * self.key.bits() / 8
    }

    /// Bytes of a lane's chunk of a key row loaded whole: 16, or 8 where the
    /// row's 4 lanes cannot each take whole 16-byte chunks (rows of 32 · odd
    /// bytes, as 2-bit codes of 128 dims), or 12 for 3-bit codes (32 of
    /// them, read as three words). Gathered rows count in 16-byte chunks
    /// (their lanes' chunks are runs of groups).
    pub fn chunk_bytes(&self) -> u32 {
        if self.straddling() {
            // 32 codes, each register of them taking one from each 24-bit quarter.
            return 4 * self.key.bits();
        }
        let whole = self.row_bytes().is_multiple_of(ROW_LANES * CHUNK);
        match whole || self.gathered_runs.is_some() {
            true => CHUNK,
            false => CHUNK / 2,
        }
    }

    /// Alignment a lane's chunk needs: loaded whole, or (12 bytes) as words.
    pub fn chunk_align(&self) -> u32 {
        match self.chunk_bytes() {
            c if c.is_power_of_two() => c,
            _ => 4,
        }
    }

    /// Key elements in one lane's chunk: [`Self::chunk_bytes`] of them, or
    /// (gathered) one run of groups, whose pairs are consecutive. A row's
    /// chunks go to its lanes in turn, so a gathering load's four lanes of a
    /// row read groups a quarter row apart: their ranks, and banks, lie
    /// closer than a lane's own quarter's ends (keys: 1.46 wavefronts per
    /// load where a quarter row per lane takes 1.55, as
    /// `benches/gpu/gather_banks.py` simulates).
    pub fn chunk_elements(&self) -> u32 {
        match self.gathered_runs {
            Some(runs) => self.key_dims / ROW_LANES / runs,
            None => 8 * self.chunk_bytes() / self.key.bits(),
        }
    }

    /// The chunks of a key row one lane loads (chunks `quad + 4 · c`, or
    /// spread: [`lane_chunk`]).
    pub fn lane_chunks(&self) -> u32 {
        self.key_dims / self.chunk_elements() / ROW_LANES
    }

    /// Whether the lanes' chunks can be spread: 16-byte chunks (the
    /// swizzle's unit), an even number per lane.
    pub fn spread_chunks(&self) -> bool {
        self.chunk_bytes() == CHUNK && self.lane_chunks().is_multiple_of(2)
    }

    /// B tiles of the queries per column tile: f16 keys take a query as two
    /// f16 parts in one, integer keys as three bytes in two.
    pub fn query_tiles(&self) -> u32 {
        match self.key {
            Element::Half | Element::Fp8(_) => 1,
            Element::Int { .. } => 2,
        }
    }

    /// Fragment registers a lane holds of a key row: two per reduction step.
    pub fn key_registers(&self) -> u32 {
        2 * self.key_steps()
    }

    /// Key element of part `e` of the `r`-th fragment register a lane with
    /// `quad == 0` holds of a key row (lane `quad` holds the element
    /// `chunk_elements · quad` further). The registers are the words of the
    /// lane's chunks in order (f16: halves; 8-bit: bytes), but a word of
    /// `n` codes a byte gives `n`: code `j` of each of its bytes in the
    /// `j`-th (element `4 · byte + j` of the word at bit `bits · j` of its
    /// byte). 3-bit codes straddle bytes: byte `e` of the chunk's `j`-th
    /// register is code `j` of the chunk's `e`-th 24 bits
    /// ([`triplet_register`]). Register `2 · s` is the lane's `a0` of
    /// reduction step `s`, `2 · s + 1` its `a2`.
    pub fn key_element(&self, r: u32, e: u32) -> u32 {
        let per_chunk = self.chunk_elements() / self.register_elements();
        let (c, x) = (r / per_chunk, r % per_chunk);
        let within = match self.key {
            Element::Int { .. } if self.straddling() => per_chunk * e + x,
            Element::Int { bits, .. } => {
                let n = 8 / bits;
                4 * n * (x / n) + n * e + x % n
            }
            _ => self.register_elements() * x + e,
        };
        ROW_LANES * self.chunk_elements() * c + within
    }
}

/// The tensor-core plan when `module`'s values qualify, with the score when
/// its key does too; tiles are whole token tiles. `fp8`: the target widens
/// fp8 pairs to f16 in one instruction (else fp8 elements do not qualify).
pub fn plan(
    module: &Module,
    group_max: u32,
    tile_items: u32,
    key: &Stream,
    value: &Stream,
    fp8: bool,
) -> Option<MmaPlan> {
    let allowed = |e: Element| fp8 || !matches!(e, Element::Fp8(_));
    let value_dims = module.value.dims;
    // Expanded, gathered and looked-up rows hold each channel as an f16.
    let half = Channel {
        element: Element::Half,
        base: 0,
        scale: None,
        groups: None,
        page_scale: None,
    };
    let codec = &module.layout.value;
    let (channel, value_rows) = match gather(codec, value_dims, value) {
        Some(g) => (
            half,
            match g.gathers_rows(value_dims / TILE, value.shared_stride) {
                true => Rows::gathered(value, g),
                false => Rows::staged(g),
            },
        ),
        None => match lookup(codec, &module.layout.tables, value_dims, value) {
            Some(l) => (half, Rows::looked_up(value, l)),
            None => (
                (scaled_channel(&module.value.accumulate))
                    .or_else(|| grouped_channel(&module.value.accumulate, value_dims))
                    .filter(|c| allowed(c.element))?,
                Rows::of(value),
            ),
        },
    };
    let group_bits = 2 * value_dims / TILE * channel.element.bits();
    let value_offset = channel.base / 8;
    let fits = tile_items.is_multiple_of(TILE)
        && value_dims.is_multiple_of(TILE)
        && match channel.groups {
            Some(groups) => groups.fits(channel.element, value_dims, channel.base, value),
            // A lane group's channels are whole words at a whole byte.
            None => {
            group_bits.is_multiple_of(32)
                && channel.base.is_multiple_of(8)
                && whole_bytes(channel.element)
        }
        }
        // Item scales are read as halfwords.
        && channel
            .scale
            .is_none_or(|bit| bit.is_multiple_of(16) && value.shared_stride.is_multiple_of(2));
    let group_bytes = group_bits / 8;
    // Rows read in chunks must be aligned to them; gathered fragments are
    // read a group at a time.
    let fits_rows = |score: &MmaScore, rows: &Rows, chunks: bool| {
        let chunk = score.chunk_bytes();
        score.key_dims.is_multiple_of(TILE)
            // A key row is whole chunks over the 4 lanes of a fragment row.
            && score.row_bytes().is_multiple_of(chunk * ROW_LANES)
            && (!chunks || rows.align() >= score.chunk_align())
            // Header scales and zero points are read 4 at a time.
            && [score.key_scale, score.key_zero]
                .iter()
                .all(|slot| slot.is_none_or(|slot| slot.is_multiple_of(4)))
    };
    let gathered = gathered_score(module, key)
        .map(
            |(score, g)| match g.gathers_rows(score.lane_pairs(), key.shared_stride) {
                // One chunk per run of the lane's groups.
                true => (
                    MmaScore {
                        gathered_runs: Some(g.lane_runs(score.lane_pairs()).0),
                        ..score
                    },
                    Rows::gathered(key, g),
                ),
                false => (score, Rows::staged(g)),
            },
        )
        .filter(|(score, rows)| fits_rows(score, rows, rows.staged));
    let (score, key_rows) = match gathered {
        Some((score, rows)) => (Some(score), rows),
        None => {
            let rows = Rows::of(key);
            let score = dot_product(&module.key.score)
                .filter(|s| allowed(s.key) && fits_rows(s, &rows, true));
            (score, rows)
        }
    };
    let plan = fits.then(|| MmaPlan {
        channel,
        value_dims,
        key_rows,
        value_rows,
        score,
        value_aligned: value_rows.align() == CHUNK
            && channel.groups.is_none()
            && value_offset.is_multiple_of(CHUNK)
            && group_bytes.is_multiple_of(CHUNK),
        column_tiles: (2 * group_max).div_ceil(COLUMNS),
        token_tiles: tile_items / TILE,
    });
    // Grouped values take their weights from the score's C fragments
    // (`kernel/warp_tile.rs`), whose lanes hold the heads their zero sums need.
    plan.filter(|m| m.held_registers() <= MAX_HELD_REGISTERS)
        .filter(|m| m.channel.groups.is_none() || m.score.is_some())
}

/// How fragment register `j` of a word of `bits`-bit codes (`8 / bits` a
/// byte) is made: `(word << shift) & mask` leaves code `j` of each byte in
/// the byte's top bits, 2^(8 − bits) times the code ([`MmaScore::key_element`]).
pub fn code_register(bits: u32, j: u32) -> (u32, u32) {
    let top_bits = 0xFF & (0xFF << (8 - bits));
    (8 - bits * (j + 1), 0x0101_0101 * top_bits)
}

/// The `prmt` selectors that transpose a 12-byte chunk of 3-bit codes
/// (words `w0, w1, w2`) into three words, byte `e` of the `b`-th being
/// chunk byte `3e + b`: `prmt(prmt(w0, w1, first), w2, second)`.
pub const TRIPLET_SELECTORS: [(u32, u32); 3] =
    [(0x0630, 0x5210), (0x0741, 0x6210), (0x0052, 0x7410)];

/// How fragment register `j` of a 12-byte chunk of 3-bit codes is made from
/// the chunk's transposed words ([`TRIPLET_SELECTORS`]): the OR of its
/// parts `(word b << shift) & mask` (a negative shift to the right), which
/// leave code `j` of each 24-bit quarter in its byte's top bits, 32 times
/// the code ([`MmaScore::key_element`]).
pub fn triplet_register(j: u32) -> Vec<(usize, i32, u32)> {
    let (first, last) = (3 * j, 3 * j + 2);
    (first / 8..=last / 8)
        .map(|b| {
            // Code bit i sits at bit 3j + i − 8b of byte b and goes to bit 5 + i.
            let shift = 5 + 8 * b as i32 - first as i32;
            let bits = (0..3u32)
                .filter(|i| (first + i) / 8 == b)
                .fold(0, |m, i| m | 1 << (5 + i));
            (b as usize, shift, 0x0101_0101 * bits)
        })
        .collect()
}
