//! Reading what a program reads: item bits from the tile's bytes in shared
//! memory at any alignment ([`ItemReader`]), and f32 elements of shared
//! arrays and tables at constant indices, or at a constant offset from an
//! index known to be a multiple of four, 16 bytes at a time ([`Chunks`]).

use std::collections::{HashMap, HashSet};

use super::super::builder::{Global, Kernel, Op, Reg, Shared, B16, F32, U32, U64};
use super::{ItemSource, Val};
use crate::ir::{Arena, BinaryOp, Expr, Handle, Literal};

/// A memory a program reads f32 elements from.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Source {
    Array(usize),
    Table(usize),
}

/// Elements at constant indices load 16 bytes at a time, once per program:
/// a dot product with the query reads a quarter as many times, for every
/// head. Keyed by memory, replica and 16-byte chunk.
#[derive(Default, Clone)]
pub(super) struct Chunks {
    constant: HashMap<(Source, usize, u32), [Reg<F32>; 4]>,
    /// Keyed by memory, replica, the aligned base's expression and chunk.
    aligned: HashMap<(Source, usize, usize, u32), [Reg<F32>; 4]>,
}

impl Chunks {
    /// Element `index` of the 16-byte-aligned shared memory at `base + offset`.
    pub(super) fn shared(
        &mut self,
        k: &mut Kernel,
        (source, replica): (Source, usize),
        base: Reg<U32>,
        offset: u32,
        index: u32,
    ) -> Reg<F32> {
        let chunk = self
            .constant
            .entry((source, replica, index / 4))
            .or_insert_with(|| {
                k.ld_shared_v4(Shared::at(base).plus(i64::from(offset + 16 * (index / 4))))
            });
        chunk[(index % 4) as usize]
    }

    /// Element `read.offset` past the aligned index `read.base` of a table:
    /// `load(bytes)` loads the 16 bytes that many bytes past the index's
    /// element, once per program.
    pub(super) fn aligned(
        &mut self,
        (source, replica): (Source, usize),
        read: AlignedRead,
        load: impl FnOnce(i64) -> [Reg<F32>; 4],
    ) -> Reg<F32> {
        let key = (source, replica, read.base.index(), read.offset / 4);
        let chunk = *self
            .aligned
            .entry(key)
            .or_insert_with(|| load(16 * i64::from(read.offset / 4)));
        chunk[(read.offset % 4) as usize]
    }

    /// Element `index` of the 16-byte-aligned global memory at `base`.
    pub(super) fn global(
        &mut self,
        k: &mut Kernel,
        (source, replica): (Source, usize),
        base: Reg<U64>,
        index: u32,
    ) -> Reg<F32> {
        let chunk = self
            .constant
            .entry((source, replica, index / 4))
            .or_insert_with(|| k.ld_global_nc_v4(Global::at(base).plus(16 * i64::from(index / 4))));
        chunk[(index % 4) as usize]
    }
}

/// A table read at element `base + offset`, `base` a multiple of four
/// elements and `offset` a constant; `elements`: how many of the four in its
/// 16 bytes the program reads from the same base.
#[derive(Clone, Copy)]
pub(super) struct AlignedRead {
    pub(super) base: Handle<Expr>,
    pub(super) offset: u32,
    pub(super) elements: u32,
}

/// The table reads at a constant offset from an index of at least two known
/// trailing zeros (`zeros`, [`crate::proc::known_zeros`]): a row of a table
/// whose rows are a multiple of four elements, such as the PCA value
/// epilogue's basis row per output channel. Reading such a row as vectors
/// takes a quarter of the loads, and of the L1 wavefronts where every lane
/// reads another row.
pub(super) fn aligned_table_reads(exprs: &Arena<Expr>, zeros: &[u32]) -> Vec<Option<AlignedRead>> {
    let literal = |h: Handle<Expr>| match exprs[h] {
        Expr::Literal(Literal::U32(c)) => Some(c),
        _ => None,
    };
    let split = |index: Handle<Expr>| -> Option<(Handle<Expr>, u32)> {
        match exprs[index] {
            Expr::Literal(_) => None,
            Expr::Binary {
                op: BinaryOp::Add,
                left,
                right,
            } => match (literal(left), literal(right)) {
                (None, Some(c)) if zeros[left.index()] >= 2 => Some((left, c)),
                (Some(c), None) if zeros[right.index()] >= 2 => Some((right, c)),
                _ => (zeros[index.index()] >= 2).then_some((index, 0)),
            },
            _ => (zeros[index.index()] >= 2).then_some((index, 0)),
        }
    };
    let reads: Vec<Option<(usize, Handle<Expr>, u32)>> = exprs
        .iter()
        .map(|(_, expr)| match *expr {
            Expr::Table { table, index } => split(index).map(|(b, c)| (table.index(), b, c)),
            _ => None,
        })
        .collect();
    let mut chunks: HashMap<(usize, usize, u32), HashSet<u32>> = HashMap::new();
    for &(table, base, offset) in reads.iter().flatten() {
        let elements = chunks.entry((table, base.index(), offset / 4)).or_default();
        elements.insert(offset % 4);
    }
    reads
        .into_iter()
        .map(|read| {
            let (table, base, offset) = read?;
            Some(AlignedRead {
                base,
                offset,
                elements: chunks[&(table, base.index(), offset / 4)].len() as u32,
            })
        })
        .collect()
}

