//! Bitmap rows expanded into dense f16 rows for the tensor cores (MosaicKV,
//! docs/ptx-backend.md, Tensor cores).
//!
//! A lane takes one row of a tile: it loads the row's mask words and all
//! `keep` packed groups up front (vector loads as the rows' alignment
//! allows), zeroes the dense row, then makes `keep` unrolled steps, each
//! storing packed group `j` at the lowest set bit left in the mask and
//! clearing it. No step waits on a load and every lane makes the same steps
//! (a loop per set bit would wait on each group's load before its store and
//! run as often as the warp's fullest mask word). Set bits beyond the
//! `keep`-th (no encoder writes them) take group `keep − 1`, as in the
//! interpreter, in a loop that runs only then.

use super::super::builder::{Cmp, Kernel, Pred, Reg, Shared, U32};
use super::super::streams::{stride_align, Stream, CHUNK};
use super::super::tensor_cores::{Gather, MmaPlan, Rows, TILE};
use super::cta::Cta;
use super::fragments::Fragments;

/// The expansion of bitmap rows before the tensor cores read them.
#[derive(Clone, Copy)]
pub(super) struct Expand<'a> {
    pub(super) cta: &'a Cta<'a>,
    pub(super) frag: Fragments<'a>,
}

/// A lane's part in the bitmap expansion, for the whole stream.
pub(super) struct MmaExpand {
    pub(super) passes: Vec<ExpandPass>,
    /// The lane's token in the warp's first token tile.
    pub(super) token: Reg<U32>,
    /// Lanes 16–31: the value side's, in a pass of both sides.
    pub(super) upper: Reg<Pred>,
}

/// A side's bitmap field, stream and staged rows, and its index (0: keys,
/// 1: values).
pub(super) type ExpandSide<'a> = (Gather, &'a Stream, Rows, usize);

/// One pass of the expansion: one side, or both sides with one shape.
pub(super) struct ExpandPass {
    pub(super) gather: Gather,
    /// The pass's sides (0: keys, 1: values): lanes 0–15 take the first.
    pub(super) sides: Vec<usize>,
    /// Known alignment (bytes) of an item's mask and of its packed groups in
    /// a tile buffer, on every side of the pass.
    pub(super) mask_align: u32,
    pub(super) elems_align: u32,
    /// The lanes that take part (0–15) when the pass has one side.
    pub(super) active: Option<Reg<Pred>>,
    /// The lane's side: mask and elements offsets in a tile buffer, item
    /// stride, first staged row, row stride.
    pub(super) mask_at: Reg<U32>,
    pub(super) elems_at: Reg<U32>,
    pub(super) item_stride: Reg<U32>,
    pub(super) rows: Reg<U32>,
    pub(super) row_stride: Reg<U32>,
}

/// Part of a packed group: a 32-bit word or a half (low bits of the
/// register), and its byte offset in the group.
#[derive(Clone, Copy)]
pub(super) struct Piece {
    pub(super) value: Reg<U32>,
    pub(super) bits: u32,
    pub(super) offset: u32,
}

/// A lane's mask, whose set bits the steps take from the lowest up: the
/// word they take from and its dense row address (the row of its group 0),
/// then the later words and theirs. The current word is empty only when
/// every word is.
pub(super) struct MaskWalk {
    pub(super) word: Reg<U32>,
    pub(super) row: Reg<U32>,
    pub(super) later: Vec<(Reg<U32>, Reg<U32>)>,
}

