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

use super::streams::{shared_stride, stride_align, Stream, CHUNK};
use crate::ir::{ArrayDecl, BinaryOp, Expr, Function, Handle, Input, Literal, Module, UnaryOp};
use crate::layout::{
    bitmap_elem_bits, round_up, CodecLayout, FieldLayout, SlotRole, TableLayout, TableStorage,
    TransformLayout,
};
use crate::spec::{BitmapElem, CodewordKind, Fp8};

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

/// A codebook field of vector codewords (vector quantization, as Shard's
/// values): channel `c` is element `c % group_size` of the codeword group
/// `c / group_size`'s `bits`-bit code picks from its book. The books are
/// stored f16 ([`TableStorage::F16`]), so every channel is an exact f16: the
/// prologue stages the books as f16, and where dense values would load a
/// lane group's channels of a token, the lane loads that token's codes of
/// them and looks their codewords up (`kernel/lookup.rs`). A lane group's
/// channels are whole codewords or part of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// Bit offset of group 0's code in an item.
    pub code_bit: u32,
    pub groups: u32,
    pub group_size: u32,
    pub bits: u32,
    /// Channels of a lane group ([`MmaPlan::group_channels`]).
    pub lane_channels: u32,
    /// The codebook (index in the module's tables).
    pub table: usize,
    /// Elements between consecutive groups' books: 0 for one shared book.
    pub book_stride: u32,
    /// Elements of the books (the table's length).
    pub book_len: u32,
    /// Byte offset in shared memory of the books as f16, placed by the plan.
    pub book: u32,
    /// Copies of each codeword side by side ([`Lookup::bank_copies`]), lane
    /// `l` reading copy `l % copies`; 1 without copies.
    pub copies: u32,
}

impl Lookup {
    /// Codes of a lane group's channels: 1 where they are part of one codeword.
    pub fn lane_codes(&self) -> u32 {
        (self.lane_channels / self.group_size).max(1)
    }

    /// Lane groups whose channels one codeword holds: `8 / groups` where a
    /// codeword spans lane groups, so a power of two.
    pub fn code_lanes(&self) -> u32 {
        (self.group_size / self.lane_channels).max(1)
    }

    /// Bits of a lane group's codes, consecutive in the item.
    pub fn lane_code_bits(&self) -> u32 {
        self.lane_codes() * self.bits
    }

    /// Bytes of a codeword a lane group reads: all of it, or its channels'.
    pub fn read_bytes(&self) -> u32 {
        2 * self.group_size.min(self.lane_channels)
    }

    /// Bytes of one f16 codeword.
    pub fn codeword_bytes(&self) -> u32 {
        2 * self.group_size
    }

    /// Bytes of the f16 books in shared memory, with their copies.
    pub fn book_bytes(&self) -> u32 {
        round_up(2 * self.book_len * self.copies, CHUNK)
    }

    /// Copies of each codeword, side by side, that spread a shared-memory
    /// phase's lookups over the banks: one for each lane of a phase (128
    /// bytes of codewords) makes them conflict-free whatever the codes,
    /// fewer leave lanes `copies` apart on the same banks half the time.
    /// Codewords of 4, 8 or 16 bytes (an `ld.shared` each): the most copies,
    /// a power of two, that fit [`BANK_COPIES_BYTES`]; else 1. Shard on an
    /// H200 (batch 8 × 32K): 16 copies 0.1166 ms at 2 CTAs per SM, 8 copies
    /// 0.1214 at 3, one 0.1363: the shared-memory pipe binds, not occupancy.
    pub fn bank_copies(&self) -> u32 {
        let bytes = self.codeword_bytes();
        if !matches!(bytes, 4 | 8 | 16) {
            return 1;
        }
        let fitting = BANK_COPIES_BYTES / (2 * self.book_len);
        match fitting {
            0 => 1,
            n => (128 / bytes).min(1 << n.ilog2()),
        }
    }
}

/// Shared memory the copies of looked-up books may take ([`Lookup::bank_copies`]).
pub const BANK_COPIES_BYTES: u32 = 32 * 1024;

