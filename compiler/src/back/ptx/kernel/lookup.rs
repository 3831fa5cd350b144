//! Codebook values looked up where the tensor cores' fragments load them
//! (vector quantized values such as Shard's; docs/ptx-backend.md, Tensor
//! cores).
//!
//! The prologue converts the books to f16 in shared memory (exact: they are
//! stored f16), half the bytes a lookup reads as f32, and where they fit
//! writes a copy of each codeword for every lane of a shared-memory phase,
//! side by side: lane `l` reads copy `l % copies`, so the lanes of a phase
//! hit distinct banks whatever their codes (random codes met about three to
//! a bank). Where dense values would load a lane group's channels of a
//! token, the lane loads that token's codes of them and reads their
//! codewords: the words of the same channels, in order, with no dense row
//! written or read.

use super::super::abi::TableBuffer;
use super::super::builder::{Cmp, Global, Kernel, Reg, Shared, F32, U32};
use super::super::streams::CHUNK;
use super::super::tensor_cores::{Lookup, MmaPlan};
use super::cta::Cta;
use super::fragments::Lanes;

/// The codebook lookup of value fragments.
#[derive(Clone, Copy)]
pub(super) struct Lookups<'a> {
    pub(super) cta: &'a Cta<'a>,
}

/// A lane's part in the lookups, for the whole stream.
pub(super) struct LaneLookup {
    lookup: Lookup,
    /// The lane's copy of its lane group's first book, plus (channels that
    /// are part of a codeword) their offset in it.
    book: Reg<U32>,
    /// Codes narrower than a word: where the lane group's start in the word.
    shift: Option<Reg<U32>>,
    /// Byte offset in an item of the word holding the lane group's first code.
    pub(super) codes: Reg<U32>,
}

impl Lookups<'_> {
    /// The lane's lookup state; `None` unless the values are looked up.
    pub(super) fn setup(&self, k: &mut Kernel, m: &MmaPlan, lanes: &Lanes) -> Option<LaneLookup> {
        let l = m.value_rows.lookup?;
        let lane = k.and(self.cta.tid, 31u32);
        let copy = k.and(lane, l.copies - 1);
        let book = k.add(self.cta.smem, l.book);
        let book = k.mad_lo(copy, l.codeword_bytes(), book);
        // The lane group's first code, and its channels' place in the codeword.
        let code_lanes = l.code_lanes();
        let code = k.shr(lanes.row, code_lanes.trailing_zeros());
        let code = k.mul(code, l.lane_codes());
        let within = k.and(lanes.row, code_lanes - 1);
        let book = k.mad_lo(within, 2 * l.lane_channels, book);
        let book = match l.book_stride {
            0 => book,
            stride => k.mad_lo(code, 2 * stride * l.copies, book),
        };
        let bit = k.mad_lo(code, l.bits, l.code_bit);
        let word = k.shr(bit, 5u32);
        let codes = k.shl(word, 2u32);
        let shift = (l.lane_code_bits() < 32).then(|| k.and(bit, 31u32));
        Some(LaneLookup {
            lookup: l,
            book,
            shift,
            codes,
        })
    }

    /// Converts the value books to f16 in shared memory, four floats a
    /// thread at a time, into each copy of their codewords; the barrier
    /// that shows the first tile shows them.
    pub(super) fn stage_books(&self, k: &mut Kernel, m: &MmaPlan) {
        let Some(l) = m.value_rows.lookup else {
            return;
        };
        let plan = self.cta.plan;
        k.comment("the value codebook as f16, for the lookups");
        let tables = self.cta.tables(k);
        let offset = 4 * i64::from(TableBuffer::of(self.cta.m).offsets[l.table]);
        let book = k.add(self.cta.smem, l.book);
        let quads = l.book_len.div_ceil(4);
        let q = k.mov(self.cta.tid);
        let (top, end) = (k.label(), k.label());
        k.place(top);
        let done = k.setp(Cmp::Ge, q, quads);
        k.bra_if(done, true, end);
        let from = k.global_index(tables, q, CHUNK);
        let [a, b, c, d] = k.ld_global_nc_v4::<F32>(Global::at(from).plus(offset));
        let low = k.pack_f16x2(a, b);
        let high = k.pack_f16x2(c, d);
        if l.copies == 1 {
            let to = k.mad_lo(q, 8u32, book);
            k.st_shared_v2(Shared::at(to), [low, high]);
        } else {
            // Copied codewords are 2, 4 or 8 elements (Lookup::bank_copies):
            // the quad's first element starts codeword `4q / size` at `o`.
            let size = l.group_size;
            let bytes = l.codeword_bytes();
            let first = k.shl(q, 2u32);
            let codeword = k.shr(first, size.trailing_zeros());
            let within = k.and(first, size - 1);
            let at = k.mad_lo(within, 2u32, book);
            let at = k.mad_lo(codeword, bytes * l.copies, at);
            for j in 0..l.copies {
                let copy = Shared::at(at).plus(i64::from(j * bytes));
                match size {
                    // Two codewords: the second's copies follow the first's.
                    2 => {
                        k.st_shared(copy, low);
                        k.st_shared(copy.plus(i64::from(bytes * l.copies)), high);
                    }
                    _ => k.st_shared_v2(copy, [low, high]),
                }
            }
        }
        k.add_to(q, q, plan.threads);
        k.bra(top);
        k.place(end);
    }
}

impl LaneLookup {
    /// The lane group's channels of the token whose codes word is at `at`
    /// (word-aligned), as f16 pairs in channel order: its codes loaded, each
    /// code's codeword (or the channels' part of it) read from the books.
    pub(super) fn words(&self, k: &mut Kernel, at: Shared) -> Vec<Reg<U32>> {
        let l = self.lookup;
        let code_words = l.lane_code_bits().div_ceil(32);
        let mut words: Vec<Reg<U32>> = (0..code_words)
            .map(|w| k.ld_shared::<U32>(at.plus(i64::from(4 * w))))
            .collect();
        if let Some(shift) = self.shift {
            words[0] = k.shr(words[0], shift);
        }
        let bytes = l.read_bytes();
        (0..l.lane_codes())
            .flat_map(|c| {
                let bit = c * l.bits;
                let code = k.bfe_u32(words[(bit / 32) as usize], bit % 32, l.bits);
                let at = k.mad_lo(code, l.codeword_bytes() * l.copies, self.book);
                let at = Shared::at(at).plus(i64::from(2 * l.book_stride * l.copies * c));
                // Codewords start at multiples of their size; parts, of theirs.
                let (units, _) = k.ld_shared_units(at, bytes, bytes & bytes.wrapping_neg());
                units
            })
            .collect()
    }
}
