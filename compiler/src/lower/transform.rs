//! Transforms as kernel stages: applied to the query in the key prologue and
//! inverted on the accumulator in the value epilogue.

use crate::ir::builder::ExprBuilder;
use crate::ir::{Arena, ArrayDecl, BinaryOp, Expr, Handle, Input, Stage, TableDecl};

/// Normalized Walsh–Hadamard transform of `input` into `output` as log2(n)
/// butterfly stages (Sylvester order), ping-ponging through `scratch`.
/// `pre_signs` multiplies the input first (SRHT forward: H·D), `post_signs` the
/// result (SRHT inverse: D·H).
pub fn fwht(
    n: u32,
    input: Handle<ArrayDecl>,
    output: Handle<ArrayDecl>,
    scratch: [Handle<ArrayDecl>; 2],
    pre_signs: Option<Handle<TableDecl>>,
    post_signs: Option<Handle<TableDecl>>,
) -> Vec<Stage> {
    let steps = n.trailing_zeros();
    let norm = 1.0 / (n as f32).sqrt();
    let mut source = input;
    (0..steps)
        .map(|step| {
            let last = step + 1 == steps;
            let target = if last {
                output
            } else {
                scratch[step as usize % 2]
            };
            let half = 1u32 << step;
            let from = source;
            source = target;
            Stage::build(n / 2, |b, i| {
                // Pair (a, a + half) with a = (i / half) * 2 * half + i % half.
                let block = b.div_u32(i, half);
                let block_start = b.mul_u32(block, 2 * half);
                let within = b.rem_u32(i, half);
                let a = b.add(block_start, within);
                let c = b.add_u32(a, half);
                let load = |b: &mut ExprBuilder, at| {
                    let x = b.shared(from, at);
                    match pre_signs.filter(|_| step == 0) {
                        Some(signs) => {
                            let s = b.table(signs, at);
                            b.binary(BinaryOp::Multiply, x, s)
                        }
                        None => x,
                    }
                };
                let x = load(b, a);
                let y = load(b, c);
                let mut sum = b.binary(BinaryOp::Add, x, y);
                let mut diff = b.binary(BinaryOp::Subtract, x, y);
                if last {
                    let scale = b.f32(norm);
                    sum = b.binary(BinaryOp::Multiply, sum, scale);
                    diff = b.binary(BinaryOp::Multiply, diff, scale);
                    if let Some(signs) = post_signs {
                        let sa = b.table(signs, a);
                        let sc = b.table(signs, c);
                        sum = b.binary(BinaryOp::Multiply, sum, sa);
                        diff = b.binary(BinaryOp::Multiply, diff, sc);
                    }
                }
                vec![(target, a, sum), (target, c, diff)]
            })
        })
        .collect()
}

/// q' = Bᵀ q: `rank` outputs, each a `dim`-term dot product.
pub fn project(
    dim: u32,
    rank: u32,
    basis: Handle<TableDecl>,
    input: Handle<ArrayDecl>,
    output: Handle<ArrayDecl>,
) -> Stage {
    Stage::build(rank, |b, k| {
        let zero = b.f32(0.0);
        let value = dot(b, zero, dim, |b, i| {
            let at = b.add_u32(k, i * rank);
            (b.table(basis, at), b.shared_at(input, i))
        });
        vec![(output, k, value)]
    })
}

/// `out[i] = Σ_k B[i][k]·acc[k] + μ[i]·l`: the PCA inverse on an unnormalized
/// accumulator whose weights sum to `Input::Denominator`.
pub fn reconstruct(
    dim: u32,
    rank: u32,
    basis: Handle<TableDecl>,
    mean: Handle<TableDecl>,
    input: Handle<ArrayDecl>,
    output: Handle<ArrayDecl>,
) -> Stage {
    Stage::build(dim, |b, i| {
        let mu = b.table(mean, i);
        let l = b.input(Input::Denominator);
        let init = b.binary(BinaryOp::Multiply, mu, l);
        let row = b.mul_u32(i, rank);
        let value = dot(b, init, rank, |b, k| {
            let at = b.add_u32(row, k);
            (b.table(basis, at), b.shared_at(input, k))
        });
        vec![(output, i, value)]
    })
}

/// `Σ_i table[i]·input[i]` into `output[0]`.
pub fn dot_with_table(
    dim: u32,
    table: Handle<TableDecl>,
    input: Handle<ArrayDecl>,
    output: Handle<ArrayDecl>,
) -> Stage {
    Stage::build(1, |b, zero_index| {
        let zero = b.f32(0.0);
        let value = dot(b, zero, dim, |b, i| {
            (b.table_at(table, i), b.shared_at(input, i))
        });
        vec![(output, zero_index, value)]
    })
}

/// `init + Σ_i a_i·b_i` over the `n` pairs `term(b, i)` emits, in order.
pub fn dot(
    b: &mut ExprBuilder,
    init: Handle<Expr>,
    n: u32,
    mut term: impl FnMut(&mut ExprBuilder, u32) -> (Handle<Expr>, Handle<Expr>),
) -> Handle<Expr> {
    let terms: Vec<_> = (0..n).map(|i| term(b, i)).collect();
    b.dot(init, terms)
}

/// `output[i] = input[i] · factor(i)`, for `n` elements.
pub fn elementwise(
    n: u32,
    input: Handle<ArrayDecl>,
    output: Handle<ArrayDecl>,
    factor: Option<Handle<TableDecl>>,
) -> Stage {
    Stage::build(n, |b, i| {
        let x = b.shared(input, i);
        let value = match factor {
            Some(table) => {
                let s = b.table(table, i);
                b.binary(BinaryOp::Multiply, x, s)
            }
            None => x,
        };
        vec![(output, i, value)]
    })
}

/// `output[i] = input[i] · table[0]`, for `n` elements (one trained scale).
pub fn scaled_by_one(
    n: u32,
    input: Handle<ArrayDecl>,
    output: Handle<ArrayDecl>,
    table: Handle<TableDecl>,
) -> Stage {
    Stage::build(n, |b, i| {
        let x = b.shared(input, i);
        let s = b.table_at(table, 0);
        vec![(output, i, b.binary(BinaryOp::Multiply, x, s))]
    })
}

/// Declares a shared array.
pub fn array(arrays: &mut Arena<ArrayDecl>, name: String, len: u32) -> Handle<ArrayDecl> {
    arrays.append(ArrayDecl { name, len })
}