impl Expand<'_> {
    /// The lane's part in expanding bitmap rows (each side's
    /// `Rows::expanded`), set once before the stream; `None` without gathers.
    /// Lane `l` takes token `l % 16` of each of the warp's tiles: of the key
    /// rows for `l < 16` and of the value rows above when both sides gather
    /// with one shape, else the sides take turns on lanes 0–15.
    pub(super) fn setup(&self, k: &mut Kernel, m: &MmaPlan) -> Option<MmaExpand> {
        let plan = self.cta.plan;
        let sides: Vec<ExpandSide> = [
            (m.key_rows.expanded(), &plan.key, m.key_rows),
            (m.value_rows.expanded(), &plan.value, m.value_rows),
        ]
        .into_iter()
        .enumerate()
        .filter_map(|(side, (g, stream, rows))| Some((g?, stream, rows, side)))
        .collect();
        if sides.is_empty() {
            return None;
        }
        let shared_shape = |a: Gather, b: Gather| {
            (a.groups, a.group_size, a.keep) == (b.groups, b.group_size, b.keep)
        };
        let passes: Vec<Vec<ExpandSide>> = match sides[..] {
            [a, b] if shared_shape(a.0, b.0) => vec![sides],
            _ => sides.into_iter().map(|side| vec![side]).collect(),
        };
        let warp = k.shr(self.cta.tid, 5u32);
        let lane = k.and(self.cta.tid, 31u32);
        let upper = k.setp(Cmp::Ge, lane, 16u32);
        let lower = k.setp(Cmp::Lt, lane, 16u32);
        let token_in = k.and(lane, 15u32);
        let token = k.mad_lo(warp, TILE, token_in);
        let passes = passes
            .iter()
            .map(|pass| {
                // The lane's side: its values, picked by `upper` with two sides.
                let mut pick = |of: &dyn Fn(&ExpandSide) -> u32| match pass[..] {
                    [ref a, ref b] => k.selp(of(b), of(a), upper),
                    _ => k.mov(of(&pass[0])),
                };
                let mask_at = pick(&|(g, s, _, _)| s.buffer_offset + g.mask_bit / 8);
                let elems_at = pick(&|(g, s, _, _)| s.buffer_offset + g.elems_bit / 8);
                let item_stride = pick(&|(_, s, _, _)| s.shared_stride);
                let row_at = pick(&|(_, _, r, _)| r.offset);
                let row_stride = pick(&|(_, _, r, _)| r.stride);
                let align = |bit: &dyn Fn(&Gather) -> u32| {
                    let of = |(g, s, _, _): &ExpandSide| {
                        s.align().min(stride_align(s.buffer_offset + bit(g) / 8))
                    };
                    pass.iter().map(of).min().expect("a pass has a side")
                };
                ExpandPass {
                    gather: pass[0].0,
                    sides: pass.iter().map(|side| side.3).collect(),
                    mask_align: align(&|g| g.mask_bit),
                    elems_align: align(&|g| g.elems_bit),
                    active: (pass.len() == 1).then_some(lower),
                    mask_at,
                    elems_at,
                    item_stride,
                    rows: k.add(self.cta.smem, row_at),
                    row_stride,
                }
            })
            .collect();
        Some(MmaExpand {
            passes,
            token,
            upper,
        })
    }

    /// Expands the bitmap rows of the warp's token tiles into dense f16 rows
    /// of the staging area, each side from its tile (`tiles`: buffer and
    /// items, keys then values; pipelined, the values are the tile before
    /// the keys'): see the module's docs. Only the warp reads its rows, so a
    /// warp barrier publishes them; the barrier that shows the next tile
    /// keeps them until every lane is done.
    pub(super) fn tile(&self, k: &mut Kernel, e: &MmaExpand, tiles: [(Reg<U32>, Reg<U32>); 2]) {
        let plan = self.cta.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        k.comment("expand the warp's bitmap rows into dense f16 rows");
        let zero = k.mov(0u32);
        for pass in &e.passes {
            let g = pass.gather;
            let (buf, items) = match pass.sides[..] {
                [lower, upper] if tiles[lower] != tiles[upper] => {
                    let (a, b) = (tiles[lower], tiles[upper]);
                    (k.selp(b.0, a.0, e.upper), k.selp(b.1, a.1, e.upper))
                }
                _ => tiles[pass.sides[0]],
            };
            for j in 0..self.frag.slots(m) {
                let skip = k.label();
                let token = k.add(e.token, j * plan.warps * TILE);
                let ok = k.setp(Cmp::Lt, token, items);
                let ok = match pass.active {
                    Some(active) => k.and_pred(ok, active),
                    None => ok,
                };
                k.bra_if(ok, false, skip);
                let item = k.mad_lo(token, pass.item_stride, buf);
                let mask = k.add(item, pass.mask_at);
                let (mut words, unit) =
                    k.ld_shared_units(Shared::at(mask), 4 * g.mask_words(), pass.mask_align);
                debug_assert_eq!(unit, 4, "masks are whole aligned words (mma::gather)");
                if let Some(last) = words.last_mut() {
                    let bits = g.groups - 32 * (g.mask_words() - 1);
                    if bits < 32 {
                        *last = k.and(*last, (1u32 << bits) - 1);
                    }
                }
                let elems = k.add(item, pass.elems_at);
                let groups = packed_groups(k, elems, g, pass.elems_align);
                let row = k.mad_lo(token, pass.row_stride, pass.rows);
                for c in 0..g.dense_bytes().div_ceil(CHUNK) {
                    k.st_shared_v4::<U32>(Shared::at(row).plus(i64::from(CHUNK * c)), [zero; 4]);
                }
                let walk = MaskWalk::new(k, &words, row, g);
                for group in &groups {
                    walk.step(k, g, group);
                }
                // Bits beyond the `keep`-th: group `keep − 1`.
                let (top, done) = (k.label(), k.label());
                k.place(top);
                let left = walk.any_left(k);
                k.bra_if(left, false, done);
                walk.step(k, g, groups.last().expect("keep ≥ 1"));
                k.bra(top);
                k.place(done);
                k.place(skip);
            }
        }
        k.bar_warp_sync();
    }
}