/// The value codec's body when it is a lone codebook of vector codewords
/// stored f16 covering its `dims`, whose codes a lane group can take in
/// whole words: each lane group's channels whole codewords (or part of one)
/// and its codes a power-of-two part of a 32-bit word or whole words, the
/// codes starting at a word-aligned place in the tile buffer; codewords
/// (or the parts read) of whole words.
fn lookup(
    codec: &CodecLayout,
    tables: &[TableLayout],
    dims: u32,
    stream: &Stream,
) -> Option<Lookup> {
    let [ref field @ FieldLayout::Codebook {
        groups,
        group_size,
        bits,
        codewords: CodewordKind::Vector,
        per_group,
        table,
        ..
    }] = codec.fields[..]
    else {
        return None;
    };
    let book = tables.get(table)?;
    let [code] = codec.slots[..] else {
        return None;
    };
    let lane_channels = lane_group_channels(dims);
    if lane_channels == 0 {
        return None;
    }
    let l = Lookup {
        code_bit: code.bits.offset,
        groups,
        group_size,
        bits,
        lane_channels,
        table,
        book_stride: match per_group {
            true => field.book_len(),
            false => 0,
        },
        book_len: book.len,
        book: 0,
        copies: 1,
    };
    let lane_bits = l.lane_code_bits();
    let fits = code.role == SlotRole::CodebookIndex
        && book.storage == TableStorage::F16
        && groups * group_size == dims
        && bits <= 16
        && 32 % bits == 0
        && (lane_channels.is_multiple_of(group_size) || group_size.is_multiple_of(lane_channels))
        && l.read_bytes().is_multiple_of(4)
        && match lane_bits {
            1..=32 => 32 % lane_bits == 0,
            _ => lane_bits.is_multiple_of(32),
        }
        && l.code_bit.is_multiple_of(32)
        && stream.shared_stride.is_multiple_of(4)
        && stride_align(stream.buffer_offset + l.code_bit / 8) >= 4;
    fits.then_some(l)
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

/// Whether a byte holds whole elements: integers of 2, 4 or 8 bits (3-bit
/// codes straddle bytes: [`triplet_register`]).
fn whole_bytes(element: Element) -> bool {
    match element {
        Element::Int { bits, .. } => 8 % bits == 0 && bits >= 2,
        Element::Half | Element::Fp8(_) => true,
    }
}

/// The codec's body when it is a bitmap of f16 groups covering its `dims`,
/// alone, with masks and groups the expansion reads as words or halves. The
/// bit positions are the item schema's: a mask slot, then the kept f16
/// elements, and no item scale.
fn gather(codec: &CodecLayout, dims: u32, stream: &Stream) -> Option<Gather> {
    let [FieldLayout::Bitmap {
        groups,
        group_size,
        keep,
        ..
    }] = codec.fields[..]
    else {
        return None;
    };
    let [mask, elems] = codec.slots[..] else {
        return None;
    };
    let half = bitmap_elem_bits(BitmapElem::F16);
    if mask.role != SlotRole::MaskBit
        || elems.role != SlotRole::BitmapElement
        || elems.bits.width != half
    {
        return None;
    }
    let g = Gather {
        mask_bit: mask.bits.offset,
        groups,
        group_size,
        keep,
        elems_bit: elems.bits.offset,
    };
    let aligned = g.mask_bit.is_multiple_of(32)
        && stream.shared_stride.is_multiple_of(4)
        && (g.word_copies(stream.shared_stride)
            || (g.elems_bit.is_multiple_of(16) && stream.shared_stride.is_multiple_of(2)));
    (groups * group_size == dims && keep > 0 && aligned).then_some(g)
}

/// A key score over a gathered bitmap: the query array it reads (a PCA's
/// bias term would add to it, so PCA keys stay on their path).
fn gathered_score(module: &Module, key: &Stream) -> Option<(MmaScore, Gather)> {
    let codec = &module.layout.key;
    if matches!(codec.transform, TransformLayout::Pca { .. }) {
        return None;
    }
    let g = gather(codec, codec.dims, key)?;
    let mut arrays = module.key.score.exprs.iter().filter_map(|(_, e)| match *e {
        Expr::Shared { array, .. } => Some(array),
        _ => None,
    });
    let query = arrays.next()?;
    arrays.all(|a| a == query).then_some((
        MmaScore {
            query,
            key: Element::Half,
            key_scale: None,
            key_zero: None,
            key_bias: None,
            key_dims: codec.dims,
            gathered_runs: None,
        },
        g,
    ))
}

/// The score as a chain of fmas from 0.0 whose term `i` multiplies query
/// element `i` with the key element at bit `bits · i` (times header slot
/// `slot0 + i`, plus header slot `zero0 + i`), every element once.
fn dot_product(f: &Function) -> Option<MmaScore> {
    let exprs = &f.exprs;
    let mut cur = f.result?;
    // `chain + bias[0]`: a per-head term.
    let mut key_bias = None;
    if let Expr::Binary {
        op: BinaryOp::Add,
        left,
        right,
    } = *exprs.try_get(cur)?
    {
        let bias = |h: Handle<Expr>| match shared_read(f, h)? {
            (array, 0) => Some(array),
            _ => None,
        };
        let (chain, array) =
            (bias(right).map(|a| (left, a))).or_else(|| bias(left).map(|a| (right, a)))?;
        cur = chain;
        key_bias = Some(array);
    }
    type Shape = (Handle<ArrayDecl>, Element, Option<u32>, Option<u32>);
    let mut shape: Option<Shape> = None;
    let mut seen = Vec::new();
    let term = |h: Handle<Expr>| {
        (scaled_element(f, h).map(|(e, bit, slot)| (e, bit, slot, None)))
            .or_else(|| affine_element(f, h).map(|(e, bit, s, z)| (e, bit, Some(s), Some(z))))
    };
    loop {
        match *exprs.try_get(cur)? {
            Expr::Fma { a, b, c } => {
                let ((element, bit, slot, zero), (array, index)) =
                    term(a)
                        .zip(shared_read(f, b))
                        .or_else(|| term(b).zip(shared_read(f, a)))?;
                let first = |slot: Option<u32>| match slot {
                    Some(slot) => slot.checked_sub(index).map(Some),
                    None => Some(None),
                };
                let this = (array, element, first(slot)?, first(zero)?);
                if bit != element.bits() * index || *shape.get_or_insert(this) != this {
                    return None;
                }
                seen.push(index);
                cur = c;
            }
            Expr::Literal(Literal::F32(0.0)) => break,
            _ => return None,
        }
    }
    let (query, element, scale, zero) = shape?;
    let dims = seen.len() as u32;
    seen.sort_unstable();
    (seen.iter().copied().eq(0..dims)).then_some(MmaScore {
        query,
        key: element,
        key_scale: scale,
        key_zero: zero,
        key_bias,
        key_dims: dims,
        gathered_runs: None,
    })
}

/// An element at a constant bit, alone or times a constant header slot.
fn scaled_element(f: &Function, h: Handle<Expr>) -> Option<(Element, u32, Option<u32>)> {
    if let Some((element, bit)) = element_at(f, h) {
        return literal(f, bit).map(|bit| (element, bit, None));
    }
    let (x, y) = multiplied(f, h)?;
    let scaled = |e: Handle<Expr>, s: Handle<Expr>| {
        let (element, bit) = element_at(f, e)?;
        match *f.exprs.try_get(s)? {
            Expr::HeaderScale { slot } => {
                Some((element, literal(f, bit)?, Some(literal(f, slot)?)))
            }
            _ => None,
        }
    };
    scaled(x, y).or_else(|| scaled(y, x))
}

/// `fma(float(item_bits(o, w)), header_scale(s), header_scale(z))`, an
/// unsigned `w`-bit code (2 to 8 bits) with its page's scale and zero point:
/// the code, `o`, `s` and `z`.
fn affine_element(f: &Function, h: Handle<Expr>) -> Option<(Element, u32, u32, u32)> {
    let Expr::Fma { a, b, c } = *f.exprs.try_get(h)? else {
        return None;
    };
    let Expr::Unary {
        op: UnaryOp::ToFloat,
        arg,
    } = *f.exprs.try_get(a)?
    else {
        return None;
    };
    let Expr::ItemBits { bit_offset, width } = *f.exprs.try_get(arg)? else {
        return None;
    };
    let slot = |h: Handle<Expr>| match *f.exprs.try_get(h)? {
        Expr::HeaderScale { slot } => literal(f, slot),
        _ => None,
    };
    let bits = u32::from(width);
    (2..=8).contains(&bits).then_some(())?;
    Some((
        Element::Int {
            bits,
            signed: false,
        },
        literal(f, bit_offset)?,
        slot(b)?,
        slot(c)?,
    ))
}

/// `half(item_bits(o, 16))`, `float(sign_extend(item_bits(o, w)))` for w
/// in {4, 8}, or `float(item_bits(o, w))` for w in {2, 3, 4, 8}: the
/// element and `o`.
fn element_at(f: &Function, h: Handle<Expr>) -> Option<(Element, Handle<Expr>)> {
    let Expr::Unary { op, arg } = *f.exprs.try_get(h)? else {
        return None;
    };
    let bits = |h: Handle<Expr>| match *f.exprs.try_get(h)? {
        Expr::ItemBits { bit_offset, width } => Some((bit_offset, u32::from(width))),
        _ => None,
    };
    match op {
        UnaryOp::HalfToFloat => match bits(arg)? {
            (offset, 16) => Some((Element::Half, offset)),
            _ => None,
        },
        UnaryOp::Fp8ToFloat(format) => match bits(arg)? {
            (offset, 8) => Some((Element::Fp8(format), offset)),
            _ => None,
        },
        UnaryOp::ToFloat => {
            let (inner, signed) = match *f.exprs.try_get(arg)? {
                Expr::Unary {
                    op: UnaryOp::SignExtend(n),
                    arg,
                } => (arg, Some(u32::from(n))),
                _ => (arg, None),
            };
            let (offset, width) = bits(inner)?;
            // Unsigned 2- and 3-bit codes come with zero points (KIVI-2).
            let ok = match signed {
                Some(n) => matches!(width, 4 | 8) && n == width,
                None => matches!(width, 2 | 3 | 4 | 8),
            };
            ok.then_some((
                Element::Int {
                    bits: width,
                    signed: signed.is_some(),
                },
                offset,
            ))
        }
        _ => None,
    }
}

/// The operands of an f32 multiplication.
fn multiplied(f: &Function, h: Handle<Expr>) -> Option<(Handle<Expr>, Handle<Expr>)> {
    match *f.exprs.try_get(h)? {
        Expr::Binary {
            op: BinaryOp::Multiply,
            left,
            right,
        } => Some((left, right)),
        _ => None,
    }
}

/// `array[index]` at a constant index.
fn shared_read(f: &Function, h: Handle<Expr>) -> Option<(Handle<ArrayDecl>, u32)> {
    match *f.exprs.try_get(h)? {
        Expr::Shared { array, index } => Some((array, literal(f, index)?)),
        _ => None,
    }
}

fn literal(f: &Function, h: Handle<Expr>) -> Option<u32> {
    match *f.exprs.try_get(h)? {
        Expr::Literal(Literal::U32(v)) => Some(v),
        _ => None,
    }
}

/// A value channel `element(base + bits · channel)`, alone or times the
/// item's f16 scale.
#[derive(Debug, Clone, Copy)]
pub struct Channel {
    pub element: Element,
    /// Bit offset of channel 0 in a value row.
    pub base: u32,
    /// Bit offset of the value item's f16 scale.
    pub scale: Option<u32>,
    /// Per-group f16 scales (and zero points) in the item.
    pub groups: Option<ValueGroups>,
    /// Header slot of channel 0's page scale (channel `c`'s is `c` slots
    /// further): a tile's products sum apart, then take the scales.
    pub page_scale: Option<u32>,
}

/// Value channels in groups of `size`, each with its item's f16 scale and,
/// optionally, zero point: channel `c` is `code(c) · scale[c / size] +
/// zero[c / size]`, the groups' halves consecutive from bits `scale` and
/// `zero`. Weights times a group's scales are that group's B fragments
/// (its channel tiles lie inside it), and the zero points enter as one f32
/// sum per (head, group) of weights times zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValueGroups {
    pub size: u32,
    pub scale: u32,
    pub zero: Option<u32>,
}

