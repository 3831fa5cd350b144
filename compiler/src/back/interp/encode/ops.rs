//! The numeric pieces of encoding and decoding, shared by the reference
//! encoder ([`encode_page`](super::encode_page), which walks a `TierLayout`
//! at run time) and the encoders `kv_format!` generates (which unroll that walk for
//! one tier at compile time, with constant bit offsets). Both call these for
//! every number they store or reconstruct, so their pages are byte-identical
//! by construction; only the field walking and the bit packing differ.
//!
//! Everything is `#[inline]`: the generated code calls these across crates
//! with constant sizes, which is what lets the compiler unroll them.

use crate::layout::{coeff_levels, coeff_max};
use crate::spec::{BitmapElem, DenseDtype, Fp8};
use half::{bf16, f16};

pub use super::hadamard::{fwht_normalized, srht_forward, srht_inverse};
pub use super::nearest::{best_direction, nearest, Dim, Fixed};

/// A page scale as stored: the measured one, or 1 where nothing was measured
/// (an all-zero page), so decoding never divides by or multiplies with 0.
#[inline]
pub fn scale_or_one(scale: f32) -> f32 {
    if scale > 0.0 {
        scale
    } else {
        1.0
    }
}

/// Length of the group's projection onto its (not exactly unit, once rounded
/// to f16) codeword: the least-squares radius, never negative.
#[inline]
pub fn radius_of(x: &[f32], c: &[f32]) -> f32 {
    let dot: f32 = x.iter().zip(c).map(|(a, b)| a * b).sum();
    let norm: f32 = c.iter().map(|v| v * v).sum();
    if norm > 0.0 {
        (dot / norm).max(0.0)
    } else {
        0.0
    }
}

/// The `bits`-bit code of radius `r` under page scale `scale`.
#[inline]
pub fn radius_code(r: f32, scale: f32, bits: u32) -> u32 {
    let levels = ((1u32 << bits) - 1) as f32;
    (r / scale * levels).round().clamp(0.0, levels) as u32
}

/// The radius a `bits`-bit code stands for under page scale `scale`.
#[inline]
pub fn radius_value(code: u32, scale: f32, bits: u32) -> f32 {
    code as f32 * scale / ((1u32 << bits) - 1) as f32
}

/// The page (or page-component) scale of symmetric `bits`-bit codes whose
/// largest magnitude is `max_abs`.
#[inline]
pub fn coeff_scale(max_abs: f32, bits: u32) -> f32 {
    scale_or_one(max_abs / coeff_max(bits) as f32)
}

/// An f16 scale as stored in an item (rounded, kept finite and non-zero) for
/// codes of largest magnitude `q` whose inputs reach `max_abs`.
#[inline]
pub fn half_scale(max_abs: f32, q: f32) -> f32 {
    scale_or_one(f16::from_f32((max_abs / q).min(f16::MAX.to_f32())).to_f32())
}

/// `x / scale` rounded to a symmetric `bits`-bit code, as two's-complement bits.
#[inline]
pub fn quantize(x: f32, scale: f32, bits: u32) -> u32 {
    let q = coeff_max(bits);
    let code = (x / scale).round().clamp(-(q as f32), q as f32) as i32;
    (code as u32) & ((1u32 << bits) - 1)
}

/// A `width`-bit two's-complement code as a number.
#[inline]
pub fn signed(bits: u32, width: u32) -> f32 {
    let unused = 32 - width;
    (((bits << unused) as i32) >> unused) as f32
}

#[inline]
pub fn f16_bits(v: f32) -> u32 {
    u32::from(f16::from_f32(v).to_bits())
}

#[inline]
pub fn bf16_bits(v: f32) -> u32 {
    u32::from(bf16::from_f32(v).to_bits())
}

#[inline]
pub fn f16_value(bits: u32) -> f32 {
    f16::from_bits(bits as u16).to_f32()
}

#[inline]
pub fn bf16_value(bits: u32) -> f32 {
    bf16::from_bits(bits as u16).to_f32()
}

/// Squared norm of a bitmap group: what decides which groups are kept.
#[inline]
pub fn energy(group: &[f32]) -> f32 {
    group.iter().map(|v| v * v).sum()
}

/// The `keep` groups of largest `energy` (ties: the lower index wins), in
/// ascending order, as the first `keep` entries of `order` (`energy.len()`
/// long, scratch). A selection, not a sort: only the kept set matters.
#[inline]
pub fn keep_largest<'o>(energy: &[f32], keep: usize, order: &'o mut [usize]) -> &'o [usize] {
    for (i, o) in order.iter_mut().enumerate() {
        *o = i;
    }
    // Larger energy first, then lower index: a strict total order, so the
    // first `keep` after the selection are exactly the kept set.
    order.select_nth_unstable_by(keep - 1, |&a, &b| {
        energy[b].total_cmp(&energy[a]).then(a.cmp(&b))
    });
    let kept = &mut order[..keep];
    kept.sort_unstable();
    kept
}

