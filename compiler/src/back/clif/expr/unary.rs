//! Unary operations -> CLIF, with the exact f16 -> f32 conversion that
//! Cranelift has no instruction for.

use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{self, types, BlockArg, Endianness, InstBuilder, MemFlagsData};

use super::{Fx, Operation, Val};
use crate::back::interp::eval;
use crate::ir::{Scalar, UnaryOp};
use crate::spec::Fp8;

impl Fx<'_> {
    /// A unary operation on an operand of type `ty`.
    pub fn unary(&mut self, op: UnaryOp, ty: Scalar, a: Val) -> Val {
        if let Some(x) = a.known() {
            return Val::from_known(x.map(|k| eval::unary(op, k)));
        }
        if !a.varies() {
            let x = self.scalar(a);
            return Val::Uniform(self.reuse(Operation::unary(op), ty, x, None, |fx| {
                fx.emit_unary(op, ty, x, false)
            }));
        }
        let mut x = self.vector(a, ty);
        // Both read only the low 16 bits (and ignore the rest).
        if matches!(op, UnaryOp::HalfToFloat | UnaryOp::BfloatToFloat) {
            if let Some(&(source, width)) = self.low_bits.get(&x) {
                if width >= 16 {
                    x = source;
                }
            }
        }
        Val::Vector(self.reuse(Operation::unary(op), ty, x, None, |fx| {
            fx.emit_unary(op, ty, x, true)
        }))
    }

    pub(super) fn emit_unary(
        &mut self,
        op: UnaryOp,
        ty: Scalar,
        x: ir::Value,
        vector: bool,
    ) -> ir::Value {
        let f32_ty = if vector { types::F32X4 } else { types::F32 };
        match op {
            UnaryOp::Negate if ty == Scalar::F32 => self.b.ins().fneg(x),
            UnaryOp::Negate => self.b.ins().ineg(x),
            UnaryOp::Popcount if vector => {
                // Per byte (x64 has it for i8x16), then the four bytes of a
                // lane summed into its top byte by one multiply (sums <= 32).
                let bytes = self.b.ins().bitcast(
                    types::I8X16,
                    MemFlagsData::new().with_endianness(Endianness::Little),
                    x,
                );
                let counts = self.b.ins().popcnt(bytes);
                let counts = self.bitcast(true, Scalar::U32, counts);
                let k = self.int(true, 0x0101_0101);
                let summed = self.b.ins().imul(counts, k);
                let twenty_four = self.iconst(24);
                self.b.ins().ushr(summed, twenty_four)
            }
            UnaryOp::Popcount => self.b.ins().popcnt(x),
            UnaryOp::HalfToFloat => self.half_to_float(x, vector),
            UnaryOp::BfloatToFloat => {
                // (x & 0xFFFF) << 16 == x << 16 on u32.
                let sixteen = self.iconst(16);
                let bits = self.b.ins().ishl(x, sixteen);
                self.bitcast(vector, Scalar::F32, bits)
            }
            UnaryOp::BitsToFloat => self.bitcast(vector, Scalar::F32, x),
            UnaryOp::Fp8ToFloat(format) => self.fp8_to_float(format, x, vector),
            UnaryOp::ToFloat if ty == Scalar::U32 => self.b.ins().fcvt_from_uint(f32_ty, x),
            UnaryOp::ToFloat => self.b.ins().fcvt_from_sint(f32_ty, x),
            UnaryOp::SignExtend(32) => x,
            UnaryOp::SignExtend(bits) => {
                let unused = self.iconst(32 - u32::from(bits));
                let high = self.b.ins().ishl(x, unused);
                self.b.ins().sshr(high, unused)
            }
        }
    }

    /// IEEE binary16 in the low 16 bits -> f32, exactly as `half::f16::to_f32`
    /// (and F16C), with integer and exact float ops only, so it needs no f16
    /// support from Cranelift and no flush-to-zero mode can change it. Bits
    /// above 15 are ignored (shifted out). Normal numbers rebias the exponent;
    /// the rest (see `rare_halves`) are handled for vectors on a side path
    /// taken only when some lane needs it. The sign is bit 15 moved to 31.
    pub(in crate::back::clif) fn half_to_float(&mut self, x: ir::Value, vector: bool) -> ir::Value {
        let [four, thirteen, fifteen, seventeen, twenty_seven, twenty_eight, thirty_one] =
            [4, 13, 15, 17, 27, 28, 31].map(|n| self.iconst(n));
        // Exponent and mantissa at the top, nothing above them.
        let top = self.b.ins().ishl(x, seventeen);
        let shifted = self.b.ins().ushr(top, four);
        let k = self.int(vector, 112 << 23);
        let normal = self.b.ins().iadd(shifted, k);
        let value = if vector {
            // The exponent field (the top 5 bits) is 0 or 31 iff shifting it
            // down arithmetically by one more bit changes nothing.
            let field = self.b.ins().sshr(top, twenty_seven);
            let half_field = self.b.ins().sshr(top, twenty_eight);
            let rare = self.b.ins().icmp(IntCC::Equal, field, half_field);
            // One bit per lane (movmskps), cheaper to test than ptest.
            let any = self.b.ins().vhigh_bits(types::I32, rare);
            let side = self.b.create_block();
            let join = self.b.create_block();
            let value = self.b.append_block_param(join, types::I32X4);
            self.b.set_cold_block(side);
            self.b
                .ins()
                .brif(any, side, &[], join, &[BlockArg::Value(normal)]);
            // Values cached on the side path do not dominate `join`.
            let cached = self.cached.clone();
            self.b.switch_to_block(side);
            let magnitude = self.b.ins().ushr(shifted, thirteen);
            let exact = self.rare_halves(true, magnitude, normal);
            self.b.ins().jump(join, &[BlockArg::Value(exact)]);
            self.cached = cached;
            self.b.switch_to_block(join);
            value
        } else {
            let magnitude = self.b.ins().ushr(shifted, thirteen);
            self.rare_halves(false, magnitude, normal)
        };
        let sign = self.b.ins().ushr(x, fifteen);
        let sign = self.b.ins().ishl(sign, thirty_one);
        let bits = self.b.ins().bor(value, sign);
        self.bitcast(vector, Scalar::F32, bits)
    }

    /// An fp8 code in the low 8 bits -> f32, exactly as `Fp8::decode`, through
    /// the binary16 it widens to: e5m2 is the high byte of an f16 (infinities
    /// and NaNs included); e4m3's exponent and mantissa moved down one bit are
    /// an f16 of 2^-8 its value (subnormals too), so the f16 times 256 is
    /// exact, and its one NaN pattern is selected apart.
    fn fp8_to_float(&mut self, format: Fp8, x: ir::Value, vector: bool) -> ir::Value {
        let byte = self.int(vector, 0xFF);
        let x = self.b.ins().band(x, byte);
        match format {
            Fp8::E5m2 => {
                let eight = self.iconst(8);
                let half = self.b.ins().ishl(x, eight);
                self.half_to_float(half, vector)
            }
            Fp8::E4m3 => {
                let [seven, eight] = [7, 8].map(|n| self.iconst(n));
                let k = self.int(vector, 0x7F);
                let magnitude = self.b.ins().band(x, k);
                let shifted = self.b.ins().ishl(magnitude, seven);
                let k = self.int(vector, 0x80);
                let sign = self.b.ins().band(x, k);
                let sign = self.b.ins().ishl(sign, eight);
                let half = self.b.ins().bor(shifted, sign);
                let v = self.half_to_float(half, vector);
                let k = self.float(vector, 256.0);
                let v = self.b.ins().fmul(v, k);
                let v = self.bitcast(vector, Scalar::U32, v);
                let k = self.int(vector, 0x7F);
                let is_nan = self.b.ins().icmp(IntCC::Equal, magnitude, k);
                let nan = self.int(vector, 0x7FC0_0000);
                let bits = self.choose(vector, Scalar::U32, is_nan, nan, v);
                self.bitcast(vector, Scalar::F32, bits)
            }
        }
    }

    /// The unsigned f32 bits of every binary16 `magnitude` (exponent and
    /// mantissa), given `normal` (the rebiased bits, right for normal
    /// numbers): zeros and subnormals are `m · 2^-24` (converted from the
    /// integer, exact), infinities and NaNs get exponent 255, NaNs the quiet
    /// bit.
    pub(super) fn rare_halves(
        &mut self,
        vector: bool,
        magnitude: ir::Value,
        normal: ir::Value,
    ) -> ir::Value {
        let f32_ty = if vector { types::F32X4 } else { types::F32 };
        let mantissa = self.b.ins().fcvt_from_sint(f32_ty, magnitude);
        let k = self.float(vector, f32::from_bits(103 << 23));
        let small = self.b.ins().fmul(mantissa, k);
        let small = self.bitcast(vector, Scalar::U32, small);
        // Signed compares: the magnitude is below 2^15 (pcmpgtd on x64).
        let k = self.int(vector, 0x400);
        let is_small = self.b.ins().icmp(IntCC::SignedLessThan, magnitude, k);
        let value = self.choose(vector, Scalar::U32, is_small, small, normal);
        let k = self.int(vector, 0x7BFF);
        let is_special = self.b.ins().icmp(IntCC::SignedGreaterThan, magnitude, k);
        let k = self.int(vector, 0x7F80_0000);
        let exponent = self.mask(vector, is_special, k);
        let value = self.b.ins().bor(value, exponent);
        let k = self.int(vector, 0x7C00);
        let is_nan = self.b.ins().icmp(IntCC::SignedGreaterThan, magnitude, k);
        let k = self.int(vector, 0x0040_0000);
        let quiet = self.mask(vector, is_nan, k);
        self.b.ins().bor(value, quiet)
    }

    /// `bits` where `condition` holds, else 0 (an i8 condition or a lane mask).
    pub(super) fn mask(
        &mut self,
        vector: bool,
        condition: ir::Value,
        bits: ir::Value,
    ) -> ir::Value {
        if vector {
            self.b.ins().band(condition, bits)
        } else {
            let zero = self.iconst(0);
            self.b.ins().select(condition, bits, zero)
        }
    }
}