impl ValueGroups {
    /// Bits of a lane group's codes of one value group: `2 · size / 16`
    /// codes ([`MmaPlan::group_channels`] per group), consecutive.
    pub fn lane_bits(&self, element: Element) -> u32 {
        self.size * element.bits() / 8
    }

    /// Bytes of a lane group's codes of one value group (whole ones unless
    /// [`Self::windowed`]).
    pub fn lane_bytes(&self, element: Element) -> u32 {
        self.lane_bits(element) / 8
    }

    /// Whether a lane group's codes of a group are read as a 32-bit window
    /// at any bit (funnel-shifted from the one or two words holding them),
    /// where they are not one or two bytes of a word or whole words: 3-bit
    /// codes, whose lane groups start at every half byte.
    pub fn windowed(&self, element: Element) -> bool {
        let (bits, bytes) = (self.lane_bits(element), self.lane_bytes(element));
        !(bits.is_multiple_of(8) && (matches!(bytes, 1 | 2) || (bytes > 0 && bytes % 4 == 0)))
    }

    /// Whether the kernels take these groups: integer codes in whole
    /// channel tiles per group, groups in whole words from a word boundary
    /// of the row, a lane group's codes of a group one or two bytes of a
    /// word, whole words, or (windowed) at most 24 bits, so each code lies
    /// in the window's first three bytes; and the halves read as aligned
    /// pairs.
    fn fits(&self, element: Element, dims: u32, base: u32, rows: &Stream) -> bool {
        // Read as aligned pairs of halves, or one.
        let halves = |bit: u32| match dims / self.size {
            1 => bit.is_multiple_of(16),
            groups => bit.is_multiple_of(32) && groups.is_multiple_of(2),
        };
        matches!(
            element,
            Element::Int {
                bits: 2 | 3 | 4 | 8,
                ..
            }
        ) && self.size.is_multiple_of(TILE)
            && dims.is_multiple_of(self.size)
            && (!self.windowed(element) || self.lane_bits(element) <= 24)
            && (self.size * element.bits()).is_multiple_of(32)
            && base.is_multiple_of(32)
            && rows.shared_stride.is_multiple_of(4)
            && halves(self.scale)
            && self.zero.is_none_or(halves)
    }
}

