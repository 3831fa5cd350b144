//! The encode kernel's building blocks: CTA-strided and serial loops, shared
//! and table addressing, packing bits into the shared item image, and the
//! CPU encoder's numeric helpers (`interp::encode::ops`) instruction for
//! instruction: every f32 operation rounds to nearest (`.rn`, never
//! contracted into an fma), `f32::round` rounds half away from zero, `as`
//! casts saturate and send NaN to 0, f16/bf16 round to nearest even.

use super::super::builder::{Cmp, Global, Kernel, Op, Pred, Reg, Shared, F32, U32, U64};
use crate::spec::Fp8;

/// The registers every phase addresses from.
pub struct Ctx {
    pub tid: Reg<U32>,
    pub threads: u32,
    /// Dynamic shared memory base.
    pub smem: Reg<U32>,
    /// This job's kv head's tables (global f32).
    pub tables: Reg<U64>,
    /// The job's source and destination pages (global).
    pub src: Reg<U64>,
    pub dst: Reg<U64>,
}

impl Ctx {
    /// Shared address of `region + 4 * index`.
    pub fn shared_word(&self, k: &mut Kernel, region: u32, index: Reg<U32>) -> Shared {
        let at = k.mad_lo(index, 4u32, self.smem);
        Shared::at(at).plus(i64::from(region))
    }

    /// Global address of float `at + index` of this head's tables.
    pub fn table(&self, k: &mut Kernel, at: u32, index: Reg<U32>) -> Global {
        let address = k.global_index(self.tables, index, 4);
        Global::at(address).plus(4 * i64::from(at))
    }

    /// Float `at` of this head's tables.
    pub fn table_value(&self, k: &mut Kernel, at: u32, index: Reg<U32>) -> Reg<F32> {
        let address = self.table(k, at, index);
        k.ld_global_nc(address)
    }
}

/// `body(w)` for every `w` in `0..count`, spread over the CTA's threads
/// (thread `t` takes `t, t + threads, ...`).
pub fn for_each(
    k: &mut Kernel,
    ctx: &Ctx,
    count: impl Into<Op<U32>>,
    body: impl FnOnce(&mut Kernel, Reg<U32>),
) {
    k.counted(ctx.tid, count, ctx.threads, body);
}

/// `body(i)` for `i` in `0..count` in order, in one thread.
pub fn serial(k: &mut Kernel, count: impl Into<Op<U32>>, body: impl FnOnce(&mut Kernel, Reg<U32>)) {
    k.counted(0u32, count, 1u32, body);
}

/// `(w / n, w % n)`.
pub fn split(k: &mut Kernel, w: Reg<U32>, n: u32) -> (Reg<U32>, Reg<U32>) {
    let q = k.div_u32(w, n);
    let r = k.rem_u32(w, n);
    (q, r)
}

/// `dst = p ? value : dst`.
pub fn assign_if<T: super::super::builder::Bits32>(
    k: &mut Kernel,
    dst: Reg<T>,
    value: impl Into<Op<T>>,
    p: Reg<Pred>,
) {
    let chosen = k.selp(value, dst, p);
    k.assign(dst, chosen);
}

/// ORs the low `width` bits of `value` (already within `width` bits) into
/// the shared item image at bit `bit` (from the image's start): race-free
/// between threads, since every bit is set by one element only and ORs
/// commute.
pub fn write_bits(
    k: &mut Kernel,
    ctx: &Ctx,
    image: u32,
    bit: Reg<U32>,
    width: u32,
    value: Reg<U32>,
) {
    let word = k.shr(bit, 5u32);
    let shift = k.and(bit, 31u32);
    let at = ctx.shared_word(k, image, word);
    let low = k.shl(value, shift);
    k.red_shared_or(at, low);
    if width > 1 {
        let end = k.add(shift, width);
        let spills = k.setp(Cmp::Gt, end, 32u32);
        let rest = k.sub(32u32, shift);
        let high = k.shr(value, rest);
        k.guarded(spills, true, |k| k.red_shared_or(at.plus(4), high));
    }
}

/// Bit `bit` of item `item` of a chunk image of items of `stride` bytes.
pub fn item_bit(k: &mut Kernel, item: Reg<U32>, stride: u32, bit: Reg<U32>) -> Reg<U32> {
    k.mad_lo(item, 8 * stride, bit)
}