#[cfg(test)]
mod tests {
    use cranelift_codegen::ir::{types, InstBuilder};

    use crate::back::clif::expr::{writable, Val};
    use crate::back::clif::module::Jit;
    use crate::ir::{Scalar, UnaryOp};

    /// Every binary16 pattern, with and without garbage above bit 15, through
    /// the vector conversion (fast path and side path) and the scalar one,
    /// bit for bit against `half`.
    #[test]
    fn half_to_float_is_exact_for_every_pattern() {
        let mut jit = Jit::new(&[]).expect("host JIT");
        let id = jit
            .define("halves", &[types::I64, types::I64], 4, |fx, args| {
                let (input, output) = (args[0], args[1]);
                let x = fx.b.ins().load(types::I32X4, writable(), input, 0);
                let v = fx.unary(UnaryOp::HalfToFloat, Scalar::U32, Val::Vector(x));
                let v = fx.vector(v, Scalar::F32);
                fx.b.ins().store(writable(), v, output, 0);
                for k in 0..4 {
                    let x = fx.b.ins().load(types::I32, writable(), input, 4 * k);
                    let v = fx.unary(UnaryOp::HalfToFloat, Scalar::U32, Val::Uniform(x));
                    let v = fx.scalar(v);
                    fx.b.ins().store(writable(), v, output, 16 + 4 * k);
                }
                fx.b.ins().return_(&[]);
            })
            .expect("compiles");
        let (_code, [address]) = jit.finish([id]).expect("links");
        // SAFETY: the function just defined, of this signature, alive with `_code`.
        let halves: unsafe extern "C" fn(*const u32, *mut u32) =
            unsafe { std::mem::transmute(address) };
        for first in (0..=u16::MAX as u32).step_by(4) {
            let input: [u32; 4] = std::array::from_fn(|k| {
                (first + k as u32) | [0, 0xDEAD_0000, 0x0001_0000, 0xFFFF_0000][k]
            });
            let mut output = [0u32; 8];
            // SAFETY: 4 u32 in, 8 out, as the function reads and writes.
            unsafe { halves(input.as_ptr(), output.as_mut_ptr()) };
            for k in 0..4 {
                let want = half::f16::from_bits(input[k] as u16).to_f32().to_bits();
                assert_eq!(output[k], want, "vector lane {k}: {:#06x}", input[k]);
                assert_eq!(output[4 + k], want, "scalar: {:#06x}", input[k]);
            }
        }
    }