/// How channel `c` of a windowed lane group's `bits`-bit codes
/// ([`ValueGroups::windowed`]) becomes two tokens' f16 pair: the `prmt`
/// selector that takes bytes `b, b + 1` of the two tokens' windows into the
/// low and high halves, and the code's shift in each half (at most 7, so
/// shift + bits stays inside f16's 10-bit mantissa).
pub fn window_channel(c: u32, bits: u32) -> (u32, u32) {
    let bit = c * bits;
    let b = bit / 8;
    (
        b | (b + 1) << 4 | (4 + b) << 8 | (5 + b) << 12,
        code_shift(c, bits),
    )
}

/// The bit at which lane-group channel `c` of a value group (of the lane
/// group without groups) starts in the byte the fragment takes it from.
pub fn code_shift(c: u32, bits: u32) -> u32 {
    c * bits % 8
}

/// The bit at which a code found at bit `shift` enters the `mma` as an f16
/// subnormal ([`MmaPlan::subnormal_codes`]): codes below bit 4 move up 4
/// where they still fit the 10-bit mantissa. The tensor cores keep a
/// product's bits from the smallest normal exponent down, so a subnormal's
/// leading zeros cost precision: H200, 2-bit codes at bit 0 summed 1.6e-5
/// off, at bit 6 as exactly as normal f16s.
pub fn subnormal_shift(shift: u32, bits: u32) -> u32 {
    match shift < SUBNORMAL_LIFT && shift + SUBNORMAL_LIFT + bits <= 10 {
        true => shift + SUBNORMAL_LIFT,
        false => shift,
    }
}

/// How far [`subnormal_shift`] moves low codes up.
pub const SUBNORMAL_LIFT: u32 = 4;

/// The element `h` reads when it is channel c's of a row of packed elements:
/// its kind and the bit offset of channel 0.
fn channel_element(f: &Function, h: Handle<Expr>) -> Option<(Element, u32)> {
    let (element, offset) = element_at(f, h)?;
    match affine_in_channel(f, offset)? {
        (step, base) if step == element.bits() => Some((element, base)),
        _ => None,
    }
}

