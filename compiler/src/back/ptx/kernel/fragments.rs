//! Where a lane sits in its warp's tensor-core fragments, shared by the
//! score and the accumulate on the tensor cores (`m16n8k16` fragments, lane
//! `4 · row + quad` of a warp), and the power-of-two scalings that keep
//! their f16 operands in range.

use super::super::builder::{Cmp, Kernel, Pred, Reg, Shared, F32, U32};
use super::super::tensor_cores::{MmaPlan, Rows, TILE};
use super::cta::Cta;
use super::gather::FragmentGather;

/// Fragment geometry of the CTA's warps.
#[derive(Clone, Copy)]
pub(super) struct Fragments<'a> {
    pub(super) cta: &'a Cta<'a>,
}

/// Binary exponent σ gives the largest scaled operand of a column: below
/// f16's 65504, and the low parts of the others well inside f16's range.
pub(super) const HALF_EXPONENT: u32 = 14;

/// f32 exponent bias and largest finite biased exponent.
pub(super) const BIAS: u32 = 127;

pub(super) const MAX_EXPONENT: u32 = 254;

/// Where a lane sits in its warp's fragments.
pub(super) struct Lanes {
    pub(super) warp: Reg<U32>,
    /// Fragment row (`lane / 4`) and quad (`lane % 4`).
    pub(super) row: Reg<U32>,
    pub(super) quad: Reg<U32>,
    /// Whether the lane's B columns are low parts (odd row).
    pub(super) low_part: Reg<Pred>,
}

