//! A chunk's source rows through the codec's forward transform into shared
//! memory (`x[item][dims]`), as `interp::encode::transform::forward` does:
//! identity; Hadamard (the fast Walsh–Hadamard butterflies, stage by stage,
//! then the `1/sqrt(n)` scale); SRHT (signs from the tables, then Hadamard);
//! PCA (`out[c] = Σ_i basis[i][c] · (x[i] − mean[i])` from 0, in `i` order).

use super::super::abi::{DenseSource, SourceDtype, TableBuffer};
use super::super::builder::{Global, Kernel, Reg, F32, U32};
use super::emit::{for_each, serial, split, Ctx};
use super::plan::Plan;
use crate::layout::{CodecLayout, Side, TransformLayout};

/// Element `i` of source row `row` (page-relative) of `side`, as f32 (exact).
fn source_element(
    k: &mut Kernel,
    ctx: &Ctx,
    source: &DenseSource,
    side: Side,
    row: Reg<U32>,
    i: Reg<U32>,
) -> Reg<F32> {
    let (offset, stride) = source.stream(side);
    let byte = k.mad_lo(row, stride, offset);
    let byte = k.mad_lo(i, 2u32, byte);
    let at = k.global_index(ctx.src, byte, 1);
    load_source_value(k, Global::at(at), source.dtype)
}

/// The f16 or bf16 source value at `at`, as f32 (exact).
pub(in crate::back::ptx) fn load_source_value(
    k: &mut Kernel,
    at: Global,
    dtype: SourceDtype,
) -> Reg<F32> {
    let raw = k.ld_global_nc_narrow(at, 16);
    match dtype {
        SourceDtype::F16 => {
            let h = k.low16(raw);
            k.f16_to_f32(h)
        }
        SourceDtype::Bf16 => {
            let bits = k.shl(raw, 16u32);
            k.bitcast(bits)
        }
    }
}

/// Fills `x` with the transformed rows `first .. first + count` (a chunk);
/// ends with a barrier.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    k: &mut Kernel,
    ctx: &Ctx,
    plan: &Plan,
    codec: &CodecLayout,
    tables: &TableBuffer,
    source: &DenseSource,
    first: Reg<U32>,
    count: Reg<U32>,
) {
    let side = codec.side;
    let n = source.head_dim;
    k.comment(&format!("{} transform: {:?}", side.name(), codec.transform));
    match codec.transform {
        TransformLayout::Identity | TransformLayout::Hadamard | TransformLayout::Srht { .. } => {
            let elements = k.mul(count, n);
            for_each(k, ctx, elements, |k, w| {
                let (item, i) = split(k, w, n);
                let row = k.add(first, item);
                let mut v = source_element(k, ctx, source, side, row, i);
                if let TransformLayout::Srht { signs, .. } = codec.transform {
                    let sign = ctx.table_value(k, tables.offsets[signs], i);
                    v = k.mul(v, sign);
                }
                let at = ctx.shared_word(k, plan.x, w);
                k.st_shared(at, v);
            });
            k.bar_sync();
            if !matches!(codec.transform, TransformLayout::Identity) {
                hadamard(k, ctx, plan, n, count);
            }
        }
        TransformLayout::Pca { rank, basis, mean } => {
            let elements = k.mul(count, rank);
            let (basis, mean) = (tables.offsets[basis], tables.offsets[mean]);
            for_each(k, ctx, elements, |k, w| {
                let (item, c) = split(k, w, rank);
                let row = k.add(first, item);
                let acc = k.mov(0.0f32);
                let b = k.mov(c);
                serial(k, n, |k, i| {
                    let xi = source_element(k, ctx, source, side, row, i);
                    let mi = ctx.table_value(k, mean, i);
                    let centered = k.sub(xi, mi);
                    let bi = ctx.table_value(k, basis, b);
                    let term = k.mul(bi, centered);
                    k.add_to(acc, acc, term);
                    k.add_to(b, b, rank);
                });
                let at = ctx.shared_word(k, plan.x, w);
                k.st_shared(at, acc);
            });
            k.bar_sync();
        }
    }
}

/// The normalized fast Walsh–Hadamard transform of every row of `x` in
/// place (`interp::encode::hadamard::fwht_normalized`): the same butterflies, each
/// output rounded once per stage, the last stage's outputs then multiplied
/// by `(1 / sqrt(n) as f64) as f32`.
fn hadamard(k: &mut Kernel, ctx: &Ctx, plan: &Plan, n: u32, count: Reg<U32>) {
    if n <= 1 {
        return;
    }
    let scale = (1.0 / f64::from(n).sqrt()) as f32;
    let pairs = k.mul(count, n / 2);
    let mut h = 1;
    while h < n {
        let last = 2 * h == n;
        for_each(k, ctx, pairs, |k, w| {
            let (item, p) = split(k, w, n / 2);
            let (block, offset) = split(k, p, h);
            let i = k.mad_lo(block, 2 * h, offset);
            let i = k.mad_lo(item, n, i);
            let at = ctx.shared_word(k, plan.x, i);
            let other = at.plus(4 * i64::from(h));
            let u: Reg<F32> = k.ld_shared(at);
            let v: Reg<F32> = k.ld_shared(other);
            let mut a = k.add(u, v);
            let mut b = k.sub(u, v);
            if last {
                a = k.mul(a, scale);
                b = k.mul(b, scale);
            }
            k.st_shared(at, a);
            k.st_shared(other, b);
        });
        k.bar_sync();
        h *= 2;
    }
}
