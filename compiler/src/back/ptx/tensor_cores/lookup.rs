//! Value codebooks the accumulate looks up on the tensor cores: a lane
//! group's channels as codewords of f16 books, and where the books sit.

use super::*;

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
pub(super) fn lookup(
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