impl Fragments<'_> {
    /// Token tiles (or accumulate steps) per warp: slot `j` is tile
    /// `warp + j · warps`.
    pub(super) fn slots(&self, m: &MmaPlan) -> u32 {
        m.token_tiles.div_ceil(self.cta.plan.warps)
    }

    /// `Some(whether slot j's tile exists)` when some warp has no tile in it.
    pub(super) fn slot_ok(
        &self,
        k: &mut Kernel,
        m: &MmaPlan,
        warp: Reg<U32>,
        j: u32,
    ) -> Option<Reg<Pred>> {
        let warps = self.cta.plan.warps;
        ((j + 1) * warps > m.token_tiles).then(|| k.setp(Cmp::Lt, warp, m.token_tiles - j * warps))
    }

    /// The lane's place in the fragments.
    pub(super) fn lanes(&self, k: &mut Kernel) -> Lanes {
        let warp = k.shr(self.cta.tid, 5u32);
        let lane = k.and(self.cta.tid, 31u32);
        let row = k.shr(lane, 2u32);
        let quad = k.and(lane, 3u32);
        let parity = k.and(row, 1u32);
        let low_part = k.setp(Cmp::Eq, parity, 1u32);
        Lanes {
            warp,
            row,
            quad,
            low_part,
        }
    }

    /// `(min(head, group_max − 1), smem + 4 · that)`: a head's slot in the
    /// per-head arrays, clamped for heads past the kernel's group.
    pub(super) fn head_slot(&self, k: &mut Kernel, head: Reg<U32>) -> (Reg<U32>, Reg<U32>) {
        let clamped = k.min(head, self.cta.plan.group_max - 1);
        (clamped, k.mad_lo(clamped, 4u32, self.cta.smem))
    }

    /// Whether the key rows' chunks are spread over the lanes ([`crate::back::ptx::tensor_cores::lane_chunk`]).
    pub(super) fn spread_chunks(&self) -> bool {
        (self.cta.plan.mma.as_ref()).is_some_and(|m| m.key_rows.swizzled)
    }

    /// The lane part of the key row chunks the lane loads ([`crate::back::ptx::tensor_cores::lane_chunk`]).
    pub(super) fn lane_chunk_part(&self, k: &mut Kernel, lanes: &Lanes) -> Reg<U32> {
        if !self.spread_chunks() {
            return lanes.quad;
        }
        let low = k.and(lanes.quad, 1u32);
        let high = k.and(lanes.quad, 2u32);
        k.mad_lo(high, 2u32, low)
    }

    /// Row 0 of a side's rows for the tile in buffer `buf`.
    pub(super) fn rows(&self, k: &mut Kernel, buf: Reg<U32>, rows: Rows) -> Reg<U32> {
        match rows.staged {
            true => k.add(self.cta.smem, rows.offset),
            false => k.add(buf, rows.offset),
        }
    }

    /// With gathered fragments, readies the rows the warp gathers from (its
    /// tokens of the key tile in buffer `keys.1` and of the value tile in
    /// `values.1`) and answers whether one has more set bits than its
    /// bitmap's `keep`, in any lane. Lane `l` takes the warp's token `l %
    /// 16` of slot `2 · i + l / 16`.
    ///
    /// Readying: in a tile with fewer items (`values.2`) than rows, the masks
    /// of the warp's value rows past them are zeroed, so their gathered words
    /// are zeros, where stale rows may hold any bits (0 · NaN poisons a sum),
    /// without a test per row in every tile. Stale key rows
    /// only meet logits the softmax drops.
    pub(super) fn ready_rows(
        &self,
        k: &mut Kernel,
        keys: Option<(&FragmentGather, Reg<U32>)>,
        values: Option<(&FragmentGather, Reg<U32>, Reg<U32>)>,
    ) -> Option<Reg<Pred>> {
        let plan = self.cta.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let sides: Vec<(&FragmentGather, Reg<U32>)> =
            [keys, values.map(|(gather, buf, _)| (gather, buf))]
                .into_iter()
                .flatten()
                .collect();
        if sides.is_empty() {
            return None;
        }
        let warp = k.shr(self.cta.tid, 5u32);
        let lane = k.and(self.cta.tid, 31u32);
        let token = k.and(lane, 15u32);
        let half = k.shr(lane, 4u32);
        let rows: Vec<(Reg<U32>, Reg<Pred>)> = (0..self.slots(m).div_ceil(2))
            .map(|i| {
                let slot = k.add(half, 2 * i);
                let tile = k.mad_lo(slot, plan.warps, warp);
                let row = k.mad_lo(tile, TILE, token);
                let read = k.setp(Cmp::Lt, row, plan.tile_items);
                // Rows past the tile are not checked, nor read.
                (k.min(row, plan.tile_items - 1), read)
            })
            .collect();
        if let Some((gather, buf, items)) = values {
            let full = k.setp(Cmp::Ge, items, plan.tile_items);
            let zeroed = k.label();
            k.bra_if(full, true, zeroed);
            let stale: Vec<(Reg<U32>, Reg<Pred>)> = (rows.iter())
                .map(|&(row, read)| {
                    let past = k.setp(Cmp::Ge, row, items);
                    (row, k.and_pred(past, read))
                })
                .collect();
            gather.zero_masks(k, buf, &stale);
            // A tile's items are the CTA's, so is the branch. A warp barrier
            // would do (each warp zeroes and reads its own rows), but ptxas
            // drops it in a converged warp and racecheck then flags the rows.
            k.bar_sync();
            k.place(zeroed);
        }
        let overs: Vec<Reg<Pred>> = (sides.iter())
            .map(|&(gather, buf)| gather.rows_over(k, buf, &rows))
            .collect();
        let over = (overs.into_iter())
            .reduce(|a, b| k.or_pred(a, b))
            .expect("a side");
        Some(k.vote_any(over))
    }
}

/// The lanes whose values one σ covers.
#[derive(Clone, Copy)]
pub(super) enum Across<'a> {
    /// Those the butterfly masks reach.
    Butterfly(&'a [u32]),
    /// The whole warp (one `redux`).
    Warp,
}

/// σ = 2^(`exponent` − e) for the largest |x| = 2^e·(1.…) of a B column (its
/// values in the lanes `across`): the column's scaled values stay below
/// 2^(`exponent` + 1) whatever their magnitude.
pub(super) fn column_sigma(
    k: &mut Kernel,
    values: &[Reg<F32>],
    across: Across,
    exponent: u32,
) -> Reg<F32> {
    let bits = column_magnitude(k, values, across);
    sigma_of_magnitude(k, bits, exponent)
}

/// The bits of the largest |x| of `values` in the lanes `across`
/// (magnitudes' bits order as their values, NaN above them all).
pub(super) fn column_magnitude(k: &mut Kernel, values: &[Reg<F32>], across: Across) -> Reg<U32> {
    let mut most = k.abs_f32(values[0]);
    for &x in &values[1..] {
        let a = k.abs_f32(x);
        most = k.max(most, a);
    }
    match across {
        Across::Butterfly(masks) => {
            for &mask in masks {
                let other = k.shfl_bfly(most, mask);
                most = k.max(most, other);
            }
            k.bitcast::<F32, U32>(most)
        }
        Across::Warp => {
            let bits = k.bitcast::<F32, U32>(most);
            k.redux_max_u32(bits)
        }
    }
}