/// Largest magnitude of `values`.
#[inline]
pub fn max_abs<'v>(values: impl IntoIterator<Item = &'v f32>) -> f32 {
    values.into_iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// The f16 item scale of `bits`-bit coefficient codes of `y`.
#[inline]
pub fn coeff_item_scale(y: &[f32], bits: u32) -> f32 {
    half_scale(max_abs(y), coeff_max(bits) as f32)
}

/// A dense coordinate as stored (fp8: the code of `v`, already divided by
/// its scale).
#[inline]
pub fn dense_bits(dtype: DenseDtype, v: f32) -> u32 {
    match dtype {
        DenseDtype::F16 => f16_bits(v),
        DenseDtype::Bf16 => bf16_bits(v),
        DenseDtype::F32 => v.to_bits(),
        DenseDtype::Fp8e4m3 => Fp8::E4m3.encode(v),
        DenseDtype::Fp8e5m2 => Fp8::E5m2.encode(v),
    }
}

/// A stored dense coordinate as a number (fp8: before its scale).
#[inline]
pub fn dense_value(dtype: DenseDtype, raw: u32) -> f32 {
    match dtype {
        DenseDtype::F16 => f16_value(raw),
        DenseDtype::Bf16 => bf16_value(raw),
        DenseDtype::F32 => f32::from_bits(raw),
        DenseDtype::Fp8e4m3 => Fp8::E4m3.decode(raw),
        DenseDtype::Fp8e5m2 => Fp8::E5m2.decode(raw),
    }
}

/// The page or trained scale of fp8 elements whose inputs reach `max_abs`:
/// the largest maps to the format's largest finite number.
#[inline]
pub fn fp8_scale(max_abs: f32, format: Fp8) -> f32 {
    scale_or_one(max_abs / format.max())
}

/// Smallest and largest of `values` in `f32::total_cmp` order (-0 below +0);
/// `(+inf, -inf)` for none.
#[inline]
pub fn min_max<'v>(values: impl IntoIterator<Item = &'v f32>) -> (f32, f32) {
    values
        .into_iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (
                if v.total_cmp(&lo).is_lt() { v } else { lo },
                if v.total_cmp(&hi).is_gt() { v } else { hi },
            )
        })
}

/// `range` widened to cover `values` ([`min_max`]'s order): the range of a
/// page measured item by item.
#[inline]
pub fn widen_range<'v>(range: (f32, f32), values: impl IntoIterator<Item = &'v f32>) -> (f32, f32) {
    let (lo, hi) = min_max(values);
    (
        if lo.total_cmp(&range.0).is_lt() {
            lo
        } else {
            range.0
        },
        if hi.total_cmp(&range.1).is_gt() {
            hi
        } else {
            range.1
        },
    )
}

/// The f32 scale and zero point of unsigned `bits`-bit codes over
/// `[lo, hi]` (a page's, or a component's over a page or the training
/// data): `z = lo`, `s = (hi - lo) / (2^bits - 1)` (1 when 0); `(1, 0)`
/// when nothing was measured.
#[inline]
pub fn zero_point_scale(lo: f32, hi: f32, bits: u32) -> (f32, f32) {
    if lo > hi {
        return (1.0, 0.0);
    }
    (scale_or_one((hi - lo) / coeff_levels(bits) as f32), lo)
}

/// The f16 scale and zero point stored in an item (or per channel group)
/// for unsigned `bits`-bit codes over `[lo, hi]`: `z = f16(lo)`, then
/// `half_scale(hi - z, 2^bits - 1)`. Returns `(s, z)` as f32.
#[inline]
pub fn half_zero_point_scale(lo: f32, hi: f32, bits: u32) -> (f32, f32) {
    let max = f16::MAX.to_f32();
    let z = f16::from_f32(lo.clamp(-max, max)).to_f32();
    (half_scale(hi - z, coeff_levels(bits) as f32), z)
}

/// `(x - zero) / scale` rounded to an unsigned `bits`-bit code.
#[inline]
pub fn quantize_unsigned(x: f32, scale: f32, zero: f32, bits: u32) -> u32 {
    let levels = coeff_levels(bits) as f32;
    ((x - zero) / scale).round().clamp(0.0, levels) as u32
}

/// The number an unsigned code stands for: `code · s + z`, one rounding.
#[inline]
pub fn unsigned_value(code: u32, scale: f32, zero: f32) -> f32 {
    (code as f32).mul_add(scale, zero)
}