fn scaled_channel(f: &Function) -> Option<Channel> {
    let result = f.result?;
    let channel = |h| channel_element(f, h);
    if let Some((element, base)) = channel(result) {
        return Some(Channel {
            element,
            base,
            scale: None,
            groups: None,
            page_scale: None,
        });
    }
    let (x, y) = multiplied(f, result)?;
    let scaled = |e: Handle<Expr>, s: Handle<Expr>| {
        let (element, base) = channel(e)?;
        let (Element::Half, offset) = element_at(f, s)? else {
            return None;
        };
        Some(Channel {
            element,
            base,
            scale: Some(literal(f, offset)?),
            groups: None,
            page_scale: None,
        })
    };
    let page_scaled = |e: Handle<Expr>, s: Handle<Expr>| {
        let (element, base) = channel(e)?;
        let Expr::HeaderScale { slot } = *f.exprs.try_get(s)? else {
            return None;
        };
        match affine_in_channel(f, slot)? {
            (1, slot0) => Some(Channel {
                element,
                base,
                scale: None,
                groups: None,
                page_scale: Some(slot0),
            }),
            _ => None,
        }
    };
    (scaled(x, y).or_else(|| scaled(y, x)))
        .or_else(|| page_scaled(x, y))
        .or_else(|| page_scaled(y, x))
}

/// `code(c) · scale[c / size] (+ zero[c / size])`, the scales and zeros
/// f16 item halves at `16 · (c / size)` past their first: [`ValueGroups`].
/// A constant scale (and zero) is one group of every channel.
fn grouped_channel(f: &Function, dims: u32) -> Option<Channel> {
    let result = f.result?;
    let channel = |h| channel_element(f, h);
    // An f16 half at `16 · (c / size) + first`: `(size, first)`.
    let half = |h: Handle<Expr>| {
        let (Element::Half, offset) = element_at(f, h)? else {
            return None;
        };
        match affine_in_group(f, offset)? {
            (Some(size), 16, first) => Some((size, first)),
            (None, 0, first) => Some((dims, first)),
            _ => None,
        }
    };
    let (code, scale, zero) = match *f.exprs.try_get(result)? {
        Expr::Fma { a, b, c } => (a, b, Some(c)),
        _ => {
            let (x, y) = multiplied(f, result)?;
            (x, y, None)
        }
    };
    let ((element, base), (size, scale)) =
        (channel(code).zip(half(scale))).or_else(|| channel(scale).zip(half(code)))?;
    let zero = match zero {
        Some(z) => match half(z)? {
            (s, first) if s == size => Some(first),
            _ => return None,
        },
        None => None,
    };
    Some(Channel {
        element,
        base,
        scale: None,
        groups: Some(ValueGroups { size, scale, zero }),
        page_scale: None,
    })
}

