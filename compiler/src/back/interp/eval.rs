//! Evaluates IR programs one expression at a time: the executable definition of
//! what each IR operation means.

use crate::ir::{Arena, BinaryOp, Expr, Function, Handle, Input, Literal, Stage, UnaryOp};
use crate::layout::bits::read_bits;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
}

impl Value {
    fn u32(self) -> u32 {
        match self {
            Value::U32(v) => v,
            other => unreachable!("validated IR: expected u32, got {other:?}"),
        }
    }
    fn f32(self) -> f32 {
        match self {
            Value::F32(v) => v,
            other => unreachable!("validated IR: expected f32, got {other:?}"),
        }
    }
    fn bool(self) -> bool {
        match self {
            Value::Bool(v) => v,
            other => unreachable!("validated IR: expected bool, got {other:?}"),
        }
    }
}

/// What a program can read.
pub struct Env<'a> {
    /// The current item's bytes in the program's codec stream.
    pub item: &'a [u8],
    pub header_scales: &'a [f32],
    pub tables: &'a [Vec<f32>],
    pub arrays: &'a [Vec<f32>],
    pub channel: u32,
    pub iteration: u32,
    pub denominator: f32,
}

fn eval_expr(expr: &Expr, values: &[Value], env: &Env) -> Value {
    let get = |h: Handle<Expr>| values[h.index()];
    match *expr {
        Expr::Literal(Literal::U32(v)) => Value::U32(v),
        Expr::Literal(Literal::I32(v)) => Value::I32(v),
        Expr::Literal(Literal::F32(v)) => Value::F32(v),
        Expr::Input(Input::Channel) => Value::U32(env.channel),
        Expr::Input(Input::Iteration) => Value::U32(env.iteration),
        Expr::Input(Input::Denominator) => Value::F32(env.denominator),
        Expr::ItemBits { bit_offset, width } => {
            Value::U32(read_bits(env.item, get(bit_offset).u32(), width.into()))
        }
        Expr::HeaderScale { slot } => Value::F32(env.header_scales[get(slot).u32() as usize]),
        Expr::Table { table, index } => {
            Value::F32(env.tables[table.index()][get(index).u32() as usize])
        }
        Expr::Shared { array, index } => {
            Value::F32(env.arrays[array.index()][get(index).u32() as usize])
        }
        Expr::Unary { op, arg } => unary(op, get(arg)),
        Expr::Binary { op, left, right } => binary(op, get(left), get(right)),
        Expr::Fma { a, b, c } => Value::F32(get(a).f32().mul_add(get(b).f32(), get(c).f32())),
        Expr::Select {
            condition,
            accept,
            reject,
        } => {
            if get(condition).bool() {
                get(accept)
            } else {
                get(reject)
            }
        }
    }
}

pub(crate) fn unary(op: UnaryOp, v: Value) -> Value {
    match (op, v) {
        (UnaryOp::Negate, Value::F32(x)) => Value::F32(-x),
        (UnaryOp::Negate, Value::I32(x)) => Value::I32(x.wrapping_neg()),
        (UnaryOp::Popcount, Value::U32(x)) => Value::U32(x.count_ones()),
        (UnaryOp::HalfToFloat, Value::U32(x)) => {
            Value::F32(half::f16::from_bits(x as u16).to_f32())
        }
        (UnaryOp::BfloatToFloat, Value::U32(x)) => Value::F32(f32::from_bits((x & 0xFFFF) << 16)),
        (UnaryOp::BitsToFloat, Value::U32(x)) => Value::F32(f32::from_bits(x)),
        (UnaryOp::Fp8ToFloat(format), Value::U32(x)) => Value::F32(format.decode(x)),
        (UnaryOp::ToFloat, Value::U32(x)) => Value::F32(x as f32),
        (UnaryOp::ToFloat, Value::I32(x)) => Value::F32(x as f32),
        (UnaryOp::SignExtend(bits), Value::U32(x)) => {
            let unused = 32 - u32::from(bits);
            Value::I32(((x << unused) as i32) >> unused)
        }
        (op, v) => unreachable!("validated IR: {op:?} on {v:?}"),
    }
}

pub(crate) fn binary(op: BinaryOp, a: Value, b: Value) -> Value {
    use Value::*;
    match (op, a, b) {
        (BinaryOp::Add, U32(x), U32(y)) => U32(x.wrapping_add(y)),
        (BinaryOp::Add, I32(x), I32(y)) => I32(x.wrapping_add(y)),
        (BinaryOp::Add, F32(x), F32(y)) => F32(x + y),
        (BinaryOp::Subtract, U32(x), U32(y)) => U32(x.wrapping_sub(y)),
        (BinaryOp::Subtract, I32(x), I32(y)) => I32(x.wrapping_sub(y)),
        (BinaryOp::Subtract, F32(x), F32(y)) => F32(x - y),
        (BinaryOp::Multiply, U32(x), U32(y)) => U32(x.wrapping_mul(y)),
        (BinaryOp::Multiply, I32(x), I32(y)) => I32(x.wrapping_mul(y)),
        (BinaryOp::Multiply, F32(x), F32(y)) => F32(x * y),
        (BinaryOp::Divide, U32(x), U32(y)) => U32(x / y),
        (BinaryOp::Divide, F32(x), F32(y)) => F32(x / y),
        (BinaryOp::Modulo, U32(x), U32(y)) => U32(x % y),
        (BinaryOp::Min, U32(x), U32(y)) => U32(x.min(y)),
        (BinaryOp::Min, I32(x), I32(y)) => I32(x.min(y)),
        (BinaryOp::Min, F32(x), F32(y)) => F32(x.min(y)),
        (BinaryOp::And, U32(x), U32(y)) => U32(x & y),
        (BinaryOp::Or, U32(x), U32(y)) => U32(x | y),
        (BinaryOp::ShiftLeft, U32(x), U32(y)) => U32(x << y),
        (BinaryOp::ShiftRight, U32(x), U32(y)) => U32(x >> y),
        (BinaryOp::Less, U32(x), U32(y)) => Bool(x < y),
        (BinaryOp::Less, I32(x), I32(y)) => Bool(x < y),
        (BinaryOp::Less, F32(x), F32(y)) => Bool(x < y),
        (BinaryOp::Equal, x, y) => Bool(x == y),
        (BinaryOp::NotEqual, x, y) => Bool(x != y),
        (op, a, b) => unreachable!("validated IR: {op:?} on {a:?}, {b:?}"),
    }
}

fn eval_all(exprs: &Arena<Expr>, env: &Env, values: &mut Vec<Value>) {
    values.clear();
    for (_, expr) in exprs.iter() {
        let value = eval_expr(expr, values, env);
        values.push(value);
    }
}

/// Runs a function; `values` is scratch reused across calls.
pub fn run_function(function: &Function, env: &Env, values: &mut Vec<Value>) -> f32 {
    eval_all(&function.exprs, env, values);
    values[function
        .result
        .expect("validated functions have a result")
        .index()]
    .f32()
}

/// Runs every iteration of a stage, then applies its stores (iterations are
/// independent, so the order does not matter).
pub fn run_stage(stage: &Stage, env: &Env, values: &mut Vec<Value>) -> Vec<(usize, usize, f32)> {
    let mut writes = Vec::with_capacity(stage.iterations as usize * stage.stores.len());
    for iteration in 0..stage.iterations {
        let env = Env { iteration, ..*env };
        eval_all(&stage.exprs, &env, values);
        for store in &stage.stores {
            writes.push((
                store.array.index(),
                values[store.index.index()].u32() as usize,
                values[store.value.index()].f32(),
            ));
        }
    }
    writes
}
