//! Moves, integer and float arithmetic, bit operations, conversions,
//! comparisons and selection.

use super::{Arith, Bits32, Cmp, Kernel, Op, Pred, Reg, Type, B16, F32, S32, U32, U64};

impl Kernel {
    // ---- moves and arithmetic ----------------------------------------------

    pub fn mov<T: Type>(&mut self, src: impl Into<Op<T>>) -> Reg<T> {
        let d = self.reg();
        self.assign(d, src);
        d
    }
    /// `dst = src` for a register updated in a loop.
    pub fn assign<T: Type>(&mut self, dst: Reg<T>, src: impl Into<Op<T>>) {
        self.op_to(format_args!("mov{}", T::DECL), dst, &[&src.into()]);
    }
    pub fn add<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        let d = self.reg();
        self.add_to(d, a, b);
        d
    }
    /// `dst = a + b` into an existing register (loop counters).
    pub fn add_to<T: Arith>(&mut self, dst: Reg<T>, a: impl Into<Op<T>>, b: impl Into<Op<T>>) {
        self.op_to(format_args!("add.{}", T::ADD), dst, &[&a.into(), &b.into()]);
    }
    /// Fused `a * b + c`, rounded once (the IR's `Fma`).
    pub fn fma(
        &mut self,
        a: impl Into<Op<F32>>,
        b: impl Into<Op<F32>>,
        c: impl Into<Op<F32>>,
    ) -> Reg<F32> {
        let d = self.reg();
        self.fma_to(d, a, b, c);
        d
    }
    /// Fused `dst = a * b + c` into an existing register (accumulators).
    pub fn fma_to(
        &mut self,
        dst: Reg<F32>,
        a: impl Into<Op<F32>>,
        b: impl Into<Op<F32>>,
        c: impl Into<Op<F32>>,
    ) {
        self.op_to("fma.rn.f32", dst, &[&a.into(), &b.into(), &c.into()]);
    }
    /// `dst = a * b` into an existing register.
    pub fn mul_to<T: Arith>(&mut self, dst: Reg<T>, a: impl Into<Op<T>>, b: impl Into<Op<T>>) {
        self.op_to(format_args!("mul.{}", T::MUL), dst, &[&a.into(), &b.into()]);
    }
    /// Division by a power-of-two immediate is a shift: ptxas emits its
    /// generic reciprocal sequence (~8 instructions) for `div.u32 x, 8`.
    pub fn div_u32(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        let (a, b) = (a.into(), b.into());
        if let Op::Imm(n) = b {
            if n.is_power_of_two() {
                return self.shr(a, n.trailing_zeros());
            }
        }
        self.op("div.u32", &[&a, &b])
    }
    /// Remainder by a power-of-two immediate is a mask (see [`Self::div_u32`]).
    pub fn rem_u32(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        let (a, b) = (a.into(), b.into());
        if let Op::Imm(n) = b {
            if n.is_power_of_two() {
                return self.and(a, n - 1);
            }
        }
        self.op("rem.u32", &[&a, &b])
    }
    /// exp(a − b) as 2^((a − b)·log2 e): relative error about 2^-21 for the
    /// exponents of a softmax, and exp(−∞) = 0.
    pub fn exp_diff(&mut self, a: Reg<F32>, b: Reg<F32>) -> Reg<F32> {
        let d = self.sub(a, b);
        let x = self.mul(d, std::f32::consts::LOG2_E);
        self.ex2(x)
    }

    // ---- bits ---------------------------------------------------------------
    // ---- conversions --------------------------------------------------------
    /// The low and high 16 bits of `a`.
    pub fn split_halves(&mut self, a: Reg<U32>) -> (Reg<B16>, Reg<B16>) {
        let (lo, hi) = (self.reg(), self.reg());
        self.line(format_args!("mov.b32 {{{lo}, {hi}}}, {a}"));
        (lo, hi)
    }
    /// Reinterprets 32 bits as another 32-bit type.
    pub fn bitcast<A: Bits32, B: Bits32>(&mut self, a: Reg<A>) -> Reg<B> {
        self.op("mov.b32", &[&a])
    }

    // ---- comparisons and selection -----------------------------------------
    pub fn setp<T: Arith>(
        &mut self,
        cmp: Cmp,
        a: impl Into<Op<T>>,
        b: impl Into<Op<T>>,
    ) -> Reg<Pred> {
        debug_assert!(cmp != Cmp::Neu || T::SUFFIX == "f32", "neu compares floats");
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!(
            "setp.{}.{} {d}, {a}, {b}",
            cmp.name(),
            T::SUFFIX
        ));
        d
    }
    /// `p ? a : b`.
    pub fn selp<T: Bits32>(
        &mut self,
        a: impl Into<Op<T>>,
        b: impl Into<Op<T>>,
        p: Reg<Pred>,
    ) -> Reg<T> {
        self.op(
            format_args!("selp.{}", T::SUFFIX),
            &[&a.into(), &b.into(), &p],
        )
    }
}

