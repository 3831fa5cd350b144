//! Bitmap fields whose groups are one or two 32-bit words (MosaicKV's f16
//! pairs), gathered straight into the tensor cores' A fragments
//! (docs/ptx-backend.md, Tensor cores).
//!
//! The f16 pairs a lane holds of a row come in runs of consecutive groups,
//! at most 8, each in one byte of the mask or within one word: of a key row,
//! a chunk each ([`MmaScore::chunk_elements`]), the quad's in turn (pairs
//! `8 · quad + 0..8` and `32 + 8 · quad + 0..8` with 128 elements, so a
//! load's four lanes read groups close together); of a value row, its lane group's
//! channels (pairs `8 · row + 0..8` with 128 channels). The lane packs
//! four runs' mask bits into the bytes of a word and their ranks (the set
//! bits below each group) into the bytes of others: popcounts for each
//! row's first run, then per group of a run, for the four runs at once, its
//! bits masked and added shifted (one `lea.hi`). A
//! register is then its address (one `dp4a`: its rank's byte, scaled, plus
//! the item), a zero and a load predicated on its bit (ptxas sets four
//! predicates from a byte at once), from the packed groups in the tile
//! buffer: no dense row is written and read again through shared memory,
//! whose pipe would bound the kernel (docs/ptx-backend.md, Tensor cores).
//!
//! Masks with more set bits than `keep` (no encoder writes them; stale rows
//! past a tile's items may hold them) have their ranks clamped to
//! `keep − 1`, as the interpreter reads them, in a branch the warp takes
//! only when one of its rows of the tile has such a mask: each lane checks
//! one row per side, once per tile.

use super::super::streams::{stride_align, Stream};
use super::super::tensor_cores::{Gather, MmaPlan, MmaScore, RUN_BITS};
use crate::back::ptx::builder::{Cmp, Kernel, Pred, Reg, Shared, U32};

/// Runs packed in a word, a byte each.
const RUNS_PER_WORD: u32 = 32 / RUN_BITS;

/// A lane's constant state for gathering one side's bitmap into fragments.
pub(super) struct FragmentGather {
    g: Gather,
    /// A lane's runs of a row and groups per run.
    row_runs: u32,
    run_groups: u32,
    /// With runs strided over the lanes: the bit offset of the lane's first
    /// group in the mask's first word (the run after it starts a word on).
    strided: Option<Reg<U32>>,
    /// Per mask word up to the lanes' last first group, its bits below the
    /// lane's first run.
    below: Vec<Reg<U32>>,
    bits: RunBits,
    /// The side's rows in a tile buffer: offset and stride.
    rows_at: u32,
    stride: u32,
    /// Byte offsets of the mask and of the packed groups in an item, and the
    /// mask's known alignment.
    mask_at: u32,
    mask_align: u32,
    elems_at: u32,
}

/// How a row's runs come out of its mask words.
enum RunBits {
    /// The runs are whole bytes of a one- or two-word mask: the byte
    /// permute that takes them to bytes `0..` of a word.
    Bytes(Reg<U32>),
    /// One run: whether it is in each word past the first, and its bit
    /// offset in its word.
    Shifted {
        in_word: Vec<Reg<Pred>>,
        offset: Reg<U32>,
    },
}

/// One run to gather: its item, its mask bits (at a byte of the register)
/// and the rank of its first group.
struct Run {
    item: Reg<U32>,
    bits: (Reg<U32>, u32),
    start: Reg<U32>,
}

