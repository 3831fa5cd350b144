//! Conversions that round toward zero and saturate, as Rust's `f32::trunc`
//! and `as` casts do (the encoders' integer codes), and 16-bit widening.

use super::{Kernel, Reg, B16, B32, F32, S32, U32};

instructions! {
    /// `a` rounded toward zero to an integer, kept an f32 (`f32::trunc`).
    fn trunc_f32(a: Reg<F32>) -> F32 = "cvt.rzi.f32.f32";
    /// `a` truncated to an integer, saturating, NaN to 0 (Rust's `as i32`).
    fn f32_to_s32_trunc(a: Reg<F32>) -> S32 = "cvt.rzi.s32.f32";
    /// `a` truncated to an integer, saturating, NaN to 0 (Rust's `as u32`).
    fn f32_to_u32_trunc(a: Reg<F32>) -> U32 = "cvt.rzi.u32.f32";
    /// 16 bits zero-extended.
    fn widen16(a: Reg<B16>) -> U32 = "cvt.u32.u16";
    /// The nearest integer, ties to even, saturating (`f32::round_ties_even`
    /// then `as u32`).
    fn f32_to_u32_even(a: Reg<F32>) -> U32 = "cvt.rni.u32.f32";
    /// f32 to IEEE binary16 bits rounded toward -inf (the largest f16 <= `a`).
    fn f32_to_f16_down(a: Reg<F32>) -> B16 = "cvt.rm.f16.f32";
    /// f32 to IEEE binary16 bits rounded toward +inf (the smallest f16 >= `a`).
    fn f32_to_f16_up(a: Reg<F32>) -> B16 = "cvt.rp.f16.f32";
    /// Two e4m3 numbers (high and low byte) as an exact f16 pair (sm_89+).
    fn e4m3x2_to_f16x2(a: Reg<B16>) -> B32 = "cvt.rn.f16x2.e4m3x2";
    /// Two e5m2 numbers (high and low byte) as an exact f16 pair (sm_89+).
    fn e5m2x2_to_f16x2(a: Reg<B16>) -> B32 = "cvt.rn.f16x2.e5m2x2";
}