instructions! {
    /// `a * b + c` on u32, wrapping.
    fn mad_lo(a: impl Into<Op<U32>>, b: impl Into<Op<U32>>, c: impl Into<Op<U32>>) -> U32 = "mad.lo.u32";
    /// `c` plus the products of the unsigned bytes of `a` and `b`, byte by
    /// byte (`dp4a.u32.u32`): with `b` one nonzero byte, a byte of `a`
    /// scaled and offset in one instruction.
    fn dp4a(a: Reg<U32>, b: impl Into<Op<U32>>, c: impl Into<Op<U32>>) -> U32 = "dp4a.u32.u32";
    /// Full 64-bit product of two u32.
    fn mul_wide(a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> U64 = "mul.wide.u32";
    /// IEEE division, correctly rounded.
    fn div_f32(a: impl Into<Op<F32>>, b: impl Into<Op<F32>>) -> F32 = "div.rn.f32";
    fn abs_f32(a: Reg<F32>) -> F32 = "abs.f32";
    fn neg_f32(a: Reg<F32>) -> F32 = "neg.f32";
    /// Two's-complement negation (wrapping).
    fn neg_s32(a: Reg<S32>) -> S32 = "neg.s32";
    /// 2^a, approximate (flushes subnormal results to zero).
    fn ex2(a: Reg<F32>) -> F32 = "ex2.approx.ftz.f32";
    fn and(a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> U32 = "and.b32";
    fn or(a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> U32 = "or.b32";
    fn xor(a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> U32 = "xor.b32";
    /// `a << b`; amounts of 32 or more give 0.
    fn shl(a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> U32 = "shl.b32";
    /// Logical `a >> b`.
    fn shr(a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> U32 = "shr.u32";
    /// Low 32 bits of the 64-bit `hi:lo` shifted right by `shift & 31`.
    fn shf_r_wrap(lo: Reg<U32>, hi: Reg<U32>, shift: impl Into<Op<U32>>) -> U32 = "shf.r.wrap.b32";
    /// `len` bits of `a` from bit `pos`, zero-extended.
    fn bfe_u32(a: Reg<U32>, pos: impl Into<Op<U32>>, len: impl Into<Op<U32>>) -> U32 = "bfe.u32";
    /// `len` bits of `a` from bit `pos` as a two's-complement integer.
    fn bfe_s32(a: Reg<U32>, pos: impl Into<Op<U32>>, len: impl Into<Op<U32>>) -> S32 = "bfe.s32";
    /// `base` with `len` bits from bit `pos` replaced by the low bits of `field`.
    fn bfi(field: Reg<U32>, base: Reg<U32>, pos: impl Into<Op<U32>>, len: impl Into<Op<U32>>) -> U32 = "bfi.b32";
    fn popc(a: Reg<U32>) -> U32 = "popc.b32";
    /// The bits of `a` in reverse order.
    fn brev(a: Reg<U32>) -> U32 = "brev.b32";
    /// Leading zeros of a nonzero `a` (`bfind.shiftamt`: one SASS `FLO.SH`,
    /// where `clz` adds a subtraction).
    fn leading_zeros(a: Reg<U32>) -> U32 = "bfind.shiftamt.u32";
    /// Low 16 bits.
    fn low16(a: Reg<U32>) -> B16 = "cvt.u16.u32";
    /// IEEE binary16 bits to f32 (exact).
    fn f16_to_f32(a: Reg<B16>) -> F32 = "cvt.f32.f16";
    fn u32_to_f32(a: Reg<U32>) -> F32 = "cvt.rn.f32.u32";
    /// The nearest integer (ties to even).
    fn f32_to_s32(a: Reg<F32>) -> S32 = "cvt.rni.s32.f32";
    /// f32 to IEEE binary16 bits, to nearest (ties to even).
    fn f32_to_f16(a: Reg<F32>) -> B16 = "cvt.rn.f16.f32";
    /// f32 to bfloat16 bits, to nearest (ties to even; sm_80+).
    fn f32_to_bf16(a: Reg<F32>) -> B16 = "cvt.rn.bf16.f32";
    fn s32_to_f32(a: Reg<S32>) -> F32 = "cvt.rn.f32.s32";
    fn u32_to_u64(a: Reg<U32>) -> U64 = "cvt.u64.u32";
    fn and_pred(a: Reg<Pred>, b: Reg<Pred>) -> Pred = "and.pred";
    fn or_pred(a: Reg<Pred>, b: Reg<Pred>) -> Pred = "or.pred";
    fn not_pred(a: Reg<Pred>) -> Pred = "not.pred";
}

/// Two-operand instructions on any arithmetic type, the opcode's type suffix
/// the named one of [`Arith`].
macro_rules! arithmetic {
    ($($(#[$doc:meta])* fn $name:ident = $opcode:literal, $suffix:ident;)*) => {
        impl Kernel {
            $(
                $(#[$doc])*
                pub fn $name<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
                    self.op(format_args!(concat!($opcode, ".{}"), T::$suffix), &[&a.into(), &b.into()])
                }
            )*
        }
    };
}

arithmetic! {
    fn sub = "sub", ADD;
    /// Low half of the product (wrapping) for integers, rounded for floats.
    fn mul = "mul", MUL;
    fn min = "min", SUFFIX;
    fn max = "max", SUFFIX;
}