impl FragmentGather {
    /// The state of lane `lane` (its place among the lanes sharing a row)
    /// holding `lane_pairs` f16 pairs of a row of stream `s`: consecutive, or
    /// (`strided`) as runs every `lanes`-th run of the row, the lanes' runs in
    /// turn ([`MmaScore::chunk_elements`]).
    fn new(
        k: &mut Kernel,
        g: Gather,
        lane_pairs: u32,
        lane: Reg<U32>,
        strided: bool,
        s: &Stream,
    ) -> Self {
        let (row_runs, run_groups) = g.lane_runs(lane_pairs);
        let lane_groups = lane_pairs / g.group_registers();
        let lanes = g.groups / lane_groups;
        // Groups from a lane's first to the next lane's, and from a run to
        // the lane's next.
        let (lane_step, run_step) = match strided && row_runs > 1 {
            true => (run_groups, lanes * run_groups),
            false => (lane_groups, run_groups),
        };
        let first = k.mul(lane, lane_step);
        let word = k.shr(first, 5u32);
        let offset = k.and(first, 31u32);
        let strided = (run_step > run_groups).then(|| {
            debug_assert!(
                row_runs == 2 && run_step == 32 && (lanes - 1) * lane_step < 32,
                "strided runs: two bytes per lane a word apart, the first in word 0"
            );
            offset
        });
        let bits = match run_groups == RUN_BITS && g.mask_words() <= 2 {
            true => {
                // Result byte i: mask byte `first / 8 + i · run_step / 8`
                // (bytes past the lane's runs are masked off).
                let byte = k.shr(first, 3u32);
                let steps = (run_step / RUN_BITS) * 0x3210;
                RunBits::Bytes(k.mad_lo(byte, 0x1111u32, steps))
            }
            false => RunBits::Shifted {
                in_word: (1..g.mask_words())
                    .map(|w| k.setp(Cmp::Eq, word, w))
                    .collect(),
                offset,
            },
        };
        let bit = k.shl(1u32, offset);
        let partial = k.sub(bit, 1u32);
        // Words past every lane's first group hold none of their bits below.
        let last_first = (lanes - 1) * lane_step;
        let below = (0..=last_first / 32)
            .map(|w| {
                let here = k.setp(Cmp::Eq, word, w);
                let after = k.setp(Cmp::Gt, word, w);
                let part = k.selp(partial, 0u32, here);
                k.selp(u32::MAX, part, after)
            })
            .collect();
        let align = |byte: u32| s.align().min(stride_align(s.buffer_offset + byte));
        FragmentGather {
            g,
            row_runs,
            run_groups,
            strided,
            below,
            bits,
            rows_at: s.buffer_offset,
            stride: s.shared_stride,
            mask_at: g.mask_bit / 8,
            mask_align: align(g.mask_bit / 8),
            elems_at: g.elems_bit / 8,
        }
    }

    /// Key rows of `key` scored by `score`; `quad`: the lane's place in its
    /// fragment row.
    pub(super) fn for_keys(
        k: &mut Kernel,
        g: Gather,
        score: &MmaScore,
        key: &Stream,
        quad: Reg<U32>,
    ) -> Self {
        k.comment("key fragments gathered from the bitmap's packed groups");
        Self::new(k, g, score.lane_pairs(), quad, true, key)
    }

    /// Value rows of `value` accumulated by `m`; `row`: the lane's fragment
    /// row (its lane group).
    pub(super) fn for_values(
        k: &mut Kernel,
        g: Gather,
        m: &MmaPlan,
        value: &Stream,
        row: Reg<U32>,
    ) -> Self {
        k.comment("value fragments gathered from the bitmap's packed groups");
        // A lane group holds 2 channels per channel tile: one pair.
        Self::new(k, g, m.channel_tiles(), row, false, value)
    }