/// [`column_sigma`]'s σ for a largest magnitude of bits `bits`.
pub(super) fn sigma_of_magnitude(k: &mut Kernel, bits: Reg<U32>, exponent: u32) -> Reg<F32> {
    let biased = k.shr(bits, 23u32);
    let field = k.sub(2 * BIAS + exponent, biased);
    let field = k.min(field, MAX_EXPONENT);
    let sigma = k.shl(field, 23u32);
    k.bitcast::<U32, F32>(sigma)
}

/// 1/σ for a power of two σ with biased exponent `f`: biased exponent 254 − f.
pub(super) fn unscale_of(k: &mut Kernel, sigma: Reg<F32>) -> Reg<F32> {
    let bits = k.bitcast::<F32, U32>(sigma);
    let field = k.shr(bits, 23u32);
    let inverse = k.sub(MAX_EXPONENT, field);
    let inverse = k.shl(inverse, 23u32);
    k.bitcast::<U32, F32>(inverse)
}

/// The hi and lo f16 parts of `(a, b)`, `a` in the low halves: hi = f16(x),
/// lo = f16(x − hi), so hi + lo is x to about 2⁻²² relative.
pub(super) fn f16_parts(k: &mut Kernel, a: Reg<F32>, b: Reg<F32>) -> (Reg<U32>, Reg<U32>) {
    let high = k.pack_f16x2(a, b);
    let (ha, hb) = k.split_halves(high);
    let (fa, fb) = (k.f16_to_f32(ha), k.f16_to_f32(hb));
    let (ra, rb) = (k.sub(a, fa), k.sub(b, fb));
    (high, k.pack_f16x2(ra, rb))
}

/// The hi (or, with `low`, lo) part of [`f16_parts`].
pub(super) fn f16_part(k: &mut Kernel, a: Reg<F32>, b: Reg<F32>, low: Reg<Pred>) -> Reg<U32> {
    let (high, rest) = f16_parts(k, a, b);
    k.selp(rest, high, low)
}

/// Every accumulator of `acc` times `factor`.
pub(super) fn scale_all(k: &mut Kernel, acc: &[[Reg<F32>; 4]], factor: Reg<F32>) {
    for c in acc.iter().flatten() {
        k.mul_to(*c, *c, factor);
    }
}

/// `at` in rows the 128-byte swizzle placed (when `swizzled`): 16-byte chunk
/// `c` of 128-byte line `l` (of shared memory, 1024-byte aligned) sits at
/// chunk `c ^ (l % 8)`, as the tensor copies put it.
pub(super) fn swizzled_if(k: &mut Kernel, swizzled: bool, at: Shared) -> Shared {
    if !swizzled {
        return at;
    }
    let address = match u32::try_from(at.offset).expect("tile row offsets fit a u32") {
        0 => at.base,
        offset => k.add(at.base, offset),
    };
    let line = k.shr(address, 3u32);
    // address ^ (line & 0x70): the line's low 3 bits onto the chunk's.
    Shared::at(k.lop3(address, line, 0x70u32, 0x78))
}

/// The tokens of a 16-token accumulate step lane quad `q` takes: `spacing ·
/// q + {0, 8, second, second + 8}`, two pairs `(r, r + 8)` whose weights are
/// one register each of the score's C fragments (row `r`'s halves), so they
/// reach the B fragments without byte permutes.
#[derive(Clone, Copy)]
pub(super) struct StepTokens {
    pub(super) spacing: u32,
    pub(super) second: u32,
}

impl StepTokens {
    pub(super) fn of(m: &MmaPlan) -> StepTokens {
        match m.value_rows.fragments() {
            // A gathering load's lanes then read four adjacent rows, whose
            // words meet fewer bank conflicts than every other row's.
            Some(_) => StepTokens {
                spacing: 1,
                second: 4,
            },
            // Tokens whose words pair by a known skew start on even rows.
            None => StepTokens {
                spacing: 2,
                second: 1,
            },
        }
    }

    /// The tokens' offsets from the lane's first, in the order the
    /// products take them.
    pub(super) fn offsets(self) -> [u32; 4] {
        [0, 8, self.second, self.second + 8]
    }
}
