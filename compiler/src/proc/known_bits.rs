//! Bits of an expression's value known from the expression alone: trailing
//! zeros (the alignment of bit offsets, so a field read can take one aligned
//! load) and significant bits (so a small integer converts to f32 exactly
//! without the conversion unit).

use crate::ir::{Arena, BinaryOp, Expr, Handle, Input, Literal, UnaryOp};

/// Trailing zero bits every u32 expression is known to have (32 for zero, 0
/// when unknown). `channel`: the zeros `Input::Channel` is known to have.
pub fn known_zeros(exprs: &Arena<Expr>, channel: u32) -> Vec<u32> {
    let mut zeros: Vec<u32> = Vec::with_capacity(exprs.len());
    for (_, expr) in exprs.iter() {
        let z = |h: Handle<Expr>| zeros[h.index()];
        let value = match *expr {
            Expr::Literal(Literal::U32(v)) => v.trailing_zeros(),
            Expr::Input(Input::Channel) => channel,
            Expr::Binary { op, left, right } => match op {
                BinaryOp::Add | BinaryOp::Subtract | BinaryOp::Or | BinaryOp::Min => {
                    z(left).min(z(right))
                }
                BinaryOp::Multiply => (z(left) + z(right)).min(32),
                BinaryOp::And => z(left).max(z(right)),
                BinaryOp::ShiftLeft => match exprs[right] {
                    Expr::Literal(Literal::U32(amount)) => (z(left) + amount).min(32),
                    _ => z(left),
                },
                // By a power of two: the quotient keeps the zeros above it;
                // the remainder of a multiple of the divisor is zero.
                BinaryOp::Divide | BinaryOp::Modulo => match exprs[right] {
                    Expr::Literal(Literal::U32(d)) if d.is_power_of_two() => {
                        let k = d.trailing_zeros();
                        match op {
                            BinaryOp::Divide => z(left).saturating_sub(k),
                            _ if z(left) >= k => 32,
                            _ => z(left),
                        }
                    }
                    _ => 0,
                },
                _ => 0,
            },
            Expr::Select { accept, reject, .. } => z(accept).min(z(reject)),
            _ => 0,
        };
        zeros.push(value);
    }
    zeros
}

/// Bits of a u32 value (it is below `2^bits`) or of an i32 value (it is in
/// `[-2^(bits-1), 2^(bits-1))`), from item field widths, sign extensions,
/// masks and shifts; 32 when nothing is known.
pub fn significant_bits(exprs: &Arena<Expr>) -> Vec<u32> {
    let mut bits: Vec<u32> = Vec::with_capacity(exprs.len());
    for (_, expr) in exprs.iter() {
        let b = |h: Handle<Expr>| bits[h.index()];
        let value = match *expr {
            Expr::Literal(Literal::U32(v)) => 32 - v.leading_zeros(),
            Expr::ItemBits { width, .. } => width.into(),
            Expr::Unary {
                op: UnaryOp::SignExtend(n),
                ..
            } => n.into(),
            Expr::Binary { op, left, right } => match op {
                // And and shifts exist on u32 only; min also on i32, where
                // min(-2^20, 3) needs the wider operand's bits.
                BinaryOp::And => b(left).min(b(right)),
                BinaryOp::Min => b(left).max(b(right)),
                BinaryOp::ShiftRight => match exprs[right] {
                    Expr::Literal(Literal::U32(amount)) => b(left).saturating_sub(amount),
                    _ => b(left),
                },
                _ => 32,
            },
            _ => 32,
        };
        bits.push(value);
    }
    bits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Arena;

    #[test]
    fn shifts_and_power_of_two_divisions_keep_known_zeros() {
        let mut exprs = Arena::default();
        let channel = exprs.append(Expr::Input(Input::Channel));
        let four = exprs.append(Expr::Literal(Literal::U32(4)));
        let shifted = exprs.append(Expr::Binary {
            op: BinaryOp::ShiftLeft,
            left: channel,
            right: four,
        });
        let divided = exprs.append(Expr::Binary {
            op: BinaryOp::Divide,
            left: shifted,
            right: four,
        });
        let rest = exprs.append(Expr::Binary {
            op: BinaryOp::Modulo,
            left: shifted,
            right: four,
        });
        let zeros = known_zeros(&exprs, 1);
        assert_eq!(
            [channel, shifted, divided, rest].map(|h| zeros[h.index()]),
            [1, 5, 3, 32]
        );
    }
}
