//! Codebook rows looked up into dense f16 rows for the tensor cores (vector
//! quantized values such as Shard's; docs/ptx-backend.md, Tensor cores).
//!
//! The prologue converts the books to f16 in shared memory (exact: they are
//! stored f16), half the bytes a lookup reads as f32, and where they fit
//! writes a copy of each codeword for every lane of a shared-memory phase,
//! side by side: lane `l` reads copy `l % copies`, so the lanes of a phase
//! hit distinct banks whatever their codes (random codes met about three to
//! a bank). Per 16-token tile of
//! the warp, lane `l` takes word `l % words` of the codes of token
//! `l / words` of each round of `32 / words` tokens: it loads the word, then
//! per code the codeword (vector loads as its alignment allows), and stores
//! its run of the dense row 16 bytes at a time where it can. Runs of two
//! chunks are stored in turns, the second chunk first for words `4..8` of
//! each eight: a phase's eight lanes then write eight different banks'
//! chunks, where in order they would meet two to a bank.

use super::super::abi::TableBuffer;
use super::super::builder::{Cmp, Global, Kernel, Pred, Reg, Shared, F32, U32};
use super::super::streams::{stride_align, CHUNK};
use super::super::tensor_cores::{Lookup, MmaPlan, TILE, WARP_LANES};
use super::cta::Cta;
use super::expand::load_units;
use super::fragments::Fragments;

/// The codebook lookup of value rows before the tensor cores read them.
#[derive(Clone, Copy)]
pub(super) struct Lookups<'a> {
    pub(super) cta: &'a Cta<'a>,
    pub(super) frag: Fragments<'a>,
}

/// A lane's part in the lookup, for the whole stream.
pub(super) struct MmaLookup {
    lookup: Lookup,
    warp: Reg<U32>,
    /// The lane's code word in the warp's first token of a tile buffer.
    codes: Reg<U32>,
    /// The lane's book: the f16 codebook, plus its first group's book.
    book: Reg<U32>,
    /// Where the lane stores its run's chunks in turn, in the warp's first
    /// staged row, and (runs of two chunks) whether it stores them swapped.
    row: [Reg<U32>; 2],
    swapped: Option<Reg<Pred>>,
    /// Lanes with a token in a round (a round of one word per token has 32).
    active: Option<Reg<Pred>>,
}

impl Lookup {
    /// Tokens whose codes one round of the warp's lanes takes.
    fn round_tokens(&self) -> u32 {
        (WARP_LANES / self.code_words()).min(TILE)
    }
}