    /// Every fp8 code of both formats, with garbage above bit 7, through the
    /// vector and scalar conversions, bit for bit against `Fp8::decode`
    /// (NaNs as NaNs).
    #[test]
    fn fp8_to_float_is_exact_for_every_code() {
        use crate::spec::Fp8;
        for format in [Fp8::E4m3, Fp8::E5m2] {
            let mut jit = Jit::new(&[]).expect("host JIT");
            let id = jit
                .define("fp8", &[types::I64, types::I64], 4, |fx, args| {
                    let (input, output) = (args[0], args[1]);
                    let x = fx.b.ins().load(types::I32X4, writable(), input, 0);
                    let op = UnaryOp::Fp8ToFloat(format);
                    let v = fx.unary(op, Scalar::U32, Val::Vector(x));
                    let v = fx.vector(v, Scalar::F32);
                    fx.b.ins().store(writable(), v, output, 0);
                    for k in 0..4 {
                        let x = fx.b.ins().load(types::I32, writable(), input, 4 * k);
                        let v = fx.unary(op, Scalar::U32, Val::Uniform(x));
                        let v = fx.scalar(v);
                        fx.b.ins().store(writable(), v, output, 16 + 4 * k);
                    }
                    fx.b.ins().return_(&[]);
                })
                .expect("compiles");
            let (_code, [address]) = jit.finish([id]).expect("links");
            // SAFETY: the function just defined, of this signature, alive with `_code`.
            let convert: unsafe extern "C" fn(*const u32, *mut u32) =
                unsafe { std::mem::transmute(address) };
            for first in (0..256u32).step_by(4) {
                let input: [u32; 4] = std::array::from_fn(|k| {
                    (first + k as u32) | [0, 0xDEAD_0100, 0x100, 0xFF00][k]
                });
                let mut output = [0u32; 8];
                // SAFETY: 4 u32 in, 8 out, as the function reads and writes.
                unsafe { convert(input.as_ptr(), output.as_mut_ptr()) };
                for k in 0..4 {
                    let want = format.decode(input[k]);
                    for got in [output[k], output[4 + k]].map(f32::from_bits) {
                        assert!(
                            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                            "{format:?} {:#x}: {got} against {want}",
                            input[k]
                        );
                    }
                }
            }
        }
    }
}
