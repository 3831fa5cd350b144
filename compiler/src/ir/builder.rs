//! Emits expressions into an arena, folding integer constants so lowering can
//! write index arithmetic plainly and still get compact, fully unrolled code.

use std::collections::HashMap;

use super::{
    Arena, ArrayDecl, BinaryOp, Expr, Handle, Input, Literal, Scalar, Stage, Store, TableDecl,
    UnaryOp,
};

pub struct ExprBuilder<'a> {
    exprs: &'a mut Arena<Expr>,
    /// Each distinct literal is emitted once.
    literals: HashMap<(Scalar, u32), Handle<Expr>>,
}

impl<'a> ExprBuilder<'a> {
    pub fn new(exprs: &'a mut Arena<Expr>) -> Self {
        let literals = exprs
            .iter()
            .filter_map(|(h, e)| match *e {
                Expr::Literal(l) => Some((literal_key(l), h)),
                _ => None,
            })
            .collect();
        ExprBuilder { exprs, literals }
    }

    /// A literal of any type, emitted once.
    pub fn literal(&mut self, literal: Literal) -> Handle<Expr> {
        let key = literal_key(literal);
        if let Some(&h) = self.literals.get(&key) {
            return h;
        }
        let h = self.emit(Expr::Literal(literal));
        self.literals.insert(key, h);
        h
    }

    fn emit(&mut self, expr: Expr) -> Handle<Expr> {
        self.exprs.append(expr)
    }

    fn literal_u32(&self, handle: Handle<Expr>) -> Option<u32> {
        match self.exprs[handle] {
            Expr::Literal(Literal::U32(v)) => Some(v),
            _ => None,
        }
    }

    pub fn u32(&mut self, value: u32) -> Handle<Expr> {
        self.literal(Literal::U32(value))
    }
    pub fn f32(&mut self, value: f32) -> Handle<Expr> {
        self.literal(Literal::F32(value))
    }
    pub fn input(&mut self, input: Input) -> Handle<Expr> {
        self.emit(Expr::Input(input))
    }
    pub fn item_bits(&mut self, bit_offset: Handle<Expr>, width: u32) -> Handle<Expr> {
        self.emit(Expr::ItemBits {
            bit_offset,
            width: width as u8,
        })
    }
    /// `width` bits at a constant offset.
    pub fn item_bits_at(&mut self, bit_offset: u32, width: u32) -> Handle<Expr> {
        let offset = self.u32(bit_offset);
        self.item_bits(offset, width)
    }
    pub fn header_scale(&mut self, slot: Handle<Expr>) -> Handle<Expr> {
        self.emit(Expr::HeaderScale { slot })
    }
    pub fn header_scale_at(&mut self, slot: u32) -> Handle<Expr> {
        let slot = self.u32(slot);
        self.header_scale(slot)
    }
    pub fn table(&mut self, table: Handle<TableDecl>, index: Handle<Expr>) -> Handle<Expr> {
        self.emit(Expr::Table { table, index })
    }
    pub fn table_at(&mut self, table: Handle<TableDecl>, index: u32) -> Handle<Expr> {
        let index = self.u32(index);
        self.table(table, index)
    }
    pub fn shared(&mut self, array: Handle<ArrayDecl>, index: Handle<Expr>) -> Handle<Expr> {
        self.emit(Expr::Shared { array, index })
    }
    pub fn shared_at(&mut self, array: Handle<ArrayDecl>, index: u32) -> Handle<Expr> {
        let index = self.u32(index);
        self.shared(array, index)
    }
    pub fn unary(&mut self, op: UnaryOp, arg: Handle<Expr>) -> Handle<Expr> {
        if let (UnaryOp::Popcount, Some(v)) = (op, self.literal_u32(arg)) {
            return self.u32(v.count_ones());
        }
        self.emit(Expr::Unary { op, arg })
    }