    /// The lane's registers of the rows of the items at `items`: per row,
    /// its groups' words in order (keys: [`MmaScore::key_element`]'s order;
    /// values: the lane group's channel words); `over`: whether some row of
    /// the tile has more set bits than `keep` ([`Self::rows_over`]). The
    /// warp runs this together.
    pub(super) fn rows(
        &self,
        k: &mut Kernel,
        items: &[Reg<U32>],
        over: Reg<Pred>,
    ) -> Vec<Vec<Reg<U32>>> {
        let mut runs = Vec::new();
        for &item in items {
            let words = self.mask(k, item);
            let bits = match self.bits {
                RunBits::Bytes(selector) => {
                    k.prmt_by(words[0], *words.last().expect("a word"), selector)
                }
                RunBits::Shifted {
                    ref in_word,
                    offset,
                } => {
                    let mut word = words[0];
                    for (&later, &here) in words[1..].iter().zip(in_word) {
                        word = k.selp(later, word, here);
                    }
                    k.shr(word, offset)
                }
            };
            let lower: Vec<Reg<U32>> = (words.iter().zip(&self.below))
                .map(|(&w, &b)| {
                    let lower = k.and(w, b);
                    k.popc(lower)
                })
                .collect();
            let mut start = (lower.into_iter())
                .reduce(|sum, count| k.add(sum, count))
                .expect("a mask word");
            for i in 0..self.row_runs {
                if i > 0 {
                    // The set bits from the run before to this one: its own,
                    // or (strided) the next 32 of the row.
                    let before = match self.strided {
                        Some(offset) => k.shf_r_wrap(words[0], words[1], offset),
                        None => k.bfe_u32(bits, RUN_BITS * (i - 1), RUN_BITS),
                    };
                    let count = k.popc(before);
                    start = k.add(start, count);
                }
                runs.push(Run {
                    item,
                    bits: (bits, i),
                    start,
                });
            }
        }
        let registers = self.gather(k, &runs, over);
        registers
            .chunks(self.row_runs as usize)
            .map(|row| row.concat())
            .collect()
    }

    /// Whether one of the rows `rows` (indices in the side's tile in buffer
    /// `buf`, each with whether it counts) has more set bits than `keep`.
    pub(super) fn rows_over(
        &self,
        k: &mut Kernel,
        buf: Reg<U32>,
        rows: &[(Reg<U32>, Reg<Pred>)],
    ) -> Reg<Pred> {
        let first = k.add(buf, self.rows_at);
        let overs: Vec<Reg<Pred>> = (rows.iter())
            .map(|&(row, read)| {
                let item = k.mad_lo(row, self.stride, first);
                let words = self.mask(k, item);
                let counts: Vec<Reg<U32>> = (words.iter().enumerate())
                    .map(|(w, &word)| {
                        let groups = self.g.groups - 32 * w as u32;
                        match groups < 32 {
                            true => {
                                let kept = k.and(word, (1u32 << groups) - 1);
                                k.popc(kept)
                            }
                            false => k.popc(word),
                        }
                    })
                    .collect();
                let total = (counts.into_iter())
                    .reduce(|sum, count| k.add(sum, count))
                    .expect("a mask word");
                let over = k.setp(Cmp::Gt, total, self.g.keep);
                k.and_pred(over, read)
            })
            .collect();
        (overs.into_iter())
            .reduce(|a, b| k.or_pred(a, b))
            .expect("a row")
    }

    /// Zeroes the masks of the rows `rows` (indices in the side's tile in
    /// buffer `buf`) whose predicate holds.
    pub(super) fn zero_masks(&self, k: &mut Kernel, buf: Reg<U32>, rows: &[(Reg<U32>, Reg<Pred>)]) {
        let first = k.add(buf, self.rows_at);
        for &(row, stale) in rows {
            let item = k.mad_lo(row, self.stride, first);
            k.guarded(stale, true, |k| {
                for w in 0..self.g.mask_words() {
                    let at = Shared::at(item).plus(i64::from(self.mask_at + 4 * w));
                    k.st_shared::<U32>(at, 0u32);
                }
            });
        }
    }

    /// The mask words of the item at `item`.
    fn mask(&self, k: &mut Kernel, item: Reg<U32>) -> Vec<Reg<U32>> {
        let at = Shared::at(item).plus(i64::from(self.mask_at));
        let (words, unit) = k.ld_shared_units(at, 4 * self.g.mask_words(), self.mask_align);
        debug_assert_eq!(unit, 4, "masks are whole aligned words (mma::gather)");
        words
    }