impl Lookups<'_> {
    /// The lane's part in looking up the value rows, set once before the
    /// stream; `None` unless the values are looked up.
    pub(super) fn setup(&self, k: &mut Kernel, m: &MmaPlan) -> Option<MmaLookup> {
        let l = m.value_rows.lookup?;
        let plan = self.cta.plan;
        let words = l.code_words();
        let warp = k.shr(self.cta.tid, 5u32);
        let lane = k.and(self.cta.tid, 31u32);
        let word = k.and(lane, words - 1);
        let token_in = k.shr(lane, words.trailing_zeros());
        let token = k.mad_lo(warp, TILE, token_in);
        let code = k.mad_lo(word, 4u32, plan.value.buffer_offset + l.code_bit / 8);
        let codes = k.mad_lo(token, plan.value.shared_stride, code);
        // The lane's copy of every codeword (lanes of a phase read distinct banks).
        let copy = k.and(lane, l.copies - 1);
        let book = k.add(self.cta.smem, l.book);
        let book = k.mad_lo(copy, l.codeword_bytes(), book);
        let book = match l.book_stride {
            0 => book,
            stride => k.mad_lo(word, 2 * stride * l.copies * l.word_codes(), book),
        };
        let rows = k.add(self.cta.smem, m.value_rows.offset);
        let run = k.mad_lo(word, l.word_row_bytes(), rows);
        let row = k.mad_lo(token, m.value_rows.stride, run);
        let (row, swapped) = match l.word_row_bytes() {
            bytes if bytes == 2 * CHUNK => {
                // Words 4..8 of each eight store their second chunk first.
                let shift = k.and(word, 4u32);
                let swapped = k.setp(Cmp::Ne, shift, 0u32);
                let shift = k.shl(shift, 2u32);
                let first = k.add(row, shift);
                let after = k.add(row, CHUNK);
                let second = k.sub(after, shift);
                ([first, second], Some(swapped))
            }
            _ => ([row, row], None),
        };
        let active = (WARP_LANES / words > TILE).then(|| k.setp(Cmp::Lt, token_in, TILE));
        Some(MmaLookup {
            lookup: l,
            warp,
            codes,
            book,
            row,
            swapped,
            active,
        })
    }

    /// Fills the warp's dense value rows from the codes of the tile in
    /// buffer `buf` (pipelined, the pending tile's): see the module's docs.
    /// Only the warp reads its rows, so a warp barrier publishes them; the
    /// barrier that shows the next tile keeps them until every lane is done.
    pub(super) fn tile(&self, k: &mut Kernel, lk: &MmaLookup, buf: Reg<U32>) {
        let plan = self.cta.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let l = lk.lookup;
        k.comment("look the warp's value codes up into dense f16 rows");
        let codes = k.add(buf, lk.codes);
        let per_round = l.round_tokens();
        for j in 0..self.frag.slots(m) {
            let ok = match (self.frag.slot_ok(k, m, lk.warp, j), lk.active) {
                (Some(a), Some(b)) => Some(k.and_pred(a, b)),
                (a, b) => a.or(b),
            };
            let skip = ok.map(|ok| {
                let skip = k.label();
                k.bra_if(ok, false, skip);
                skip
            });
            for r in 0..TILE / per_round {
                let token = j * plan.warps * TILE + r * per_round;
                let at = Shared::at(codes).plus(i64::from(token * plan.value.shared_stride));
                let word = k.ld_shared::<U32>(at);
                let words = self.codewords(k, lk, word);
                let offset = i64::from(token * m.value_rows.stride);
                match lk.swapped {
                    Some(swapped) => {
                        let (low, high) = words.split_at(4);
                        for (turn, (a, b)) in [(high, low), (low, high)].into_iter().enumerate() {
                            let chunk: Vec<Reg<U32>> = a
                                .iter()
                                .zip(b)
                                .map(|(&x, &y)| k.selp(x, y, swapped))
                                .collect();
                            let at = Shared::at(lk.row[turn]).plus(offset);
                            k.st_shared_v4(at, [chunk[0], chunk[1], chunk[2], chunk[3]]);
                        }
                    }
                    None => {
                        let at = Shared::at(lk.row[0]).plus(offset);
                        store_run(k, at, &words, stride_align(l.word_row_bytes()));
                    }
                }
            }
            if let Some(skip) = skip {
                k.place(skip);
            }
        }
        k.bar_warp_sync();
    }

    /// The codewords of a word's codes as f16 pairs, in channel order.
    fn codewords(&self, k: &mut Kernel, lk: &MmaLookup, word: Reg<U32>) -> Vec<Reg<U32>> {
        let l = lk.lookup;
        let bytes = l.codeword_bytes();
        let mut halves = Vec::new();
        let mut words = Vec::new();
        for c in 0..l.word_codes() {
            let code = k.bfe_u32(word, c * l.bits, l.bits);
            let at = k.mad_lo(code, bytes * l.copies, lk.book);
            let at = Shared::at(at).plus(i64::from(2 * l.book_stride * l.copies * c));
            match load_units(k, at, bytes, stride_align(bytes)) {
                (units, 2) => halves.extend(units),
                (units, _) => words.extend(units),
            }
        }
        // Odd codewords (read as halves): pairs across codewords.
        let pairs = halves
            .chunks(2)
            .map(|pair| k.prmt(pair[0], pair[1], 0x5410));
        let pairs: Vec<Reg<U32>> = pairs.collect();
        words.extend(pairs);
        words
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

/// Stores `words` at `at`, as wide as `align` (the run's known alignment)
/// allows.
fn store_run(k: &mut Kernel, at: Shared, words: &[Reg<U32>], align: u32) {
    // Runs are whole words: `align` is at least 4.
    let width = align.min(CHUNK) / 4;
    for (i, unit) in words.chunks(width as usize).enumerate() {
        let at = at.plus(i64::from(4 * width * i as u32));
        match *unit {
            [a, b, c, d] => k.st_shared_v4(at, [a, b, c, d]),
            [a, b] => k.st_shared_v2(at, [a, b]),
            [a] => k.st_shared(at, a),
            _ => unreachable!("runs are stored in units of 1, 2 or 4 words"),
        }
    }
}