    /// Binary op; u32 operations on two literals fold, and `x + 0`, `x * 1`,
    /// `x * 0` simplify.
    pub fn binary(
        &mut self,
        op: BinaryOp,
        left: Handle<Expr>,
        right: Handle<Expr>,
    ) -> Handle<Expr> {
        match (self.literal_u32(left), self.literal_u32(right)) {
            (Some(a), Some(b)) => {
                if let Some(v) = fold_u32(op, a, b) {
                    return self.u32(v);
                }
            }
            (Some(0), None) if matches!(op, BinaryOp::Add | BinaryOp::Or) => return right,
            (None, Some(0))
                if matches!(
                    op,
                    BinaryOp::Add
                        | BinaryOp::Subtract
                        | BinaryOp::Or
                        | BinaryOp::ShiftLeft
                        | BinaryOp::ShiftRight
                ) =>
            {
                return left
            }
            (Some(1), None) if op == BinaryOp::Multiply => return right,
            (None, Some(1)) if matches!(op, BinaryOp::Multiply | BinaryOp::Divide) => return left,
            (Some(0), None) | (None, Some(0)) if op == BinaryOp::Multiply => return self.u32(0),
            _ => {}
        }
        self.emit(Expr::Binary { op, left, right })
    }
    pub fn add(&mut self, a: Handle<Expr>, b: Handle<Expr>) -> Handle<Expr> {
        self.binary(BinaryOp::Add, a, b)
    }
    pub fn mul(&mut self, a: Handle<Expr>, b: Handle<Expr>) -> Handle<Expr> {
        self.binary(BinaryOp::Multiply, a, b)
    }
    pub fn add_u32(&mut self, a: Handle<Expr>, b: u32) -> Handle<Expr> {
        if b == 0 {
            return a;
        }
        let b = self.u32(b);
        self.add(a, b)
    }
    pub fn mul_u32(&mut self, a: Handle<Expr>, b: u32) -> Handle<Expr> {
        if b == 1 {
            return a;
        }
        let b = self.u32(b);
        self.mul(a, b)
    }
    pub fn div_u32(&mut self, a: Handle<Expr>, b: u32) -> Handle<Expr> {
        let b = self.u32(b);
        self.binary(BinaryOp::Divide, a, b)
    }
    pub fn rem_u32(&mut self, a: Handle<Expr>, b: u32) -> Handle<Expr> {
        let b = self.u32(b);
        self.binary(BinaryOp::Modulo, a, b)
    }
    pub fn fma(&mut self, a: Handle<Expr>, b: Handle<Expr>, c: Handle<Expr>) -> Handle<Expr> {
        self.emit(Expr::Fma { a, b, c })
    }
    pub fn select(
        &mut self,
        condition: Handle<Expr>,
        accept: Handle<Expr>,
        reject: Handle<Expr>,
    ) -> Handle<Expr> {
        self.emit(Expr::Select {
            condition,
            accept,
            reject,
        })
    }
    pub fn to_float(&mut self, value: Handle<Expr>) -> Handle<Expr> {
        self.unary(UnaryOp::ToFloat, value)
    }

    /// Σ a_i * b_i as a chain of fmas (left to right, starting from `init`).
    pub fn dot(
        &mut self,
        init: Handle<Expr>,
        terms: impl IntoIterator<Item = (Handle<Expr>, Handle<Expr>)>,
    ) -> Handle<Expr> {
        terms
            .into_iter()
            .fold(init, |acc, (a, b)| self.fma(a, b, acc))
    }
}

fn literal_key(literal: Literal) -> (Scalar, u32) {
    match literal {
        Literal::U32(v) => (Scalar::U32, v),
        Literal::I32(v) => (Scalar::I32, v as u32),
        Literal::F32(v) => (Scalar::F32, v.to_bits()),
    }
}

fn fold_u32(op: BinaryOp, a: u32, b: u32) -> Option<u32> {
    Some(match op {
        BinaryOp::Add => a.checked_add(b)?,
        BinaryOp::Subtract => a.checked_sub(b)?,
        BinaryOp::Multiply => a.checked_mul(b)?,
        BinaryOp::Divide => a.checked_div(b)?,
        BinaryOp::Modulo => a.checked_rem(b)?,
        BinaryOp::Min => a.min(b),
        BinaryOp::And => a & b,
        BinaryOp::Or => a | b,
        BinaryOp::ShiftLeft => a.checked_shl(b)?,
        BinaryOp::ShiftRight => a.checked_shr(b)?,
        BinaryOp::Less | BinaryOp::Equal | BinaryOp::NotEqual => return None,
    })
}

impl Stage {
    /// A stage of `iterations`, its body built by `body(builder, iteration)`
    /// returning the stores.
    pub fn build(
        iterations: u32,
        body: impl FnOnce(
            &mut ExprBuilder,
            Handle<Expr>,
        ) -> Vec<(Handle<ArrayDecl>, Handle<Expr>, Handle<Expr>)>,
    ) -> Stage {
        let mut exprs = Arena::default();
        let mut b = ExprBuilder::new(&mut exprs);
        let iteration = if iterations == 1 {
            b.u32(0)
        } else {
            b.input(Input::Iteration)
        };
        let stores = body(&mut b, iteration)
            .into_iter()
            .map(|(array, index, value)| Store {
                array,
                index,
                value,
            })
            .collect();
        Stage {
            iterations,
            exprs,
            stores,
        }
    }
}