    /// The registers of each run: per group, its words, each the packed
    /// group at the group's rank when its bit is set, else zero.
    fn gather(&self, k: &mut Kernel, runs: &[Run], over: Reg<Pred>) -> Vec<Vec<Reg<U32>>> {
        let g = self.g;
        let run_mask = (1u32 << self.run_groups) - 1;
        let packed: Vec<(Reg<U32>, Vec<Reg<U32>>)> = runs
            .chunks(RUNS_PER_WORD as usize)
            .map(|four| {
                let bits = pack_bytes(k, &four.iter().map(|r| r.bits).collect::<Vec<_>>());
                let used = (0..four.len() as u32)
                    .map(|i| run_mask << (RUN_BITS * i))
                    .sum::<u32>();
                let bits = k.and(bits, used);
                let starts: Vec<(Reg<U32>, u32)> = four.iter().map(|r| (r.start, 0)).collect();
                let mut ranks = vec![pack_bytes(k, &starts)];
                for j in 1..self.run_groups {
                    // Masked, then shifted: ptxas folds the shift into the add (one `lea.hi`).
                    let step = k.and(bits, 0x0101_0101u32 << (j - 1));
                    let step = k.shr(step, j - 1);
                    let previous = ranks[j as usize - 1];
                    ranks.push(k.add(previous, step));
                }
                (bits, ranks)
            })
            .collect();
        let fine = k.label();
        k.bra_if(over, false, fine);
        for &rank in packed.iter().flat_map(|(_, ranks)| ranks) {
            let clamped = bytes_at_most(k, rank, g.keep - 1);
            k.assign(rank, clamped);
        }
        k.place(fine);
        (runs.iter().enumerate())
            .map(|(i, run)| {
                let (bits, ranks) = &packed[i / RUNS_PER_WORD as usize];
                let byte = i as u32 % RUNS_PER_WORD;
                let mut registers = Vec::new();
                for (j, &ranks) in (0u32..).zip(ranks) {
                    // The group's address from byte `byte` of the ranks in one
                    // instruction, where a byte extract and a multiply-add took two.
                    let group = k.dp4a(ranks, g.group_bytes() << (8 * byte), run.item);
                    let bit = k.and(*bits, 1u32 << (RUN_BITS * byte + j));
                    let kept = k.setp(Cmp::Ne, bit, 0u32);
                    for w in 0..g.group_registers() {
                        let value = k.mov(0u32);
                        let at = Shared::at(group).plus(i64::from(self.elems_at + 4 * w));
                        k.guarded(kept, true, |k| k.ld_shared_to(value, at));
                        registers.push(value);
                    }
                }
                registers
            })
            .collect()
    }
}

/// Byte `i` of the result: byte `sources[i].1` of register `sources[i].0`
/// (up to four); the bytes past them are copies of some of them.
fn pack_bytes(k: &mut Kernel, sources: &[(Reg<U32>, u32)]) -> Reg<U32> {
    let mut registers: Vec<Reg<U32>> = sources.iter().map(|&(r, _)| r).collect();
    registers.dedup();
    if registers.len() <= 2 {
        let (a, b) = (registers[0], *registers.last().expect("a source"));
        let selector = (sources.iter().enumerate())
            .map(|(i, &(r, byte))| (4 * u32::from(r != a) + byte) << (4 * i))
            .sum::<u32>();
        return k.prmt(a, b, selector);
    }
    let halves: Vec<Reg<U32>> = sources.chunks(2).map(|pair| pack_bytes(k, pair)).collect();
    k.prmt(halves[0], halves[1], 0x5410)
}

/// Each byte of `x` (each at most 127) as at most `limit` (below 128).
fn bytes_at_most(k: &mut Kernel, x: Reg<U32>, limit: u32) -> Reg<U32> {
    let limits = limit * 0x0101_0101;
    // Byte `0x80 + limit − x` keeps its top bit exactly when `x ≤ limit`,
    // and borrows from no other byte.
    let difference = k.sub(limits | 0x8080_8080, x);
    let within = k.and(difference, 0x8080_8080u32);
    let within = k.shr(within, 7u32);
    let keep = k.mul(within, 0xFFu32);
    // (x & keep) | (limits & !keep)
    k.lop3(x, keep, limits, 0xE2)
}