/// `(size, a, b)` when the u32 expression is `a · (channel / size) + b`
/// (`size` None: no channel term).
fn affine_in_group(f: &Function, h: Handle<Expr>) -> Option<(Option<u32>, u32, u32)> {
    match *f.exprs.try_get(h)? {
        Expr::Literal(Literal::U32(v)) => Some((None, 0, v)),
        Expr::Binary {
            op: BinaryOp::Divide,
            left,
            right,
        } => match (f.exprs.try_get(left)?, literal(f, right)?) {
            (Expr::Input(Input::Channel), size) if size > 0 => Some((Some(size), 1, 0)),
            _ => None,
        },
        Expr::Binary { op, left, right } => {
            let (l, r) = (affine_in_group(f, left)?, affine_in_group(f, right)?);
            let size = match (l.0, r.0) {
                (Some(a), Some(b)) if a != b => return None,
                (a, b) => a.or(b),
            };
            match op {
                BinaryOp::Add => Some((size, l.1.checked_add(r.1)?, l.2.checked_add(r.2)?)),
                BinaryOp::Multiply if l.1 == 0 => {
                    Some((size, r.1.checked_mul(l.2)?, r.2.checked_mul(l.2)?))
                }
                BinaryOp::Multiply if r.1 == 0 => {
                    Some((size, l.1.checked_mul(r.2)?, l.2.checked_mul(r.2)?))
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// `(a, b)` when the u32 expression is `a · channel + b`.
fn affine_in_channel(f: &Function, h: Handle<Expr>) -> Option<(u32, u32)> {
    match *f.exprs.try_get(h)? {
        Expr::Input(Input::Channel) => Some((1, 0)),
        Expr::Literal(Literal::U32(v)) => Some((0, v)),
        Expr::Binary { op, left, right } => {
            let (l, r) = (affine_in_channel(f, left)?, affine_in_channel(f, right)?);
            match op {
                BinaryOp::Add => Some((l.0.checked_add(r.0)?, l.1.checked_add(r.1)?)),
                BinaryOp::Multiply if l.0 == 0 => {
                    Some((r.0.checked_mul(l.1)?, r.1.checked_mul(l.1)?))
                }
                BinaryOp::Multiply if r.0 == 0 => {
                    Some((l.0.checked_mul(r.1)?, l.1.checked_mul(r.1)?))
                }
                _ => None,
            }
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score_of(element: Element) -> MmaScore {
        score_with_dims(element, 128)
    }

    fn score_with_dims(element: Element, key_dims: u32) -> MmaScore {
        let mut arrays = crate::ir::Arena::default();
        MmaScore {
            query: arrays.append(ArrayDecl {
                name: "query".into(),
                len: key_dims,
            }),
            key: element,
            key_scale: None,
            key_zero: None,
            key_bias: None,
            key_dims,
            gathered_runs: None,
        }
    }

    /// The 16-byte bank group (of eight per 128-byte line) of `byte`.
    fn bank_group(byte: u32) -> u32 {
        byte / CHUNK % (BANK_LINE / CHUNK)
    }

    #[test]
    fn padded_rows_put_a_fragment_rows_lanes_and_a_copys_lanes_on_different_banks() {
        for bits in [2, 3, 4] {
            let mut score = score_of(unsigned(bits));
            score.key_scale = Some(0);
            assert!(score.padded_page_queries(), "{bits}-bit keys are padded");
            let (elements, padded) = (score.chunk_elements(), score.padded_chunk_bytes());
            let unpadded: Vec<u32> = (0..ROW_LANES)
                .map(|j| bank_group(4 * elements * j))
                .collect();
            assert!(
                unpadded.iter().all(|&b| b == unpadded[0]),
                "unpadded they conflict"
            );
            for v in 0..elements / 4 {
                let mut banks: Vec<u32> = (0..ROW_LANES)
                    .map(|j| bank_group(j * padded + CHUNK * v))
                    .collect();
                banks.sort();
                banks.dedup();
                assert_eq!(banks.len() as u32, ROW_LANES, "{bits}-bit vector {v}");
            }
            // A copy's lanes 8q..8q+8 write vectors 8q..8q+8 of the row.
            let per_chunk = elements / 4;
            for quarter in 0..score.key_dims / 4 / 8 {
                let mut banks: Vec<u32> = (8 * quarter..8 * quarter + 8)
                    .map(|x| bank_group(x / per_chunk * padded + x % per_chunk * CHUNK))
                    .collect();
                banks.sort();
                banks.dedup();
                assert_eq!(
                    banks.len(),
                    8,
                    "{bits}-bit copy, lanes of quarter {quarter}"
                );
            }
        }
        // 8-element chunks (int8 coefficients of 32 dims) do not conflict unpadded.
        let mut narrow = score_with_dims(
            Element::Int {
                bits: 8,
                signed: true,
            },
            32,
        );
        narrow.key_scale = Some(0);
        assert!(!narrow.padded_page_queries());
    }

    fn unsigned(bits: u32) -> Element {
        Element::Int {
            bits,
            signed: false,
        }
    }

    /// KIVI's asymmetric keys are a dot product of the query with codes
    /// times page scales plus page zero points, the zeros past the scales.
    #[test]
    fn asymmetric_page_keys_are_recognised() {
        let format =
            crate::Format::parse(include_str!("../../../../specs/kivi2.toml"), "kivi2.toml")
                .expect("the bundled spec");
        for (tier, bits) in format.tiers().iter().zip([2, 3]) {
            let module = tier.module();
            let score = dot_product(&module.key.score).expect("a dot product");
            let code = Element::Int {
                bits,
                signed: false,
            };
            assert_eq!(score.key, code);
            assert_eq!((score.key_scale, score.key_zero), (Some(0), Some(128)));
            assert_eq!(score.key_dims, 128);
        }
    }

    /// The four lanes of a fragment row hold every key element exactly once,
    /// whatever the element width (2-bit rows of 128 dims in 8-byte chunks,
    /// of 256 in 16-byte ones), and gathered in one or two runs a lane.
    #[test]
    fn lanes_of_a_row_cover_every_key_element_once() {
        let gathered = |runs| MmaScore {
            gathered_runs: Some(runs),
            ..score_of(Element::Half)
        };
        for m in [
            score_of(Element::Half),
            score_with_dims(Element::Half, 48),
            score_of(Element::Int {
                bits: 8,
                signed: true,
            }),
            score_of(unsigned(4)),
            score_of(unsigned(2)),
            score_with_dims(unsigned(2), 256),
            score_of(unsigned(3)),
            score_with_dims(unsigned(3), 256),
            gathered(1),
            gathered(2),
        ] {
            let element = m.key;
            let mut seen = vec![0; m.key_dims as usize];
            for quad in 0..ROW_LANES {
                for r in 0..m.key_registers() {
                    for e in 0..m.register_elements() {
                        seen[(m.key_element(r, e) + m.chunk_elements() * quad) as usize] += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "{element:?}: {seen:?}");
        }
    }

    /// A key row's bits as the IR reads them (element `i` of `bits` at bit
    /// `bits · i`, little-endian bytes), split into 32-bit words, each made
    /// into fragment registers by the kernel's `(word << shift) & mask`
    /// (3-bit codes: each 12-byte chunk transposed and its registers'
    /// parts shifted and masked): every register byte is 2^(8 − bits)
    /// times the code of the element [`MmaScore::key_element`] names.
    #[test]
    fn code_registers_hold_the_elements_key_element_names() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut random = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        fn permute(a: u32, b: u32, selector: u32) -> u32 {
            let bytes = [a.to_le_bytes(), b.to_le_bytes()].concat();
            (0..4).fold(0, |x, n| {
                x | u32::from(bytes[((selector >> (4 * n)) & 7) as usize]) << (8 * n)
            })
        }
        for (bits, dims) in [(2, 128), (2, 256), (3, 128), (3, 256), (4, 128), (8, 128)] {
            let m = score_with_dims(unsigned(bits), dims);
            let codes: Vec<u32> = (0..dims)
                .map(|_| (random() as u32) & ((1 << bits) - 1))
                .collect();
            let mut row = vec![0u8; m.row_bytes() as usize];
            for (i, &code) in codes.iter().enumerate() {
                let bit = bits as usize * i;
                let placed = code << (bit % 8);
                row[bit / 8] |= placed as u8;
                if placed > 0xFF {
                    row[bit / 8 + 1] |= (placed >> 8) as u8;
                }
            }
            let chunk = m.chunk_bytes() as usize;
            for quad in 0..ROW_LANES {
                // The lane's chunks, quad + 4 · c, word by word.
                let chunks = (0..m.lane_chunks()).map(|c| {
                    let at = chunk * (quad + ROW_LANES * c) as usize;
                    row[at..at + chunk]
                        .chunks(4)
                        .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
                        .collect::<Vec<_>>()
                });
                let registers = chunks.flat_map(|words| match bits {
                    3 => {
                        let transposed = TRIPLET_SELECTORS.map(|(first, second)| {
                            permute(permute(words[0], words[1], first), words[2], second)
                        });
                        (0..8)
                            .map(|j| {
                                triplet_register(j).iter().fold(0, |x, &(b, shift, mask)| {
                                    let w = transposed[b];
                                    let w = match shift {
                                        s if s >= 0 => w << s,
                                        s => w >> -s,
                                    };
                                    x | (w & mask)
                                })
                            })
                            .collect::<Vec<_>>()
                    }
                    _ => (words.iter())
                        .flat_map(|&w| {
                            (0..8 / bits).map(move |j| {
                                let (shift, mask) = code_register(bits, j);
                                (w << shift) & mask
                            })
                        })
                        .collect(),
                });
                let mut count = 0;
                for (r, register) in registers.enumerate() {
                    for e in 0..4 {
                        let dim = m.key_element(r as u32, e) + m.chunk_elements() * quad;
                        let byte = (register >> (8 * e)) & 0xFF;
                        assert_eq!(
                            byte,
                            codes[dim as usize] << (8 - bits),
                            "{bits}-bit, {dims} dims: lane {quad}, register {r}, byte {e}"
                        );
                    }
                    count += 1;
                }
                assert_eq!(count, m.key_registers(), "{bits}-bit, {dims} dims");
            }
        }
    }

    /// Asymmetric keys with values that qualify score on the tensor cores:
    /// 2-bit codes in 8-byte chunks, 3-bit codes in 12-byte ones, the zero
    /// points past the scales.
    #[test]
    fn plan_admits_asymmetric_keys_of_every_width() {
        let format = crate::Format::parse(
            include_str!("../../../../tests/in/tensor-cores/asymmetric_keys.toml"),
            "asymmetric_keys.toml",
        )
        .expect("the test spec");
        let tile_items = 64;
        let mut served = Vec::new();
        for tier in format.tiers() {
            let module = tier.module();
            let layout = &module.layout;
            let mut key = Stream::new(layout.key_stream_offset, layout.key.stride, false);
            let mut value = Stream::new(layout.value_stream_offset, layout.value.stride, false);
            key.buffer_offset = layout.header_bytes;
            value.buffer_offset = key.buffer_offset + key.capacity(tile_items);
            let m = plan(module, 4, tile_items, &key, &value, true).expect("values qualify");
            served.push(
                (m.score.as_ref()).map(|s| (s.key, s.key_scale, s.key_zero, s.chunk_bytes())),
            );
        }
        assert_eq!(
            served,
            [
                Some((unsigned(2), Some(0), Some(128), 8)),
                Some((unsigned(4), Some(0), Some(128), 16)),
                Some((unsigned(8), Some(0), Some(128), 16)),
                Some((unsigned(3), Some(0), Some(128), 12)),
            ]
        );
    }

    /// Unsigned value codes enter the tensor cores as f16 subnormals;
    /// signed (KIVI) and page-scaled (subspace) ones as 1024 + code.
    #[test]
    fn unsigned_value_codes_enter_as_subnormals() {
        let subnormal = |source: &str| -> Vec<bool> {
            let format = crate::Format::parse(source, "spec.toml").expect("the bundled spec");
            (format.tiers().iter())
                .map(|tier| {
                    let module = tier.module();
                    let layout = &module.layout;
                    let mut key = Stream::new(layout.key_stream_offset, layout.key.stride, false);
                    let mut value =
                        Stream::new(layout.value_stream_offset, layout.value.stride, false);
                    key.buffer_offset = layout.header_bytes;
                    value.buffer_offset = key.buffer_offset + key.capacity(64);
                    let m = plan(module, 4, 64, &key, &value, true).expect("values qualify");
                    m.subnormal_codes()
                })
                .collect()
        };
        assert_eq!(
            subnormal(include_str!("../../../../specs/kivi2.toml")),
            [true; 2]
        );
        assert_eq!(
            subnormal(include_str!("../../../../specs/kivi.toml")),
            [false; 2]
        );
        assert_eq!(
            subnormal(include_str!("../../../../specs/subspace.toml")),
            [false]
        );
    }

    /// Every code of a byte enters at bit 4 or above where it still fits
    /// f16's 10-bit mantissa (8-bit codes fill it from bit 0), moved by 0 or 4.
    #[test]
    fn subnormal_codes_sit_high_in_the_mantissa() {
        for bits in [2, 3, 4, 8] {
            for c in 0..32 {
                let shift = code_shift(c, bits);
                let lifted = subnormal_shift(shift, bits);
                assert!(lifted + bits <= 10, "{bits}-bit channel {c} at {lifted}");
                assert!(
                    lifted >= 4 || bits == 8,
                    "{bits}-bit channel {c} at {lifted}"
                );
                assert!([0, SUBNORMAL_LIFT].contains(&(lifted - shift)));
            }
        }
    }

    /// Vector codebooks stored f16 are looked up by the fragment loads,
    /// whatever their code width, codeword length or books, copied across
    /// the banks where one load reads a codeword and the copies fit; f32
    /// books (not exact f16 operands) leave the tier's values per thread.
    #[test]
    fn f16_codebook_values_are_looked_up() {
        let lookups = |source: &str| {
            let format = crate::Format::parse(source, "vq.toml").expect("the test spec");
            (format.tiers().iter())
                .map(|tier| {
                    let module = tier.module();
                    let layout = &module.layout;
                    let tile_items = 64;
                    let mut key = Stream::new(layout.key_stream_offset, layout.key.stride, false);
                    let mut value =
                        Stream::new(layout.value_stream_offset, layout.value.stride, false);
                    key.buffer_offset = layout.header_bytes;
                    value.buffer_offset = key.buffer_offset + key.capacity(tile_items);
                    let m = plan(module, 4, tile_items, &key, &value, true)?;
                    let l = m.value_rows.lookup?;
                    assert_eq!(m.channel.element, Element::Half);
                    assert!(!m.value_rows.staged && !m.value_rows.as_stored());
                    assert_eq!(m.staging_bytes(tile_items), 0);
                    Some((
                        (l.groups, l.group_size, l.bits, l.book_stride),
                        (l.lane_codes(), l.code_lanes(), l.bank_copies()),
                    ))
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            lookups(include_str!(
                "../../../../tests/in/tensor-cores/vq-values.toml"
            )),
            [
                // 16-byte codewords: a copy for each of a phase's 8 lanes.
                Some(((16, 8, 4, 16 * 8), (2, 1, 8))),
                // 4-byte codewords: 32 copies of 256 codewords fill the budget.
                Some(((64, 2, 8, 0), (8, 1, 32))),
                // 32-byte codewords take two loads: not copied.
                Some(((8, 16, 4, 0), (1, 1, 1))),
                // Two lane groups read halves of a 64-byte codeword.
                Some(((4, 32, 8, 0), (1, 2, 1))),
            ]
        );
        assert_eq!(
            lookups(include_str!("../../../../specs/shard.toml")),
            [Some(((32, 4, 8, 0), (4, 1, 16)))]
        );
        let f32_books = "name = \"vq\"\nhead_dim = 128\n[page]\nitems = 64\n[[tier]]\nname = \"t\"\n\
             key.field = [{ kind = \"dense\", dtype = \"f16\" }]\n\
             value.field = [{ kind = \"codebook\", group_size = 4, bits = 8, codewords = \"vector\", dtype = \"f32\" }]\n";
        assert_eq!(lookups(f32_books), [None]);
    }

    /// A windowed lane group's codes (3-bit, 12 and 24 bits a lane group):
    /// lane group `r`'s start at bit `r · lane_bits` of its group, one
    /// funnel shift of the one or two words holding them brings them to bit
    /// 0, and [`window_channel`]'s byte permute and shift give each channel
    /// of two tokens in the halves.
    #[test]
    fn windowed_value_codes_reach_their_halves() {
        fn permute(a: u32, b: u32, selector: u32) -> u32 {
            let bytes = [a.to_le_bytes(), b.to_le_bytes()].concat();
            (0..4).fold(0, |x, n| {
                x | u32::from(bytes[((selector >> (4 * n)) & 7) as usize]) << (8 * n)
            })
        }
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut random = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 32) as u32
        };
        let element = unsigned(3);
        for size in [32, 64] {
            let groups = ValueGroups {
                size,
                scale: 0,
                zero: None,
            };
            assert!(groups.windowed(element));
            let lane_bits = groups.lane_bits(element);
            let per_group = lane_bits / 3;
            // Two tokens' codes of one group, packed little-endian into words.
            let codes: [Vec<u32>; 2] = [0, 1].map(|_| (0..size).map(|_| random() & 7).collect());
            let words = codes.clone().map(|codes| {
                let mut words = vec![0u32; (size * 3 / 32) as usize];
                for (i, &code) in codes.iter().enumerate() {
                    let bit = 3 * i;
                    let wide = u64::from(code) << (bit % 32);
                    words[bit / 32] |= wide as u32;
                    if wide >> 32 != 0 {
                        words[bit / 32 + 1] |= (wide >> 32) as u32;
                    }
                }
                words
            });
            for row in 0..8 {
                let first = row * lane_bits;
                let (word, shift) = ((first / 32) as usize, first % 32);
                let next = usize::from(shift + lane_bits > 32);
                let window = |w: &Vec<u32>| {
                    let wide = u64::from(w[word]) | u64::from(w[word + next]) << 32;
                    (wide >> shift) as u32
                };
                let (first_token, second_token) = (window(&words[0]), window(&words[1]));
                for c in 0..per_group {
                    let (selector, shift) = window_channel(c, 3);
                    assert!(shift + 3 <= 10);
                    let x = permute(first_token, second_token, selector);
                    let channel = (per_group * row + c) as usize;
                    assert_eq!(
                        [(x >> shift) & 7, (x >> (16 + shift)) & 7],
                        [codes[0][channel], codes[1][channel]],
                        "groups of {size}: lane group {row}, channel {c}"
                    );
                }
            }
        }
    }
}