// ---- numbers, as `interp::encode::ops` computes them ----------------------

/// `f32::round`: half away from zero, exactly (NaN and ±∞ unchanged).
pub fn round(k: &mut Kernel, x: Reg<F32>) -> Reg<F32> {
    let t = k.trunc_f32(x);
    let fraction = k.sub(x, t);
    let fraction = k.abs_f32(fraction);
    let up = k.setp(Cmp::Ge, fraction, 0.5f32);
    let negative = k.setp(Cmp::Lt, x, 0.0f32);
    let step = k.selp(-1.0f32, 1.0f32, negative);
    let away = k.add(t, step);
    k.selp(away, t, up)
}

/// `x.clamp(lo, hi)`: NaN stays NaN.
pub fn clamp(k: &mut Kernel, x: Reg<F32>, lo: f32, hi: f32) -> Reg<F32> {
    let below = k.setp(Cmp::Lt, x, lo);
    let x = k.selp(lo, x, below);
    let above = k.setp(Cmp::Gt, x, hi);
    k.selp(hi, x, above)
}

/// `scale_or_one`: `s` if `s > 0`, else 1 (NaN too).
pub fn scale_or_one(k: &mut Kernel, s: Reg<F32>) -> Reg<F32> {
    let positive = k.setp(Cmp::Gt, s, 0.0f32);
    k.selp(s, 1.0f32, positive)
}

/// `m.max(v.abs())` of a fold from 0 as the bits an unsigned `max` orders
/// like the float (NaN ignored, as `f32::max` does).
pub fn magnitude_bits(k: &mut Kernel, v: Reg<F32>) -> Reg<U32> {
    let a = k.abs_f32(v);
    let a = k.max(a, 0.0f32);
    k.bitcast(a)
}

/// `quantize(x, scale, bits)`: `x / scale` rounded to a symmetric `bits`-bit
/// code, two's-complement bits.
pub fn quantize(k: &mut Kernel, x: Reg<F32>, scale: Reg<F32>, bits: u32) -> Reg<U32> {
    let q = coeff_max(bits) as f32;
    let t = k.div_f32(x, scale);
    let r = round(k, t);
    let r = clamp(k, r, -q, q);
    let code = k.f32_to_s32_trunc(r);
    let code: Reg<U32> = k.bitcast(code);
    k.and(code, (1u32 << bits) - 1)
}

/// `radius_code(r, scale, bits)`.
pub fn radius_code(k: &mut Kernel, r: Reg<F32>, scale: Reg<F32>, bits: u32) -> Reg<U32> {
    let levels = ((1u32 << bits) - 1) as f32;
    let t = k.div_f32(r, scale);
    let t = k.mul(t, levels);
    let t = round(k, t);
    let t = clamp(k, t, 0.0, levels);
    k.f32_to_u32_trunc(t)
}

/// `half_scale(max_abs, q)`: the scale (f32) and its stored f16 bits.
pub fn half_scale(k: &mut Kernel, max_abs: Reg<F32>, q: f32) -> (Reg<F32>, Reg<U32>) {
    let s = k.div_f32(max_abs, q);
    let s = k.min(s, half::f16::MAX.to_f32());
    let h = k.f32_to_f16(s);
    let value = k.f16_to_f32(h);
    let positive = k.setp(Cmp::Gt, value, 0.0f32);
    let bits = k.widen16(h);
    let one = u32::from(half::f16::ONE.to_bits());
    (k.selp(value, 1.0f32, positive), k.selp(bits, one, positive))
}

/// Largest magnitude of a symmetric `bits`-bit code.
pub fn coeff_max(bits: u32) -> i32 {
    crate::layout::coeff_max(bits)
}

/// Largest unsigned (zero-point) code of `bits` bits.
pub fn coeff_levels(bits: u32) -> u32 {
    crate::layout::coeff_levels(bits)
}

/// The bits of `v` as a key whose unsigned order is `f32::total_cmp`'s
/// (negative numbers' bits inverted, non-negative ones' sign set).
pub fn order_key(k: &mut Kernel, v: Reg<F32>) -> Reg<U32> {
    let bits: Reg<U32> = k.bitcast(v);
    let sign = k.shr(bits, 31u32);
    let mask = k.sub(0u32, sign);
    let mask = k.or(mask, 0x8000_0000u32);
    k.xor(bits, mask)
}