impl MaskWalk {
    /// The walk of `words` (a row's mask, lowest first) over the dense row at
    /// `row` of `g`'s groups.
    pub(super) fn new(k: &mut Kernel, words: &[Reg<U32>], row: Reg<U32>, g: Gather) -> MaskWalk {
        let later = (words.iter().enumerate().skip(1))
            .map(|(w, &word)| (word, k.add(row, 32 * w as u32 * g.group_bytes())))
            .collect();
        let walk = MaskWalk {
            word: k.mov(0u32),
            row: k.mov(row),
            later,
        };
        walk.take(k, words[0], row);
        walk
    }

    /// Whether a set bit is left.
    pub(super) fn any_left(&self, k: &mut Kernel) -> Reg<Pred> {
        k.setp(Cmp::Ne, self.word, 0u32)
    }

    /// Stores `group` at the lowest set bit's group of the row and clears
    /// that bit; stores nothing once no bit is left.
    pub(super) fn step(&self, k: &mut Kernel, g: Gather, group: &[Piece]) {
        let left = self.any_left(k);
        let reversed = k.brev(self.word);
        let lowest = k.leading_zeros(reversed);
        let to = k.mad_lo(lowest, g.group_bytes(), self.row);
        k.guarded(left, true, |k| {
            for piece in group {
                let at = Shared::at(to).plus(i64::from(piece.offset));
                match piece.bits {
                    32 => k.st_shared(at, piece.value),
                    bits => k.st_shared_narrow(at, piece.value, bits),
                }
            }
        });
        let below = k.sub(self.word, 1u32);
        let rest = k.and(self.word, below);
        self.take(k, rest, self.row);
    }

    /// Makes `rest` (of the word at `row`) the current word, or when it is
    /// empty the first non-empty later word, which with the empty ones
    /// before it leaves the later words.
    pub(super) fn take(&self, k: &mut Kernel, rest: Reg<U32>, row: Reg<U32>) {
        let Some(&(last, last_row)) = self.later.last() else {
            // One word: it stays current, at its row.
            k.assign(self.word, rest);
            return;
        };
        let (mut word, mut word_row) = (last, last_row);
        for &(later, later_row) in self.later.iter().rev().skip(1) {
            let nonempty = k.setp(Cmp::Ne, later, 0u32);
            word = k.selp(later, word, nonempty);
            word_row = k.selp(later_row, word_row, nonempty);
        }
        let have = k.setp(Cmp::Ne, rest, 0u32);
        word = k.selp(rest, word, have);
        word_row = k.selp(row, word_row, have);
        // A later word is taken or skipped when every word before it is empty.
        let mut taken_or_before = k.not_pred(have);
        for (i, &(later, _)) in self.later.iter().enumerate() {
            let empty = k.setp(Cmp::Eq, later, 0u32);
            let kept = k.selp(0u32, later, taken_or_before);
            k.assign(later, kept);
            if i + 1 < self.later.len() {
                taken_or_before = k.and_pred(taken_or_before, empty);
            }
        }
        k.assign(self.word, word);
        k.assign(self.row, word_row);
    }
}

/// The `keep` packed groups of an item, elements at `elems` (aligned to
/// `align`), each as the pieces a dense row stores: words when the group is
/// whole words and was loaded as words, else halves.
pub(super) fn packed_groups(
    k: &mut Kernel,
    elems: Reg<U32>,
    g: Gather,
    align: u32,
) -> Vec<Vec<Piece>> {
    let group_bytes = g.group_bytes();
    let (units, unit_bytes) = k.ld_shared_units(Shared::at(elems), g.keep * group_bytes, align);
    let piece_bytes = if group_bytes.is_multiple_of(4) {
        unit_bytes
    } else {
        2
    };
    (0..g.keep)
        .map(|j| {
            (0..group_bytes / piece_bytes)
                .map(|i| {
                    let byte = j * group_bytes + i * piece_bytes;
                    let unit = units[(byte / unit_bytes) as usize];
                    let value = match byte % unit_bytes {
                        0 => unit,
                        _ => k.shr(unit, 16u32),
                    };
                    Piece {
                        value,
                        bits: 8 * piece_bytes,
                        offset: i * piece_bytes,
                    }
                })
                .collect()
        })
        .collect()
}