/// Reads bit fields of one item in shared memory, LSB-first little-endian.
///
/// A field at a constant bit offset lives in the item's 32-bit words `k` (and
/// `k + 1` when it straddles them): one `bfe`, or a funnel shift of the two
/// words and a `bfe`. Words are loaded once per program. When the item's
/// address is 16-byte aligned they come four at a time (`ld.shared.v4`); when
/// it is not 4-byte aligned (6- or 14-byte items) each item word is rebuilt
/// from the two aligned words around it with a funnel shift by the item's
/// byte misalignment, once, and everything after that is as if aligned.
/// Runtime offsets compute the word address and shift per read.
pub(super) struct ItemReader {
    base: Reg<U32>,
    align: u32,
    words: HashMap<u32, Reg<U32>>,
    chunks: HashMap<u32, [Reg<U32>; 4]>,
    /// Item words split into their low and high halves ([`super::half_reads`]).
    halves: HashMap<u32, (Reg<B16>, Reg<B16>)>,
    raw: HashMap<u32, Reg<U32>>,
    /// For unaligned items: the aligned address below the item and the bit
    /// shift from it to the item's first bit.
    unaligned: Option<(Reg<U32>, Reg<U32>)>,
}

impl ItemReader {
    pub(super) fn new(source: ItemSource) -> ItemReader {
        ItemReader {
            base: source.base,
            align: source.align,
            words: HashMap::new(),
            chunks: HashMap::new(),
            halves: HashMap::new(),
            raw: HashMap::new(),
            unaligned: None,
        }
    }

    pub(super) fn unaligned(&mut self, k: &mut Kernel) -> (Reg<U32>, Reg<U32>) {
        let base = self.base;
        *self.unaligned.get_or_insert_with(|| {
            let word_base = k.and(base, !3u32);
            let bytes = k.and(base, 3u32);
            let shift = k.shl(bytes, 3u32);
            (word_base, shift)
        })
    }

    /// Item word `index`: bits `32 * index ..` of the item.
    pub(super) fn word(&mut self, k: &mut Kernel, index: u32) -> Reg<U32> {
        if let Some(&w) = self.words.get(&index) {
            return w;
        }
        let word = if self.align >= 16 {
            let base = self.base;
            let chunk = *self.chunks.entry(index / 4).or_insert_with(|| {
                k.ld_shared_v4(Shared::at(base).plus(16 * i64::from(index / 4)))
            });
            chunk[(index % 4) as usize]
        } else if self.align >= 4 {
            k.ld_shared(Shared::at(self.base).plus(4 * i64::from(index)))
        } else {
            let (_, shift) = self.unaligned(k);
            let lo = self.raw(k, index);
            let hi = self.raw(k, index + 1);
            k.shf_r_wrap(lo, hi, shift)
        };
        self.words.insert(index, word);
        word
    }

    /// Aligned word `index` at or below the item's start.
    pub(super) fn raw(&mut self, k: &mut Kernel, index: u32) -> Reg<U32> {
        if let Some(&w) = self.raw.get(&index) {
            return w;
        }
        let (word_base, _) = self.unaligned(k);
        let w = k.ld_shared(Shared::at(word_base).plus(4 * i64::from(index)));
        self.raw.insert(index, w);
        w
    }

    pub(super) fn mask(k: &mut Kernel, value: Reg<U32>, position: Op<U32>, width: u32) -> Reg<U32> {
        match position {
            _ if width == 32 => value,
            Op::Imm(_) => k.bfe_u32(value, position, width),
            // `bfe` with a register position becomes four SASS instructions
            // (two PRMTs unpack position and length every time); the field
            // fits in the word here, so shift and mask say the same in two.
            Op::Reg(_) => {
                let shifted = k.shr(value, position);
                k.and(shifted, (1u32 << width) - 1)
            }
        }
    }

