//! The numbers of `interp::encode::ops` as scalar CLIF, operation for
//! operation (`.rn` f32 arithmetic, never fused), plus the loops, loads and
//! stores the encoder is built from.
//!
//! Rust's float library calls become exact sequences: `f32::round` (half
//! away from zero), `clamp` and `max`/`min` (NaN kept, resp. ignored, as
//! Rust does), `as` casts (saturating, NaN to 0), and `half`'s f16 / bf16
//! rounding (to nearest even, `half`'s NaN bits) in integer ops.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{self, types, BlockArg, InstBuilder};
use cranelift_frontend::Variable;

use crate::back::clif::expr::{writable, Fx};
use crate::layout::coeff_levels;
use crate::spec::Fp8;

/// An index known at compile time, or computed at run time (an i32).
#[derive(Debug, Clone, Copy)]
pub(super) enum Ix {
    K(u32),
    V(ir::Value),
}

impl Fx<'_> {
    pub(super) fn f32c(&mut self, v: f32) -> ir::Value {
        self.b.ins().f32const(v)
    }

    pub(super) fn i32c(&mut self, v: u32) -> ir::Value {
        self.iconst(v)
    }

    /// The index as an i32 value.
    pub(super) fn ix(&mut self, ix: Ix) -> ir::Value {
        match ix {
            Ix::K(k) => self.iconst(k),
            Ix::V(v) => v,
        }
    }

    /// `a * k + c` on indices (u32, wrapping), folded when `a` is known.
    pub(super) fn affine(&mut self, a: Ix, k: u32, c: u32) -> Ix {
        match a {
            Ix::K(a) => Ix::K(a.wrapping_mul(k).wrapping_add(c)),
            Ix::V(v) => {
                let m = if k == 1 {
                    v
                } else {
                    self.b.ins().imul_imm_u(v, i64::from(k))
                };
                Ix::V(if c == 0 {
                    m
                } else {
                    self.b.ins().iadd_imm_u(m, i64::from(c))
                })
            }
        }
    }

    pub(super) fn add_ix(&mut self, a: Ix, b: Ix) -> Ix {
        match (a, b) {
            (Ix::K(a), Ix::K(b)) => Ix::K(a.wrapping_add(b)),
            (Ix::K(k), Ix::V(v)) | (Ix::V(v), Ix::K(k)) => self.affine(Ix::V(v), 1, k),
            (Ix::V(a), Ix::V(b)) => Ix::V(self.b.ins().iadd(a, b)),
        }
    }

    /// The address of element `ix` of `scale` bytes from `base` (an i64),
    /// with a constant byte offset: `(address, offset)`.
    pub(super) fn slot_at(&mut self, base: ir::Value, ix: Ix, scale: u32) -> (ir::Value, i32) {
        match ix {
            Ix::K(k) => (base, (k * scale) as i32),
            Ix::V(v) => {
                let wide = self.b.ins().uextend(types::I64, v);
                let scaled = if scale == 1 {
                    wide
                } else {
                    self.b.ins().imul_imm_u(wide, i64::from(scale))
                };
                (self.b.ins().iadd(base, scaled), 0)
            }
        }
    }

    /// `base + offset + ix * scale` as an i64 address.
    pub(super) fn row(&mut self, base: ir::Value, ix: Ix, scale: u32, offset: u32) -> ir::Value {
        let (at, k) = self.slot_at(base, ix, scale);
        let total = i64::from(k) + i64::from(offset);
        if total == 0 {
            at
        } else {
            self.b.ins().iadd_imm_s(at, total)
        }
    }

    /// The 32-bit value of type `ty` at element `ix` of `base` (4 bytes each).
    pub(super) fn ld(&mut self, ty: ir::Type, base: ir::Value, ix: Ix) -> ir::Value {
        let (at, offset) = self.slot_at(base, ix, 4);
        self.b.ins().load(ty, writable(), at, offset)
    }

    pub(super) fn ldf(&mut self, base: ir::Value, ix: Ix) -> ir::Value {
        self.ld(types::F32, base, ix)
    }

    /// The f32 at element `ix` of `scale` bytes each (a strided column).
    pub(super) fn ldf_scaled(&mut self, base: ir::Value, ix: Ix, scale: u32) -> ir::Value {
        let (at, offset) = self.slot_at(base, ix, scale);
        self.b.ins().load(types::F32, writable(), at, offset)
    }

    pub(super) fn ldi(&mut self, base: ir::Value, ix: Ix) -> ir::Value {
        self.ld(types::I32, base, ix)
    }

    /// Stores a 32-bit value at element `ix` of `base`.
    pub(super) fn st(&mut self, base: ir::Value, ix: Ix, v: ir::Value) {
        let (at, offset) = self.slot_at(base, ix, 4);
        self.b.ins().store(writable(), v, at, offset);
    }

    /// `for i in 0..end` (`end` an i32 at run time): `body(fx, i)` emits the
    /// body; returns with the exit block current.
    pub(super) fn loop_to(&mut self, end: ir::Value, body: impl FnOnce(&mut Self, ir::Value)) {
        let header = self.b.create_block();
        let block = self.b.create_block();
        let exit = self.b.create_block();
        let i = self.b.append_block_param(header, types::I32);
        let zero = self.iconst(0);
        self.b.ins().jump(header, &[BlockArg::Value(zero)]);
        self.switch_to(header);
        let more = self.b.ins().icmp(IntCC::UnsignedLessThan, i, end);
        self.b.ins().brif(more, block, &[], exit, &[]);
        self.switch_to(block);
        body(self, i);
        let next = self.b.ins().iadd_imm_u(i, 1);
        self.b.ins().jump(header, &[BlockArg::Value(next)]);
        self.switch_to(exit);
    }

    /// `for i in 0..n` for a compile-time `n`: nothing for 0, the body once
    /// with a known index for 1, else a loop.
    pub(super) fn each(&mut self, n: u32, body: impl FnOnce(&mut Self, Ix)) {
        match n {
            0 => {}
            1 => body(self, Ix::K(0)),
            _ => {
                let end = self.iconst(n);
                self.loop_to(end, |fx, i| body(fx, Ix::V(i)));
            }
        }
    }

    /// `for i in 0..n`, unrolled with known indices when `n` is at most
    /// `unroll` (short inner sums), else a loop.
    pub(super) fn each_unrolled(
        &mut self,
        n: u32,
        unroll: u32,
        mut body: impl FnMut(&mut Self, Ix),
    ) {
        if n <= unroll {
            for k in 0..n {
                body(self, Ix::K(k));
            }
        } else {
            self.each(n, body);
        }
    }

    /// A mutable local of type `ty` starting at `init`.
    pub(super) fn var(&mut self, ty: ir::Type, init: ir::Value) -> Variable {
        let v = self.b.declare_var(ty);
        self.b.def_var(v, init);
        v
    }

    pub(super) fn get(&mut self, v: Variable) -> ir::Value {
        self.b.use_var(v)
    }

    pub(super) fn set(&mut self, v: Variable, x: ir::Value) {
        self.b.def_var(v, x);
    }

    /// `f32::max`: the larger, the other operand where one is NaN.
    pub(super) fn rust_max(&mut self, a: ir::Value, b: ir::Value) -> ir::Value {
        let greater = self.b.ins().fcmp(FloatCC::GreaterThan, b, a);
        let a_nan = self.b.ins().fcmp(FloatCC::Unordered, a, a);
        let pick_b = self.b.ins().bor(greater, a_nan);
        self.b.ins().select(pick_b, b, a)
    }

    /// `f32::min`: the smaller, the other operand where one is NaN.
    pub(super) fn rust_min(&mut self, a: ir::Value, b: ir::Value) -> ir::Value {
        let less = self.b.ins().fcmp(FloatCC::LessThan, b, a);
        let a_nan = self.b.ins().fcmp(FloatCC::Unordered, a, a);
        let pick_b = self.b.ins().bor(less, a_nan);
        self.b.ins().select(pick_b, b, a)
    }

    /// `f32::clamp`: NaN stays NaN.
    pub(super) fn clamp(&mut self, x: ir::Value, lo: f32, hi: f32) -> ir::Value {
        let lo = self.f32c(lo);
        let hi = self.f32c(hi);
        let below = self.b.ins().fcmp(FloatCC::LessThan, x, lo);
        let x = self.b.ins().select(below, lo, x);
        let above = self.b.ins().fcmp(FloatCC::GreaterThan, x, hi);
        self.b.ins().select(above, hi, x)
    }

    /// `f32::round`: to nearest, half away from zero. `x - trunc(x)` is
    /// exact, so the half test is too; past 2^23 `x` is its own trunc.
    pub(super) fn round(&mut self, x: ir::Value) -> ir::Value {
        let t = self.b.ins().trunc(x);
        let fraction = self.b.ins().fsub(x, t);
        let fraction = self.b.ins().fabs(fraction);
        let half = self.f32c(0.5);
        let up = self
            .b
            .ins()
            .fcmp(FloatCC::GreaterThanOrEqual, fraction, half);
        let one = self.f32c(1.0);
        let step = self.b.ins().fcopysign(one, x);
        let away = self.b.ins().fadd(t, step);
        self.b.ins().select(up, away, t)
    }

    /// `ops::scale_or_one`: `s` if positive, else 1 (NaN included).
    pub(super) fn scale_or_one(&mut self, s: ir::Value) -> ir::Value {
        let zero = self.f32c(0.0);
        let positive = self.b.ins().fcmp(FloatCC::GreaterThan, s, zero);
        let one = self.f32c(1.0);
        self.b.ins().select(positive, s, one)
    }

    pub(super) fn float_bits(&mut self, x: ir::Value) -> ir::Value {
        let flags = ir::MemFlagsData::new().with_endianness(ir::Endianness::Little);
        self.b.ins().bitcast(types::I32, flags, x)
    }

    /// `half::f16::from_f32(x).to_bits()` (F16C gives the same bits):
    /// round to nearest even, overflow to infinity, subnormals rounded,
    /// NaN quieted keeping the top payload bits.
    pub(super) fn f16_bits(&mut self, x: ir::Value) -> ir::Value {
        let x = self.float_bits(x);
        let sign = self.b.ins().ushr_imm_u(x, 16);
        let sign = self.b.ins().band_imm_u(sign, 0x8000);
        let exp = self.b.ins().ushr_imm_u(x, 23);
        let exp = self.b.ins().band_imm_u(exp, 0xFF);
        let man = self.b.ins().band_imm_u(x, 0x007F_FFFF);
        // Infinity or NaN.
        let man_high = self.b.ins().ushr_imm_u(man, 13);
        let has_man = self.b.ins().icmp_imm_u(IntCC::NotEqual, man, 0);
        let nan_bit = self.b.ins().uextend(types::I32, has_man);
        let nan_bit = self.b.ins().ishl_imm_u(nan_bit, 9);
        let special = self.b.ins().bor_imm_u(sign, 0x7C00);
        let special = self.b.ins().bor(special, nan_bit);
        let special = self.b.ins().bor(special, man_high);
        // Normal: rebias, round on bit 12 with the sticky bits.
        let half_exp = self.b.ins().iadd_imm_s(exp, -112);
        let exp_field = self.b.ins().ishl_imm_u(half_exp, 10);
        let normal = self.b.ins().bor(sign, exp_field);
        let normal = self.b.ins().bor(normal, man_high);
        let round_bit = self.b.ins().band_imm_u(man, 0x1000);
        let sticky = self.b.ins().band_imm_u(man, 0x2FFF);
        let normal = self.round_up(normal, round_bit, sticky);
        // Subnormal (-10 <= half_exp <= 0): shift by 14 - half_exp (14..=24).
        let full = self.b.ins().bor_imm_u(man, 0x0080_0000);
        let fourteen = self.iconst(14);
        let shift = self.b.ins().isub(fourteen, half_exp);
        let cap = self.iconst(24);
        let shift = self.b.ins().umin(shift, cap);
        let sub_man = self.b.ins().ushr(full, shift);
        let one = self.iconst(1);
        let shift_less = self.b.ins().iadd_imm_s(shift, -1);
        let round = self.b.ins().ishl(one, shift_less);
        let round_bit = self.b.ins().band(full, round);
        let three = self.b.ins().imul_imm_u(round, 3);
        let below = self.b.ins().iadd_imm_s(three, -1);
        let sticky = self.b.ins().band(full, below);
        let sub = self.b.ins().bor(sign, sub_man);
        let sub = self.round_up(sub, round_bit, sticky);
        // Pick by the exponent.
        let is_special = self.b.ins().icmp_imm_u(IntCC::Equal, exp, 0xFF);
        let overflow = self
            .b
            .ins()
            .icmp_imm_s(IntCC::SignedGreaterThanOrEqual, half_exp, 0x1F);
        let is_sub = self
            .b
            .ins()
            .icmp_imm_s(IntCC::SignedLessThanOrEqual, half_exp, 0);
        let underflow = self
            .b
            .ins()
            .icmp_imm_s(IntCC::SignedLessThan, half_exp, -10);
        let infinity = self.b.ins().bor_imm_u(sign, 0x7C00);
        let v = self.b.ins().select(is_sub, sub, normal);
        let v = self.b.ins().select(underflow, sign, v);
        let v = self.b.ins().select(overflow, infinity, v);
        self.b.ins().select(is_special, special, v)
    }

    /// `v + 1` when the round bit and a sticky bit (or the round bit's
    /// neighbour) are set: round to nearest, ties to even.
    fn round_up(&mut self, v: ir::Value, round_bit: ir::Value, sticky: ir::Value) -> ir::Value {
        let r = self.b.ins().icmp_imm_u(IntCC::NotEqual, round_bit, 0);
        let s = self.b.ins().icmp_imm_u(IntCC::NotEqual, sticky, 0);
        let up = self.b.ins().band(r, s);
        let up = self.b.ins().uextend(types::I32, up);
        self.b.ins().iadd(v, up)
    }

    /// `half::bf16::from_f32(x).to_bits()`: to nearest even, NaN quieted.
    pub(super) fn bf16_bits(&mut self, x: ir::Value) -> ir::Value {
        let x = self.float_bits(x);
        let high = self.b.ins().ushr_imm_u(x, 16);
        let magnitude = self.b.ins().band_imm_u(x, 0x7FFF_FFFF);
        let nan = self
            .b
            .ins()
            .icmp_imm_u(IntCC::UnsignedGreaterThan, magnitude, 0x7F80_0000);
        let quiet = self.b.ins().bor_imm_u(high, 0x0040);
        let round_bit = self.b.ins().band_imm_u(x, 0x8000);
        let sticky = self.b.ins().band_imm_u(x, 0x0001_7FFF);
        let rounded = self.round_up(high, round_bit, sticky);
        let rounded = self.b.ins().band_imm_u(rounded, 0xFFFF);
        self.b.ins().select(nan, quiet, rounded)
    }

    /// `ops::half_scale`: the f16 item scale of codes of largest magnitude
    /// `q` whose inputs reach `max_abs`.
    pub(super) fn half_scale(&mut self, max_abs: ir::Value, q: f32) -> ir::Value {
        let q = self.f32c(q);
        let s = self.b.ins().fdiv(max_abs, q);
        let limit = self.f32c(half::f16::MAX.to_f32());
        let s = self.rust_min(s, limit);
        let bits = self.f16_bits(s);
        let s = self.half_to_float(bits, false);
        self.scale_or_one(s)
    }

    /// `ops::quantize`: `x / scale` rounded to a symmetric `bits`-bit code,
    /// as two's-complement bits.
    pub(super) fn quantize(&mut self, x: ir::Value, scale: ir::Value, bits: u32) -> ir::Value {
        let q = crate::layout::coeff_max(bits) as f32;
        let v = self.b.ins().fdiv(x, scale);
        let v = self.round(v);
        let v = self.clamp(v, -q, q);
        let code = self.b.ins().fcvt_to_sint_sat(types::I32, v);
        self.b.ins().band_imm_u(code, (1i64 << bits) - 1)
    }

    /// `ops::radius_code`.
    pub(super) fn radius_code(&mut self, r: ir::Value, scale: ir::Value, bits: u32) -> ir::Value {
        let levels = ((1u32 << bits) - 1) as f32;
        let v = self.b.ins().fdiv(r, scale);
        let l = self.f32c(levels);
        let v = self.b.ins().fmul(v, l);
        let v = self.round(v);
        let v = self.clamp(v, 0.0, levels);
        self.b.ins().fcvt_to_uint_sat(types::I32, v)
    }

    /// `ops::quantize_unsigned`: `(x - zero) / scale` rounded to an
    /// unsigned `bits`-bit code.
    pub(super) fn quantize_unsigned(
        &mut self,
        x: ir::Value,
        scale: ir::Value,
        zero: ir::Value,
        bits: u32,
    ) -> ir::Value {
        let levels = coeff_levels(bits) as f32;
        let d = self.b.ins().fsub(x, zero);
        let v = self.b.ins().fdiv(d, scale);
        let v = self.round(v);
        let v = self.clamp(v, 0.0, levels);
        self.b.ins().fcvt_to_uint_sat(types::I32, v)
    }

    /// `ops::zero_point_scale`: the f32 `(scale, zero)` of unsigned
    /// `bits`-bit codes over `[lo, hi]`, `(1, 0)` when `lo > hi`.
    pub(super) fn zero_point_scale(
        &mut self,
        lo: ir::Value,
        hi: ir::Value,
        bits: u32,
    ) -> (ir::Value, ir::Value) {
        let empty = self.b.ins().fcmp(FloatCC::GreaterThan, lo, hi);
        let d = self.b.ins().fsub(hi, lo);
        let levels = self.f32c(coeff_levels(bits) as f32);
        let s = self.b.ins().fdiv(d, levels);
        let s = self.scale_or_one(s);
        let one = self.f32c(1.0);
        let zero = self.f32c(0.0);
        let s = self.b.ins().select(empty, one, s);
        let z = self.b.ins().select(empty, zero, lo);
        (s, z)
    }

    /// `ops::half_zero_point_scale`: `z = f16(clamp(lo))`, then
    /// `half_scale(hi - z, 2^bits - 1)`; `(s, z)` as f32.
    pub(super) fn half_zero_point_scale(
        &mut self,
        lo: ir::Value,
        hi: ir::Value,
        bits: u32,
    ) -> (ir::Value, ir::Value) {
        let max = half::f16::MAX.to_f32();
        let lo = self.clamp(lo, -max, max);
        let z = self.f16_bits(lo);
        let z = self.half_to_float(z, false);
        let d = self.b.ins().fsub(hi, z);
        let s = self.half_scale(d, coeff_levels(bits) as f32);
        (s, z)
    }

    /// The f32 whose bits are the i32 `x`.
    pub(super) fn bits_float(&mut self, x: ir::Value) -> ir::Value {
        let flags = ir::MemFlagsData::new().with_endianness(ir::Endianness::Little);
        self.b.ins().bitcast(types::F32, flags, x)
    }

    /// `Fp8::encode(x)`, step for step on the f32 bits: subnormal results
    /// are the magnitude in steps rounded to the nearest even integer,
    /// normal ones the rebiased exponent and kept mantissa plus one when
    /// the dropped bits are over half (or half with the kept ones odd);
    /// saturated to the largest finite code, NaN to the sign's NaN code.
    pub(super) fn fp8_encode(&mut self, format: Fp8, x: ir::Value) -> ir::Value {
        let (man_bits, bias, max_code) = format.encoding();
        let bits = self.float_bits(x);
        let sign = self.b.ins().ushr_imm_u(bits, 24);
        let sign = self.b.ins().band_imm_u(sign, 0x80);
        let a = self.b.ins().band_imm_u(bits, 0x7FFF_FFFF);
        let nan = self
            .b
            .ins()
            .icmp_imm_u(IntCC::UnsignedGreaterThan, a, 0x7F80_0000);
        // Subnormal results.
        let magnitude = self.bits_float(a);
        let k = self.f32c(format.subnormal_steps());
        let steps = self.b.ins().fmul(magnitude, k);
        let steps = self.b.ins().nearest(steps);
        let small = self.b.ins().fcvt_to_uint_sat(types::I32, steps);
        // Normal results.
        let drop = 23 - man_bits;
        let half = 1i64 << (drop - 1);
        let rest = self.b.ins().band_imm_u(a, (1i64 << drop) - 1);
        let kept = self.b.ins().ushr_imm_u(a, i64::from(drop));
        let odd = self.b.ins().band_imm_u(kept, 1);
        let over = self
            .b
            .ins()
            .icmp_imm_u(IntCC::UnsignedGreaterThan, rest, half);
        let tie = self.b.ins().icmp_imm_u(IntCC::Equal, rest, half);
        let odd = self.b.ins().icmp_imm_u(IntCC::NotEqual, odd, 0);
        let tie_up = self.b.ins().band(tie, odd);
        let up = self.b.ins().bor(over, tie_up);
        let up = self.b.ins().uextend(types::I32, up);
        let rebias = i64::from((127 - bias) << man_bits);
        let normal = self.b.ins().iadd_imm_s(kept, -rebias);
        let normal = self.b.ins().iadd(normal, up);
        let is_small = self.b.ins().icmp_imm_u(
            IntCC::UnsignedLessThan,
            a,
            i64::from(format.min_normal_bits()),
        );
        let code = self.b.ins().select(is_small, small, normal);
        let limit = self.iconst(max_code);
        let code = self.b.ins().umin(code, limit);
        let nan_code = self.iconst(0x7F);
        let code = self.b.ins().select(nan, nan_code, code);
        self.b.ins().bor(sign, code)
    }

    /// `f32::total_cmp` as a signed integer key: `a.total_cmp(b)` is the
    /// signed comparison of the keys.
    pub(super) fn total_key(&mut self, x: ir::Value) -> ir::Value {
        let bits = self.float_bits(x);
        let sign = self.b.ins().sshr_imm_u(bits, 31);
        let flip = self.b.ins().ushr_imm_u(sign, 1);
        self.b.ins().bxor(bits, flip)
    }
}

