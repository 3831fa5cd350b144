//! Packed f16 pairs, the tensor cores' `mma.sync`, and warp collectives
//! (shuffles, votes).

use super::{Bits32, Kernel, Op, Pred, Reg, B32, F32, S32, U32};

impl Kernel {
    // ---- packed halves and tensor cores -------------------------------------

    /// Bytes of `a:b` picked by `selector` (`prmt.b32`: nibble `i` names the
    /// source byte 0..7 of result byte `i`).
    pub fn prmt(&mut self, a: Reg<U32>, b: Reg<U32>, selector: u32) -> Reg<U32> {
        let d = self.reg();
        self.line(format_args!("prmt.b32 {d}, {a}, {b}, 0x{selector:04X}"));
        d
    }
    /// Any function of three words bit by bit (`lop3.b32`; `lut` is the truth
    /// table over the operands' bit patterns 0xF0, 0xCC, 0xAA).
    pub fn lop3(
        &mut self,
        a: Reg<U32>,
        b: impl Into<Op<U32>>,
        c: impl Into<Op<U32>>,
        lut: u8,
    ) -> Reg<U32> {
        let d = self.reg();
        let (b, c) = (b.into(), c.into());
        self.line(format_args!("lop3.b32 {d}, {a}, {b}, {c}, 0x{lut:02X}"));
        d
    }
    /// Lane-wise `a - b` of two f16 pairs (round to nearest; exact on the
    /// small integers it is used for).
    pub fn sub_f16x2(&mut self, a: Reg<U32>, b: Reg<U32>) -> Reg<U32> {
        // f16x2 operands must be .b32 registers.
        let (a, b) = (self.bitcast::<U32, B32>(a), self.bitcast::<U32, B32>(b));
        let d = self.reg::<B32>();
        self.line(format_args!("sub.rn.f16x2 {d}, {a}, {b}"));
        self.bitcast(d)
    }
    /// Lane-wise larger magnitude `max(|a|, |b|)` of two f16 pairs (a NaN
    /// yields to the other operand).
    pub fn max_abs_f16x2(&mut self, a: Reg<U32>, b: Reg<U32>) -> Reg<U32> {
        let [a, b] = [a, b].map(|r| self.bitcast::<U32, B32>(r));
        let (x, y, d) = (self.reg::<B32>(), self.reg::<B32>(), self.reg::<B32>());
        self.line(format_args!("abs.f16x2 {x}, {a}"));
        self.line(format_args!("abs.f16x2 {y}, {b}"));
        self.line(format_args!("max.f16x2 {d}, {x}, {y}"));
        self.bitcast(d)
    }
    /// Lane-wise `a · b + c` of f16 pairs, rounded once.
    pub fn fma_f16x2(&mut self, a: Reg<U32>, b: Reg<U32>, c: Reg<U32>) -> Reg<U32> {
        let [a, b, c] = [a, b, c].map(|r| self.bitcast::<U32, B32>(r));
        let d = self.reg::<B32>();
        self.line(format_args!("fma.rn.f16x2 {d}, {a}, {b}, {c}"));
        self.bitcast(d)
    }
    /// Two f32 rounded to f16 and packed: `low` in bits 0..16, `high` above.
    pub fn pack_f16x2(&mut self, low: Reg<F32>, high: Reg<F32>) -> Reg<U32> {
        // The f16x2 destination must be a .b32 register.
        let d = self.reg::<B32>();
        self.line(format_args!("cvt.rn.f16x2.f32 {d}, {high}, {low}"));
        self.bitcast(d)
    }
    /// `acc += a · b` on the tensor cores: a 16×16 f16 tile (`a`, row-major
    /// fragment) times a 16×8 f16 tile (`b`, column-major fragment) into a
    /// 16×8 f32 tile, every lane holding its fragment registers.
    pub fn mma_f16_f32(&mut self, acc: [Reg<F32>; 4], a: [Reg<U32>; 4], b: [Reg<U32>; 2]) {
        let [c0, c1, c2, c3] = acc;
        // f16x2 operands must be .b32 registers.
        let [a0, a1, a2, a3] = a.map(|r| self.bitcast::<U32, B32>(r));
        let [b0, b1] = b.map(|r| self.bitcast::<U32, B32>(r));
        self.line(format_args!(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{c0}, {c1}, {c2}, {c3}}}, \
             {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}}"
        ));
    }

    /// `acc += a · b` on the tensor cores: `m16n8k32`, four 8-bit integers
    /// per register (A two's complement when `signed_a`, else unsigned; B
    /// two's complement), exact s32 sums.
    pub fn mma_i8_s32(
        &mut self,
        acc: [Reg<S32>; 4],
        a: [Reg<U32>; 4],
        b: [Reg<U32>; 2],
        signed_a: bool,
    ) {
        let [c0, c1, c2, c3] = acc;
        let [a0, a1, a2, a3] = a.map(|r| self.bitcast::<U32, B32>(r));
        let [b0, b1] = b.map(|r| self.bitcast::<U32, B32>(r));
        let a_type = if signed_a { "s8" } else { "u8" };
        self.line(format_args!(
            "mma.sync.aligned.m16n8k32.row.col.s32.{a_type}.s8.s32 {{{c0}, {c1}, {c2}, {c3}}}, \
             {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}}"
        ));
    }

    // ---- warp ---------------------------------------------------------------
    /// The value of lane `lane ^ mask` (all 32 lanes take part).
    pub fn shfl_bfly<T: Bits32>(&mut self, a: Reg<T>, mask: u32) -> Reg<T> {
        debug_assert!(mask < 32);
        let d = self.reg();
        self.line(format_args!(
            "shfl.sync.bfly.b32 {d}, {a}, {mask}, 31, 0xffffffff"
        ));
        d
    }

    /// The value of lane `lane` (all 32 lanes take part).
    pub fn shfl_idx<T: Bits32>(&mut self, a: Reg<T>, lane: Reg<U32>) -> Reg<T> {
        let d = self.reg();
        self.line(format_args!(
            "shfl.sync.idx.b32 {d}, {a}, {lane}, 31, 0xffffffff"
        ));
        d
    }

    /// The largest `a` of the warp's lanes, in every lane (all 32 take part).
    pub fn redux_max_u32(&mut self, a: Reg<U32>) -> Reg<U32> {
        let d = self.reg();
        self.line(format_args!("redux.sync.max.u32 {d}, {a}, 0xffffffff"));
        d
    }

    /// Whether `p` holds in any lane of the warp (all 32 lanes take part).
    pub fn vote_any(&mut self, p: Reg<Pred>) -> Reg<Pred> {
        let d = self.reg();
        self.line(format_args!("vote.sync.any.pred {d}, {p}, 0xffffffff"));
        d
    }
}

instructions! {
    /// [`Self::prmt`] with the selector in a register.
    fn prmt_by(a: Reg<U32>, b: Reg<U32>, selector: Reg<U32>) -> U32 = "prmt.b32";
}