    /// The unit (8 or 16 bits) one naturally aligned narrow load can read a
    /// field of `width` bits from, when the field's offset has `zeros` known
    /// trailing zero bits: a field no wider than the power-of-two block its
    /// offset is aligned to never leaves that block, so it never leaves the
    /// byte (or halfword) holding it.
    pub(super) fn narrow_unit(&self, width: u32, zeros: u32) -> Option<u32> {
        if width <= 8 && width <= 1 << zeros.min(3) {
            Some(8)
        } else if width <= 16 && zeros >= 4 && self.align >= 2 {
            Some(16)
        } else {
            None
        }
    }

    /// The field at bit `offset` (`offset & (unit - 1)` within the unit) from a
    /// byte or halfword load at `at`.
    pub(super) fn narrow(
        k: &mut Kernel,
        at: Shared,
        unit: u32,
        shift: Option<Op<U32>>,
        width: u32,
    ) -> Reg<U32> {
        let value = k.ld_shared_narrow(at, unit);
        let value = match shift {
            Some(shift) => k.shr(value, shift),
            None => value,
        };
        if width == unit {
            value
        } else {
            k.and(value, (1u32 << width) - 1)
        }
    }

    pub(super) fn read_static(&mut self, k: &mut Kernel, offset: u32, width: u32) -> Reg<U32> {
        let (index, shift) = (offset / 32, offset % 32);
        // Items at odd addresses: whole words cost two loads and a funnel
        // shift, so a byte or halfword field not already in a loaded word
        // is loaded alone.
        let unit = self.narrow_unit(width, offset.trailing_zeros());
        if let Some(unit) = unit.filter(|_| self.align < 4 && !self.words.contains_key(&index)) {
            let at = Shared::at(self.base).plus(i64::from(offset / 8 / (unit / 8) * (unit / 8)));
            let within = offset % unit;
            return Self::narrow(k, at, unit, (within > 0).then_some(Op::Imm(within)), width);
        }
        let lo = self.word(k, index);
        if shift + width <= 32 {
            Self::mask(k, lo, Op::Imm(shift), width)
        } else {
            let hi = self.word(k, index + 1);
            let joined = k.shf_r_wrap(lo, hi, shift);
            Self::mask(k, joined, Op::Imm(0), width)
        }
    }

    /// The f16 at bit `offset` (a multiple of 16) as f32.
    pub(super) fn read_half(&mut self, k: &mut Kernel, offset: u32) -> Reg<F32> {
        let index = offset / 32;
        // Odd-address items load a lone halfword (see `read_static`).
        let half = if self.align < 4 && !self.words.contains_key(&index) {
            let bits = self.read_static(k, offset, 16);
            k.low16(bits)
        } else {
            let (lo, hi) = match self.halves.get(&index) {
                Some(&pair) => pair,
                None => {
                    let word = self.word(k, index);
                    let pair = k.split_halves(word);
                    self.halves.insert(index, pair);
                    pair
                }
            };
            if offset.is_multiple_of(32) {
                lo
            } else {
                hi
            }
        };
        k.f16_to_f32(half)
    }