/// The float of an [`order_key`].
pub fn from_order_key(k: &mut Kernel, key: Reg<U32>) -> Reg<F32> {
    let top = k.shr(key, 31u32);
    let mask = k.sub(top, 1u32);
    let mask = k.or(mask, 0x8000_0000u32);
    let bits = k.xor(key, mask);
    k.bitcast(bits)
}

/// The order key of `f32::INFINITY` (where a minimum starts) and of
/// `f32::NEG_INFINITY` (where a maximum starts).
pub const KEY_INFINITY: u32 = 0xFF80_0000;
pub const KEY_NEG_INFINITY: u32 = 0x007F_FFFF;

/// `zero_point_scale(lo, hi, bits)` for a measured range: `(s, z)`.
pub fn zero_point_scale(
    k: &mut Kernel,
    lo: Reg<F32>,
    hi: Reg<F32>,
    bits: u32,
) -> (Reg<F32>, Reg<F32>) {
    let range = k.sub(hi, lo);
    let s = k.div_f32(range, coeff_levels(bits) as f32);
    (scale_or_one(k, s), lo)
}

/// `half_zero_point_scale(lo, hi, bits)`: the scale and zero point (f32) and
/// their stored f16 bits, `(s, s bits, z, z bits)`.
pub fn half_zero_point_scale(
    k: &mut Kernel,
    lo: Reg<F32>,
    hi: Reg<F32>,
    bits: u32,
) -> (Reg<F32>, Reg<U32>, Reg<F32>, Reg<U32>) {
    let max = half::f16::MAX.to_f32();
    let lo = clamp(k, lo, -max, max);
    let h = k.f32_to_f16(lo);
    let z = k.f16_to_f32(h);
    let z_bits = k.widen16(h);
    let range = k.sub(hi, z);
    let (s, s_bits) = half_scale(k, range, coeff_levels(bits) as f32);
    (s, s_bits, z, z_bits)
}

/// `quantize_unsigned(x, scale, zero, bits)`.
pub fn quantize_unsigned(
    k: &mut Kernel,
    x: Reg<F32>,
    scale: Reg<F32>,
    zero: Reg<F32>,
    bits: u32,
) -> Reg<U32> {
    let levels = coeff_levels(bits) as f32;
    let t = k.sub(x, zero);
    let t = k.div_f32(t, scale);
    let t = round(k, t);
    let t = clamp(k, t, 0.0, levels);
    k.f32_to_u32_trunc(t)
}

/// `Fp8::encode(v)`, step for step on the f32 bits.
pub fn fp8_encode(k: &mut Kernel, format: Fp8, v: Reg<F32>) -> Reg<U32> {
    let (man_bits, bias, max_code) = format.encoding();
    let bits: Reg<U32> = k.bitcast(v);
    let sign = k.shr(bits, 24u32);
    let sign = k.and(sign, 0x80u32);
    let a = k.and(bits, 0x7FFF_FFFFu32);
    let nan = k.setp(Cmp::Gt, a, 0x7F80_0000u32);
    // Subnormal results: the magnitude in steps, to the nearest even integer.
    let magnitude: Reg<F32> = k.bitcast(a);
    let steps = k.mul(magnitude, format.subnormal_steps());
    let small = k.f32_to_u32_even(steps);
    // Normal results: rebiased exponent and kept mantissa, rounded up when
    // the dropped bits are over half, or half and the kept ones odd.
    let drop = 23 - man_bits;
    let rest = k.and(a, (1u32 << drop) - 1);
    let kept = k.shr(a, drop);
    let odd = k.and(kept, 1u32);
    let over = k.setp(Cmp::Gt, rest, 1u32 << (drop - 1));
    let tie = k.setp(Cmp::Eq, rest, 1u32 << (drop - 1));
    let odd = k.setp(Cmp::Eq, odd, 1u32);
    let tie_up = k.and_pred(tie, odd);
    let up = k.or_pred(over, tie_up);
    let up = k.selp(1u32, 0u32, up);
    let normal = k.sub(kept, (127 - bias) << man_bits);
    let normal = k.add(normal, up);
    let is_small = k.setp(Cmp::Lt, a, format.min_normal_bits());
    let code = k.selp(small, normal, is_small);
    let code = k.min(code, max_code);
    let code = k.selp(0x7Fu32, code, nan);
    k.or(sign, code)
}
