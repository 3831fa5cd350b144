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
        let src = src.into();
        self.line(format_args!("mov{} {dst}, {src}", T::DECL));
    }
    pub fn add<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        let d = self.reg();
        self.add_to(d, a, b);
        d
    }
    /// `dst = a + b` into an existing register (loop counters).
    pub fn add_to<T: Arith>(&mut self, dst: Reg<T>, a: impl Into<Op<T>>, b: impl Into<Op<T>>) {
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("add.{} {dst}, {a}, {b}", T::ADD));
    }
    pub fn sub<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        self.op(format_args!("sub.{}", T::ADD), &[&a.into(), &b.into()])
    }
    /// Low half of the product (wrapping) for integers, rounded for floats.
    pub fn mul<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        self.op(format_args!("mul.{}", T::MUL), &[&a.into(), &b.into()])
    }
    /// `dst = a * b` into an existing register.
    pub fn mul_to<T: Arith>(&mut self, dst: Reg<T>, a: impl Into<Op<T>>, b: impl Into<Op<T>>) {
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("mul.{} {dst}, {a}, {b}", T::MUL));
    }
    pub fn min<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        self.op(format_args!("min.{}", T::SUFFIX), &[&a.into(), &b.into()])
    }
    pub fn max<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        self.op(format_args!("max.{}", T::SUFFIX), &[&a.into(), &b.into()])
    }
    /// `a * b + c` on u32, wrapping.
    pub fn mad_lo(
        &mut self,
        a: impl Into<Op<U32>>,
        b: impl Into<Op<U32>>,
        c: impl Into<Op<U32>>,
    ) -> Reg<U32> {
        self.op("mad.lo.u32", &[&a.into(), &b.into(), &c.into()])
    }
    /// `c` plus the products of the unsigned bytes of `a` and `b`, byte by
    /// byte (`dp4a.u32.u32`): with `b` one nonzero byte, a byte of `a`
    /// scaled and offset in one instruction.
    pub fn dp4a(&mut self, a: Reg<U32>, b: impl Into<Op<U32>>, c: impl Into<Op<U32>>) -> Reg<U32> {
        self.op("dp4a.u32.u32", &[&a, &b.into(), &c.into()])
    }
    /// Full 64-bit product of two u32.
    pub fn mul_wide(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U64> {
        self.op("mul.wide.u32", &[&a.into(), &b.into()])
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
        let (a, b, c) = (a.into(), b.into(), c.into());
        self.line(format_args!("fma.rn.f32 {dst}, {a}, {b}, {c}"));
    }
    /// IEEE division, correctly rounded.
    pub fn div_f32(&mut self, a: impl Into<Op<F32>>, b: impl Into<Op<F32>>) -> Reg<F32> {
        self.op("div.rn.f32", &[&a.into(), &b.into()])
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
    pub fn abs_f32(&mut self, a: Reg<F32>) -> Reg<F32> {
        self.op("abs.f32", &[&a])
    }
    pub fn neg_f32(&mut self, a: Reg<F32>) -> Reg<F32> {
        self.op("neg.f32", &[&a])
    }
    /// Two's-complement negation (wrapping).
    pub fn neg_s32(&mut self, a: Reg<S32>) -> Reg<S32> {
        self.op("neg.s32", &[&a])
    }
    /// 2^a, approximate (flushes subnormal results to zero).
    pub fn ex2(&mut self, a: Reg<F32>) -> Reg<F32> {
        self.op("ex2.approx.ftz.f32", &[&a])
    }
    /// exp(a − b) as 2^((a − b)·log2 e): relative error about 2^-21 for the
    /// exponents of a softmax, and exp(−∞) = 0.
    pub fn exp_diff(&mut self, a: Reg<F32>, b: Reg<F32>) -> Reg<F32> {
        let d = self.sub(a, b);
        let x = self.mul(d, std::f32::consts::LOG2_E);
        self.ex2(x)
    }

    // ---- bits ---------------------------------------------------------------

    pub fn and(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        self.op("and.b32", &[&a.into(), &b.into()])
    }
    pub fn or(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        self.op("or.b32", &[&a.into(), &b.into()])
    }
    pub fn xor(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        self.op("xor.b32", &[&a.into(), &b.into()])
    }
    /// `a << b`; amounts of 32 or more give 0.
    pub fn shl(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        self.op("shl.b32", &[&a.into(), &b.into()])
    }
    /// Logical `a >> b`.
    pub fn shr(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        self.op("shr.u32", &[&a.into(), &b.into()])
    }
    /// Low 32 bits of the 64-bit `hi:lo` shifted right by `shift & 31`.
    pub fn shf_r_wrap(
        &mut self,
        lo: Reg<U32>,
        hi: Reg<U32>,
        shift: impl Into<Op<U32>>,
    ) -> Reg<U32> {
        self.op("shf.r.wrap.b32", &[&lo, &hi, &shift.into()])
    }
    /// `len` bits of `a` from bit `pos`, zero-extended.
    pub fn bfe_u32(
        &mut self,
        a: Reg<U32>,
        pos: impl Into<Op<U32>>,
        len: impl Into<Op<U32>>,
    ) -> Reg<U32> {
        self.op("bfe.u32", &[&a, &pos.into(), &len.into()])
    }
    /// `len` bits of `a` from bit `pos` as a two's-complement integer.
    pub fn bfe_s32(
        &mut self,
        a: Reg<U32>,
        pos: impl Into<Op<U32>>,
        len: impl Into<Op<U32>>,
    ) -> Reg<S32> {
        self.op("bfe.s32", &[&a, &pos.into(), &len.into()])
    }
    /// `base` with `len` bits from bit `pos` replaced by the low bits of `field`.
    pub fn bfi(
        &mut self,
        field: Reg<U32>,
        base: Reg<U32>,
        pos: impl Into<Op<U32>>,
        len: impl Into<Op<U32>>,
    ) -> Reg<U32> {
        self.op("bfi.b32", &[&field, &base, &pos.into(), &len.into()])
    }
    pub fn popc(&mut self, a: Reg<U32>) -> Reg<U32> {
        self.op("popc.b32", &[&a])
    }
    /// The bits of `a` in reverse order.
    pub fn brev(&mut self, a: Reg<U32>) -> Reg<U32> {
        self.op("brev.b32", &[&a])
    }
    /// Leading zeros of a nonzero `a` (`bfind.shiftamt`: one SASS `FLO.SH`,
    /// where `clz` adds a subtraction).
    pub fn leading_zeros(&mut self, a: Reg<U32>) -> Reg<U32> {
        self.op("bfind.shiftamt.u32", &[&a])
    }

    // ---- conversions --------------------------------------------------------

    /// Low 16 bits.
    pub fn low16(&mut self, a: Reg<U32>) -> Reg<B16> {
        self.op("cvt.u16.u32", &[&a])
    }
    /// The low and high 16 bits of `a`.
    pub fn split_halves(&mut self, a: Reg<U32>) -> (Reg<B16>, Reg<B16>) {
        let (lo, hi) = (self.reg(), self.reg());
        self.line(format_args!("mov.b32 {{{lo}, {hi}}}, {a}"));
        (lo, hi)
    }
    /// IEEE binary16 bits to f32 (exact).
    pub fn f16_to_f32(&mut self, a: Reg<B16>) -> Reg<F32> {
        self.op("cvt.f32.f16", &[&a])
    }
    pub fn u32_to_f32(&mut self, a: Reg<U32>) -> Reg<F32> {
        self.op("cvt.rn.f32.u32", &[&a])
    }
    /// The nearest integer (ties to even).
    pub fn f32_to_s32(&mut self, a: Reg<F32>) -> Reg<S32> {
        self.op("cvt.rni.s32.f32", &[&a])
    }
    pub fn s32_to_f32(&mut self, a: Reg<S32>) -> Reg<F32> {
        self.op("cvt.rn.f32.s32", &[&a])
    }
    pub fn u32_to_u64(&mut self, a: Reg<U32>) -> Reg<U64> {
        self.op("cvt.u64.u32", &[&a])
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
    pub fn and_pred(&mut self, a: Reg<Pred>, b: Reg<Pred>) -> Reg<Pred> {
        self.op("and.pred", &[&a, &b])
    }
    pub fn or_pred(&mut self, a: Reg<Pred>, b: Reg<Pred>) -> Reg<Pred> {
        self.op("or.pred", &[&a, &b])
    }
    pub fn not_pred(&mut self, a: Reg<Pred>) -> Reg<Pred> {
        self.op("not.pred", &[&a])
    }
}