/// A bitmap item: keeps the `elems.len() / g` groups of `y` (groups of `g`)
/// of largest energy, sets their bits in `mask` (32 groups per word) and
/// stores their elements in `elems`: f16 bits, or int8 codes under the
/// returned f16 item scale. `energy` and `order` are scratch, one per group.
#[inline]
pub fn bitmap_encode(
    y: &[f32],
    g: usize,
    elem: BitmapElem,
    scratch: (&mut [f32], &mut [usize]),
    mask: &mut [u32],
    elems: &mut [u32],
) -> Option<f32> {
    let (energies, order) = scratch;
    for (e, group) in energies.iter_mut().zip(y.chunks_exact(g)) {
        *e = energy(group);
    }
    let kept = keep_largest(energies, elems.len() / g, order);
    mask.fill(0);
    for &j in kept.iter() {
        mask[j / 32] |= 1 << (j % 32);
    }
    let scale = elem.scaled().then(|| {
        let max = max_abs(kept.iter().flat_map(|&j| &y[j * g..(j + 1) * g]));
        half_scale(max, elem.code_max())
    });
    for (e, out) in elems.iter_mut().enumerate() {
        let v = y[kept[e / g] * g + e % g];
        *out = match (scale, elem.fp8()) {
            (Some(s), Some(format)) => format.encode(v / s),
            (Some(s), None) => quantize(v, s, 8),
            (None, _) => f16_bits(v),
        };
    }
    scale
}

/// The coordinates `y` (zero where a group was dropped) of a bitmap item's
/// `mask` words and kept `elems` (groups of `g`); `scale` is the int8 scale.
#[inline]
pub fn bitmap_decode(
    mask: &[u32],
    elems: &[u32],
    g: usize,
    elem: BitmapElem,
    scale: f32,
    y: &mut [f32],
) {
    let mut slot = 0usize;
    for (j, group) in y.chunks_exact_mut(g).enumerate() {
        if (mask[j / 32] >> (j % 32)) & 1 == 1 {
            for (v, &raw) in group.iter_mut().zip(&elems[slot * g..]) {
                *v = match elem {
                    BitmapElem::F16 => f16_value(raw),
                    BitmapElem::Int8 => signed(raw, 8) * scale,
                    BitmapElem::Fp8e4m3 => Fp8::E4m3.decode(raw) * scale,
                    BitmapElem::Fp8e5m2 => Fp8::E5m2.decode(raw) * scale,
                };
            }
            slot += 1;
        }
    }
}

/// PCA coordinates `out = Bᵀ (x − mean)` with a row-major `head_dim × rank`
/// basis (`rank = out.len()`).
#[inline]
pub fn pca_forward(basis: &[f32], mean: &[f32], x: &[f32], out: &mut [f32]) {
    let rank = out.len();
    out.fill(0.0);
    for ((&xi, &mi), row) in x.iter().zip(mean).zip(basis.chunks_exact(rank)) {
        let centered = xi - mi;
        for (c, &b) in out.iter_mut().zip(row) {
            *c += b * centered;
        }
    }
}

/// PCA reconstruction `out = mean + B y` (`head_dim = out.len()`).
#[inline]
pub fn pca_inverse(basis: &[f32], mean: &[f32], y: &[f32], out: &mut [f32]) {
    let rank = y.len();
    for ((o, &m), row) in out.iter_mut().zip(mean).zip(basis.chunks_exact(rank)) {
        *o = m + row.iter().zip(y).map(|(b, c)| b * c).sum::<f32>();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_largest_is_the_stable_sort_selection() {
        // The trait the encoders rely on: the kept set is that of a stable
        // descending sort by energy, whatever the ties.
        let energies: [Vec<f32>; 3] = [
            vec![1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, 5.0],
            vec![0.0; 8],
            vec![1.0, -0.0, 0.0, 1.0, 4.0, 4.0, 1.0, 0.5],
        ];
        for energy in &energies {
            for keep in 1..=energy.len() {
                let mut by_sort: Vec<usize> = (0..energy.len()).collect();
                by_sort.sort_by(|&a, &b| energy[b].total_cmp(&energy[a]));
                by_sort.truncate(keep);
                by_sort.sort_unstable();
                let mut order = vec![0; energy.len()];
                assert_eq!(keep_largest(energy, keep, &mut order), by_sort);
            }
        }
    }

    #[test]
    fn quantize_is_symmetric_and_saturates() {
        assert_eq!(quantize(0.5, 1.0, 4), 1);
        assert_eq!(quantize(-0.5, 1.0, 4), 0xF);
        assert_eq!(quantize(100.0, 1.0, 4), 7);
        assert_eq!(quantize(-1000.0, 1.0, 8), (-127i32 as u32) & 0xFF);
        assert_eq!(signed(quantize(-3.2, 1.0, 4), 4), -3.0);
    }
}