    /// The fields of a pack of channels at bit offsets `offsets[r]`, which
    /// grow by `step` per channel of a pack, the first known to have `zeros`
    /// trailing zeros: when every pack's fields lie in one naturally aligned
    /// byte, halfword or word (the item's alignment permitting), one load
    /// per pack and a constant shift per channel (kivi int8 pairs: one
    /// `ld.shared.u16` instead of an address and a byte load each; f16
    /// quads: one `ld.shared.v2.u32`). `None`
    /// when they may not.
    pub(super) fn read_pack(
        &mut self,
        k: &mut Kernel,
        offsets: &[Val],
        pack: usize,
        step: u32,
        width: u32,
        zeros: u32,
    ) -> Option<Vec<Reg<U32>>> {
        let span = step.checked_mul(pack as u32 - 1)?.checked_add(width)?;
        // Two or four words (quads or octets of f16 channels) when no field
        // straddles them.
        let in_words = (0..pack as u32).all(|e| (step * e) % 32 + width <= 32);
        let unit = [8, 16, 32, 64, 128].into_iter().find(|&unit| {
            span <= unit
                && zeros >= unit.trailing_zeros()
                && self.align >= unit / 8
                && (unit < 64 || in_words)
        })?;
        let mut fields = Vec::with_capacity(offsets.len());
        for first in offsets.iter().step_by(pack) {
            let words = match first.u32() {
                Op::Reg(offset) => {
                    let byte = k.shr(offset, 3u32);
                    let at = Shared::at(k.add(self.base, byte));
                    match unit {
                        128 => k.ld_shared_v4(at).to_vec(),
                        64 => k.ld_shared_v2(at).to_vec(),
                        32 => vec![k.ld_shared(at)],
                        _ => vec![k.ld_shared_narrow(at, unit)],
                    }
                }
                Op::Imm(_) => unreachable!("a varying offset is a register"),
            };
            let top = unit.min(32);
            for e in 0..pack as u32 {
                let bits = words[(step * e / 32) as usize];
                let shift = step * e % 32;
                // The load zero-extends, so the top field needs no mask.
                fields.push(match (shift, shift + width == top) {
                    (0, true) => bits,
                    (_, true) => k.shr(bits, shift),
                    _ => Self::mask(k, bits, Op::Imm(shift), width),
                });
            }
        }
        Some(fields)
    }

    /// `zeros`: trailing zero bits `offset` is known to have.
    pub(super) fn read_dynamic(
        &mut self,
        k: &mut Kernel,
        offset: Reg<U32>,
        width: u32,
        zeros: u32,
    ) -> Reg<U32> {
        if let Some(unit) = self.narrow_unit(width, zeros) {
            // Byte address and one narrow load, at any item alignment: three
            // or four instructions instead of a word address, one or two
            // word loads and a funnel shift.
            let byte = k.shr(offset, 3u32);
            let at = k.add(self.base, byte);
            let shift = (zeros < 3).then(|| Op::Reg(k.and(offset, 7u32)));
            return Self::narrow(k, Shared::at(at), unit, shift, width);
        }
        let (word_base, bit) = if self.align >= 4 {
            (self.base, offset)
        } else {
            let (word_base, shift) = self.unaligned(k);
            (word_base, k.add(offset, shift))
        };
        let index = k.shr(bit, 5u32);
        let at = k.mad_lo(index, 4u32, word_base);
        let shift = k.and(bit, 31u32);
        let lo = k.ld_shared(Shared::at(at));
        // A field that starts on a multiple of its width never straddles two
        // words (widths of 1, 2, 4, 8, 16, 32 bits at aligned offsets).
        let single = self.align >= 4 && width <= 1 << zeros.min(5);
        if single {
            Self::mask(k, lo, Op::Reg(shift), width)
        } else {
            let hi = k.ld_shared(Shared::at(at).plus(4));
            let joined = k.shf_r_wrap(lo, hi, shift);
            Self::mask(k, joined, Op::Imm(0), width)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc::known_zeros;
    use crate::Format;

    fn epilogue_reads(spec: &str) -> Vec<AlignedRead> {
        let format = Format::parse(spec, "spec.toml").expect("valid spec");
        let module = format.tiers()[0].module();
        let exprs = &module.value.epilogue.stages[0].exprs;
        let zeros = known_zeros(exprs, 0);
        aligned_table_reads(exprs, &zeros)
            .into_iter()
            .flatten()
            .collect()
    }

    fn pca(rank: u32) -> String {
        format!(
            "name = \"p\"\nhead_dim = 64\n[page]\nitems = 64\n[[tier]]\nname = \"t\"\n\
             key.field = [{{ kind = \"dense\", dtype = \"f16\" }}]\n\
             value.transform = {{ kind = \"pca\", rank = {rank}, basis = \"f16\" }}\n\
             value.field = [{{ kind = \"dense\", dtype = \"f16\" }}]\n"
        )
    }

    #[test]
    fn pca_basis_rows_of_a_multiple_of_four_read_as_whole_vectors() {
        let reads = epilogue_reads(&pca(16));
        assert_eq!(reads.len(), 16, "one read per basis element of the row");
        assert!(reads.iter().all(|r| r.elements == 4));
        let mut offsets: Vec<u32> = reads.iter().map(|r| r.offset).collect();
        offsets.sort_unstable();
        assert_eq!(offsets, (0..16).collect::<Vec<_>>());
    }

    #[test]
    fn rows_of_other_lengths_stay_scalar() {
        assert!(epilogue_reads(&pca(6)).is_empty());
    }
}