#[cfg(test)]
mod tests {
    use cranelift_codegen::ir::{types, InstBuilder};

    use super::Ix;
    use crate::back::clif::module::Jit;
    use crate::spec::Fp8;

    /// The inputs where fp8 rounding can go wrong: every code's value and
    /// the exact ties between neighbours, each ±1 ulp, past the largest
    /// finite (saturation), infinities, NaNs, zeros, f32 subnormals, and a
    /// stride through every f32 pattern.
    fn edge_inputs(format: Fp8) -> Vec<f32> {
        let mut out = vec![0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
        out.push(f32::from_bits(0xFFC0_0001));
        out.push(f32::from_bits(1));
        out.push(f32::MIN_POSITIVE);
        out.extend([448.0, 464.0, 480.0, 57344.0, 61440.0, 1e30, f32::MAX]);
        let values: Vec<f32> = (0..0x80)
            .map(|c| format.decode(c))
            .filter(|v| v.is_finite())
            .collect();
        let mut points = values.clone();
        points.extend(values.windows(2).map(|w| (w[0] + w[1]) / 2.0));
        points.push(format.max() + format.max() / 32.0);
        for p in points {
            for v in [p, -p] {
                let b = v.to_bits();
                out.extend([v, f32::from_bits(b.wrapping_sub(1)), f32::from_bits(b + 1)]);
            }
        }
        out.extend((0..u32::MAX).step_by(65_521).map(f32::from_bits));
        out
    }

    /// `Fp8::encode` as the encoder emits it, bit for bit against the
    /// reference on the edge inputs of both formats.
    #[test]
    fn fp8_encode_matches_the_reference() {
        for format in [Fp8::E4m3, Fp8::E5m2] {
            let mut jit = Jit::new(&[]).expect("host JIT");
            let id = jit
                .define(
                    "fp8_encode",
                    &[types::I64, types::I64, types::I32],
                    1,
                    |fx, args| {
                        let (input, output, n) = (args[0], args[1], args[2]);
                        fx.loop_to(n, |fx, i| {
                            let v = fx.ldf(input, Ix::V(i));
                            let code = fx.fp8_encode(format, v);
                            fx.st(output, Ix::V(i), code);
                        });
                        fx.b.ins().return_(&[]);
                    },
                )
                .expect("compiles");
            let (_code, [address]) = jit.finish([id]).expect("links");
            // SAFETY: the function just defined, of this signature, alive with `_code`.
            let encode: unsafe extern "C" fn(*const f32, *mut u32, u32) =
                unsafe { std::mem::transmute(address) };
            let inputs = edge_inputs(format);
            let mut got = vec![0u32; inputs.len()];
            // SAFETY: `n` floats in, `n` codes out.
            unsafe { encode(inputs.as_ptr(), got.as_mut_ptr(), inputs.len() as u32) };
            for (&v, &code) in inputs.iter().zip(&got) {
                assert_eq!(
                    code,
                    format.encode(v),
                    "{format:?} of {v:e} ({:#010x})",
                    v.to_bits()
                );
            }
        }
    }
}
