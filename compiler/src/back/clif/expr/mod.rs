//! IR expressions -> CLIF values.
//!
//! A program runs over `lanes` SIMD lanes at once: items in `key.score`,
//! channels in `value.accumulate` (one lane in kernels). Each expression is
//! lowered to a [`Val`] that says how much is known about it: a compile-time
//! constant (folded with the interpreter's own `eval` functions, so folding
//! cannot drift from the semantics), per-lane constants (channel arithmetic of
//! an unrolled accumulate), a runtime base plus per-lane constant offsets
//! (contiguous table rows), a runtime scalar shared by every lane, or a CLIF
//! vector. Vector instructions are emitted only where an operand varies by
//! lane; operations Cranelift has no vector form for run lane by lane.

use std::collections::HashMap;

use cranelift_codegen::cursor::{Cursor, FuncCursor};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::immediates::Ieee32;
use cranelift_codegen::ir::{
    self, types, ConstantData, Endianness, InstBuilder, MemFlagsData, StackSlotData, StackSlotKind,
    ValueDef,
};
use cranelift_frontend::FunctionBuilder;

use crate::back::interp::eval::{self, Value as Known};
use crate::ir::{BinaryOp, Literal, Scalar, UnaryOp};

mod unary;

/// Lanes of a vector: f32x4 / i32x4, the SIMD width Cranelift has on every host.
pub(super) const LANES: usize = 4;

#[derive(Debug, Clone, Copy)]
pub(super) enum Val {
    /// Known at compile time, the same in every lane.
    Const(Known),
    /// Known at compile time, lane by lane (never all equal: that is `Const`).
    Lanes([Known; LANES]),
    /// u32 lane k = `base + offsets[k]` (wrapping), `base` a runtime i32.
    Offset {
        base: ir::Value,
        offsets: [u32; LANES],
    },
    /// A runtime scalar shared by every lane (Bool as i8 0/1).
    Uniform(ir::Value),
    /// A runtime vector (Bool as an i32x4 lane mask).
    Vector(ir::Value),
}

impl Val {
    fn varies(self) -> bool {
        matches!(self, Val::Lanes(_) | Val::Offset { .. } | Val::Vector(_))
    }

    /// Per-lane compile-time values, if known.
    pub(super) fn known(self) -> Option<[Known; LANES]> {
        match self {
            Val::Const(k) => Some([k; LANES]),
            Val::Lanes(ks) => Some(ks),
            _ => None,
        }
    }

    pub(super) fn from_known(ks: [Known; LANES]) -> Val {
        if ks.iter().all(|k| *k == ks[0]) {
            Val::Const(ks[0])
        } else {
            Val::Lanes(ks)
        }
    }
}

pub(super) fn literal(literal: Literal) -> Known {
    match literal {
        Literal::U32(v) => Known::U32(v),
        Literal::I32(v) => Known::I32(v),
        Literal::F32(v) => Known::F32(v),
    }
}

pub(super) fn known_u32(k: Known) -> u32 {
    match k {
        Known::U32(v) => v,
        other => unreachable!("validated IR: expected u32, got {other:?}"),
    }
}

fn scalar_type(ty: Scalar) -> ir::Type {
    match ty {
        Scalar::U32 | Scalar::I32 => types::I32,
        Scalar::F32 => types::F32,
        Scalar::Bool => types::I8,
    }
}

fn vector_type(ty: Scalar) -> ir::Type {
    match ty {
        Scalar::F32 => types::F32X4,
        Scalar::U32 | Scalar::I32 | Scalar::Bool => types::I32X4,
    }
}

/// Flags of loads from memory nothing writes while the function runs (tables,
/// page headers, a score's shared arrays, weights): free to move.
pub(super) fn invariant() -> MemFlagsData {
    MemFlagsData::new()
        .with_notrap()
        .with_readonly()
        .with_can_move()
        .with_endianness(Endianness::Little)
}

/// Flags of loads from the page streams: in bounds, never written.
pub(super) fn stream() -> MemFlagsData {
    MemFlagsData::new()
        .with_notrap()
        .with_readonly()
        .with_endianness(Endianness::Little)
}

/// Flags of reads and writes of buffers the kernels write (accumulators,
/// logits, kernel arrays): in bounds, ordered.
pub(super) fn writable() -> MemFlagsData {
    MemFlagsData::new()
        .with_notrap()
        .with_endianness(Endianness::Little)
}

/// A function under construction, with the caches lowering uses.
pub(super) struct Fx<'f> {
    pub b: FunctionBuilder<'f>,
    /// 1 (scalar code) or [`LANES`].
    pub lanes: usize,
    pub cached: Cached,
    /// `masked -> (source, width)` for `masked = source & (2^width - 1)`
    /// (stream.rs), so conversions that ignore the high bits skip the mask.
    pub low_bits: HashMap<ir::Value, (ir::Value, u32)>,
    hoist: Option<Hoist>,
}

/// Values already computed in the current block or one dominating it: code
/// is emitted in program order with no e-graph pass, so lowering reuses them
/// itself (the IR repeats subexpressions, e.g. a bitmap's mask popcount for
/// every element).
#[derive(Clone, Default)]
pub(super) struct Cached {
    splats: HashMap<(ir::Value, bool), ir::Value>,
    /// Stream words gathered across the lanes' items, by byte offset (stream.rs).
    pub words: HashMap<u32, ir::Value>,
    /// Results of unary and binary operations, by operation and operands.
    ops: HashMap<(Operation, Scalar, ir::Value, Option<ir::Value>), ir::Value>,
}

/// An IR operation as a cache key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Operation {
    Unary(u16),
    Binary(u16),
}

impl Operation {
    fn unary(op: UnaryOp) -> Operation {
        Operation::Unary(match op {
            UnaryOp::Negate => 0,
            UnaryOp::Popcount => 1,
            UnaryOp::HalfToFloat => 2,
            UnaryOp::BfloatToFloat => 3,
            UnaryOp::BitsToFloat => 4,
            UnaryOp::ToFloat => 5,
            UnaryOp::SignExtend(bits) => 6 + u16::from(bits),
            UnaryOp::Fp8ToFloat(crate::spec::Fp8::E4m3) => 100,
            UnaryOp::Fp8ToFloat(crate::spec::Fp8::E5m2) => 101,
        })
    }

    fn binary(op: BinaryOp) -> Operation {
        Operation::Binary(op as u16)
    }
}

/// Vectors a loop body reads but that do not change in the loop (constants,
/// splats of values computed before it): computed once before the loop into a
/// stack area and loaded in the body, where x64 folds a load used once into
/// the instruction that uses it. (Code is emitted in program order, without
/// Cranelift's e-graph pass, whose placement of pure values at their last use
/// spills long fma chains; so loop-invariant code motion is done here.)
struct Hoist {
    preheader: ir::Block,
    /// The preheader's jump into the loop: hoisted code goes before it.
    before: ir::Inst,
    area: Option<(ir::StackSlot, ir::Value)>,
    offsets: HashMap<Hoisted, u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Hoisted {
    Constant([u8; 16]),
    Splat(ir::Value, bool),
}

impl<'f> Fx<'f> {
    pub fn new(b: FunctionBuilder<'f>, lanes: usize) -> Fx<'f> {
        Fx {
            b,
            lanes,
            cached: Cached::default(),
            low_bits: HashMap::new(),
            hoist: None,
        }
    }

    /// From now until `end_loop`, vectors invariant in the loop are computed
    /// before `before`, the preheader's jump into it.
    pub fn begin_loop(&mut self, preheader: ir::Block, before: ir::Inst) {
        self.hoist = Some(Hoist {
            preheader,
            before,
            area: None,
            offsets: HashMap::new(),
        });
    }

    pub fn end_loop(&mut self) {
        self.hoist = None;
    }

    /// If `x` is computed before the current loop: where (its instruction,
    /// or `None` for a function parameter).
    fn loop_invariant(&self, x: ir::Value) -> Option<Option<ir::Inst>> {
        let hoist = self.hoist.as_ref()?;
        let layout = &self.b.func.layout;
        let (block, inst) = match self.b.func.dfg.value_def(x) {
            ValueDef::Result(inst, _) => (layout.inst_block(inst)?, Some(inst)),
            ValueDef::Param(block, _) => (block, None),
            _ => return None,
        };
        let before = block == hoist.preheader || Some(block) == layout.entry_block();
        match inst {
            Some(inst) if before => Some(Some(inst)),
            // A parameter of the entry block: a function argument.
            None if Some(block) == layout.entry_block() => Some(None),
            _ => None,
        }
    }

    /// The hoisted vector `key`, loaded where the builder is. On first use it
    /// is made by `make` and stored into the area, right after `after` (the
    /// definition it splats, so that value need not live through the
    /// preheader) or, for a constant, before the jump into the loop.
    fn hoisted(
        &mut self,
        key: Hoisted,
        ty: ir::Type,
        after: Option<ir::Inst>,
        make: impl FnOnce(&mut FuncCursor) -> ir::Value,
    ) -> ir::Value {
        let hoist = self.hoist.as_mut().expect("inside a loop");
        let flags = MemFlagsData::trusted().with_endianness(Endianness::Little);
        let count = hoist.offsets.len() as u32;
        let func = &mut *self.b.func;
        let (slot, base) = *hoist.area.get_or_insert_with(|| {
            // At the top of the function, so it dominates every store.
            let entry = func.layout.entry_block().expect("entry block");
            let mut pos = FuncCursor::new(func).at_first_insertion_point(entry);
            let slot = pos.func.create_sized_stack_slot(StackSlotData::new(
                StackSlotKind::ExplicitSlot,
                0,
                4,
            ));
            (slot, pos.ins().stack_addr(types::I64, slot, 0))
        });
        let offset = *hoist.offsets.entry(key).or_insert_with(|| {
            let mut pos = match after {
                Some(inst) => FuncCursor::new(func).after_inst(inst),
                None => FuncCursor::new(func).at_inst(hoist.before),
            };
            let v = make(&mut pos);
            let offset = 16 * count;
            pos.ins().store(flags, v, base, offset as i32);
            pos.func.sized_stack_slots[slot].size = offset + 16;
            offset
        });
        self.b.ins().load(ty, flags, base, offset as i32)
    }

    /// Switches to `block`; cached values of the previous block may not
    /// dominate it, so the caches start empty.
    pub fn switch_to(&mut self, block: ir::Block) {
        self.b.switch_to_block(block);
        self.cached = Cached::default();
    }

    pub fn iconst(&mut self, v: u32) -> ir::Value {
        self.b.ins().iconst(types::I32, i64::from(v))
    }

    /// A compile-time value as a scalar.
    pub fn konst(&mut self, k: Known) -> ir::Value {
        match k {
            Known::U32(v) => self.iconst(v),
            Known::I32(v) => self.iconst(v as u32),
            Known::F32(v) => self.b.ins().f32const(Ieee32::with_bits(v.to_bits())),
            Known::Bool(v) => self.b.ins().iconst(types::I8, i64::from(v)),
        }
    }

    /// Compile-time lanes as a vector constant.
    fn vconst(&mut self, ty: Scalar, ks: [Known; LANES]) -> ir::Value {
        let mut bytes = Vec::with_capacity(4 * LANES);
        for k in ks {
            let bits = match k {
                Known::U32(v) => v,
                Known::I32(v) => v as u32,
                Known::F32(v) => v.to_bits(),
                Known::Bool(v) => 0u32.wrapping_sub(u32::from(v)),
            };
            bytes.extend_from_slice(&bits.to_le_bytes());
        }
        let ty = vector_type(ty);
        // All-zero and all-one vectors are one instruction; others a load.
        let trivial = bytes.iter().all(|&b| b == 0) || bytes.iter().all(|&b| b == 0xFF);
        if self.hoist.is_some() && !trivial {
            let key = Hoisted::Constant(bytes.clone().try_into().expect("16 bytes"));
            return self.hoisted(key, ty, None, |pos| {
                let constant = pos.func.dfg.constants.insert(ConstantData::from(bytes));
                pos.ins().vconst(ty, constant)
            });
        }
        let constant = self.b.func.dfg.constants.insert(ConstantData::from(bytes));
        self.b.ins().vconst(ty, constant)
    }

    /// An integer constant as an i32 scalar or as an i32x4 splat.
    fn int(&mut self, vector: bool, v: u32) -> ir::Value {
        if vector {
            self.vconst(Scalar::U32, [Known::U32(v); LANES])
        } else {
            self.iconst(v)
        }
    }

    fn float(&mut self, vector: bool, v: f32) -> ir::Value {
        if vector {
            self.vconst(Scalar::F32, [Known::F32(v); LANES])
        } else {
            self.konst(Known::F32(v))
        }
    }

    fn splat(&mut self, x: ir::Value, ty: Scalar) -> ir::Value {
        let mask = ty == Scalar::Bool;
        if let Some(&v) = self.cached.splats.get(&(x, mask)) {
            return v;
        }
        let vector = vector_type(ty);
        let v = if let Some(after) = self.loop_invariant(x) {
            self.hoisted(Hoisted::Splat(x, mask), vector, after, |pos| {
                splat(pos, x, mask, vector)
            })
        } else {
            splat(&mut self.b.cursor(), x, mask, vector)
        };
        self.cached.splats.insert((x, mask), v);
        v
    }

    /// `v` (not varying by lane) as a scalar of `ty`.
    pub fn scalar(&mut self, v: Val) -> ir::Value {
        match v {
            Val::Const(k) => self.konst(k),
            Val::Uniform(x) => x,
            other => unreachable!("{other:?} varies by lane"),
        }
    }

    /// `v` as a vector of `ty` (Bool: an i32x4 mask).
    pub fn vector(&mut self, v: Val, ty: Scalar) -> ir::Value {
        match v {
            Val::Const(k) => self.vconst(ty, [k; LANES]),
            Val::Lanes(ks) => self.vconst(ty, ks),
            Val::Offset { base, offsets } => {
                let base = self.splat(base, Scalar::U32);
                let offsets = self.vconst(Scalar::U32, offsets.map(Known::U32));
                self.b.ins().iadd(base, offsets)
            }
            Val::Uniform(x) => self.splat(x, ty),
            Val::Vector(x) => x,
        }
    }

    /// Lane `k` of `v` as a scalar of `ty`.
    pub fn lane(&mut self, v: Val, k: usize, ty: Scalar) -> ir::Value {
        match v {
            Val::Const(c) => self.konst(c),
            Val::Lanes(ks) => self.konst(ks[k]),
            Val::Offset { base, offsets } => {
                let offset = self.iconst(offsets[k]);
                self.b.ins().iadd(base, offset)
            }
            Val::Uniform(x) => x,
            Val::Vector(x) => {
                let lane = self.b.ins().extractlane(x, k as u8);
                if ty == Scalar::Bool {
                    self.b.ins().icmp_imm_u(IntCC::NotEqual, lane, 0)
                } else {
                    lane
                }
            }
        }
    }

    /// A vector of `ty` whose lane k `lane(fx, k)` emits right before it is
    /// inserted (so x64 can fold a lane's load into the insert).
    pub fn build(
        &mut self,
        ty: Scalar,
        mut lane: impl FnMut(&mut Self, usize) -> ir::Value,
    ) -> ir::Value {
        let mut v = None;
        for k in 0..LANES {
            let mut x = lane(self, k);
            if ty == Scalar::Bool {
                let wide = self.b.ins().uextend(types::I32, x);
                x = self.b.ins().ineg(wide);
            }
            v = Some(match v {
                None => self.b.ins().scalar_to_vector(vector_type(ty), x),
                Some(v) => self.b.ins().insertlane(v, x, k as u8),
            });
        }
        v.expect("lanes")
    }

    /// `op` on each lane's scalars — the path for operations Cranelift has no
    /// vector instruction for.
    fn lanewise(
        &mut self,
        ty: Scalar,
        result: Scalar,
        operands: &[Val],
        op: impl Fn(&mut Self, &[ir::Value]) -> ir::Value,
    ) -> Val {
        Val::Vector(self.build(result, |fx, k| {
            let xs: Vec<ir::Value> = operands.iter().map(|&v| fx.lane(v, k, ty)).collect();
            op(fx, &xs)
        }))
    }

    /// `if condition { accept } else { reject }` on scalars (i8 condition) or
    /// vectors (lane mask).
    fn choose(
        &mut self,
        vector: bool,
        ty: Scalar,
        cond: ir::Value,
        accept: ir::Value,
        reject: ir::Value,
    ) -> ir::Value {
        if !vector {
            return self.b.ins().select(cond, accept, reject);
        }
        let mask = if ty == Scalar::F32 {
            self.b.ins().bitcast(
                types::F32X4,
                MemFlagsData::new().with_endianness(Endianness::Little),
                cond,
            )
        } else {
            cond
        };
        self.b.ins().bitselect(mask, accept, reject)
    }

    fn bitcast(&mut self, vector: bool, to: Scalar, x: ir::Value) -> ir::Value {
        let ty = if vector {
            vector_type(to)
        } else {
            scalar_type(to)
        };
        let flags = MemFlagsData::new().with_endianness(Endianness::Little);
        self.b.ins().bitcast(ty, flags, x)
    }

    /// The value of `op` on `x` (and `y`) if already computed, else `emit`'s.
    fn reuse(
        &mut self,
        op: Operation,
        ty: Scalar,
        x: ir::Value,
        y: Option<ir::Value>,
        emit: impl FnOnce(&mut Self) -> ir::Value,
    ) -> ir::Value {
        if let Some(&v) = self.cached.ops.get(&(op, ty, x, y)) {
            return v;
        }
        let v = emit(self);
        self.cached.ops.insert((op, ty, x, y), v);
        v
    }

    /// A binary operation on operands of type `ty`.
    pub fn binary(&mut self, op: BinaryOp, ty: Scalar, a: Val, b: Val) -> Val {
        if let (Some(x), Some(y)) = (a.known(), b.known()) {
            return Val::from_known(std::array::from_fn(|k| eval::binary(op, x[k], y[k])));
        }
        if ty == Scalar::U32 {
            if let Some(v) = self.offset(op, a, b) {
                return v;
            }
        }
        let result = match op {
            BinaryOp::Less | BinaryOp::Equal | BinaryOp::NotEqual => Scalar::Bool,
            _ => ty,
        };
        if !a.varies() && !b.varies() {
            let (x, y) = (self.scalar(a), self.scalar(b));
            return Val::Uniform(self.reuse(Operation::binary(op), ty, x, Some(y), |fx| {
                fx.emit_binary(op, ty, x, y, false)
            }));
        }
        let vector_form = match op {
            // x64 has no vector integer division; shifts take one amount for all lanes.
            BinaryOp::Divide | BinaryOp::Modulo => ty == Scalar::F32,
            BinaryOp::ShiftLeft | BinaryOp::ShiftRight => !b.varies(),
            _ => true,
        };
        if !vector_form {
            return self.lanewise(ty, result, &[a, b], |fx, xs| {
                fx.emit_binary(op, ty, xs[0], xs[1], false)
            });
        }
        let x = self.vector(a, ty);
        let y = if matches!(op, BinaryOp::ShiftLeft | BinaryOp::ShiftRight) {
            self.scalar(b)
        } else {
            self.vector(b, ty)
        };
        Val::Vector(self.reuse(Operation::binary(op), ty, x, Some(y), |fx| {
            fx.emit_binary(op, ty, x, y, true)
        }))
    }

    /// u32 arithmetic that keeps a runtime base plus per-lane constant
    /// offsets, so `table[row * n + lane]` becomes one vector load.
    fn offset(&mut self, op: BinaryOp, a: Val, b: Val) -> Option<Val> {
        let lanes = |v: Val| v.known().map(|ks| ks.map(known_u32));
        let add =
            |x: [u32; LANES], y: [u32; LANES]| std::array::from_fn(|k| x[k].wrapping_add(y[k]));
        match (op, a, b) {
            (BinaryOp::Add, Val::Uniform(base), Val::Lanes(ks))
            | (BinaryOp::Add, Val::Lanes(ks), Val::Uniform(base)) => Some(Val::Offset {
                base,
                offsets: ks.map(known_u32),
            }),
            (BinaryOp::Add, Val::Offset { base, offsets }, other)
            | (BinaryOp::Add, other, Val::Offset { base, offsets }) => match other {
                Val::Uniform(x) => Some(Val::Offset {
                    base: self.b.ins().iadd(base, x),
                    offsets,
                }),
                _ => lanes(other).map(|ks| Val::Offset {
                    base,
                    offsets: add(offsets, ks),
                }),
            },
            (BinaryOp::Subtract, Val::Offset { base, offsets }, other) => {
                lanes(other).map(|ks| Val::Offset {
                    base,
                    offsets: add(offsets, ks.map(u32::wrapping_neg)),
                })
            }
            (BinaryOp::Multiply, Val::Offset { base, offsets }, Val::Const(c))
            | (BinaryOp::Multiply, Val::Const(c), Val::Offset { base, offsets }) => {
                let c = known_u32(c);
                let factor = self.iconst(c);
                Some(Val::Offset {
                    base: self.b.ins().imul(base, factor),
                    offsets: offsets.map(|o| o.wrapping_mul(c)),
                })
            }
            _ => None,
        }
    }

    fn emit_binary(
        &mut self,
        op: BinaryOp,
        ty: Scalar,
        x: ir::Value,
        y: ir::Value,
        vector: bool,
    ) -> ir::Value {
        let float = ty == Scalar::F32;
        let ins = self.b.ins();
        match op {
            BinaryOp::Add if float => ins.fadd(x, y),
            BinaryOp::Add => ins.iadd(x, y),
            BinaryOp::Subtract if float => ins.fsub(x, y),
            BinaryOp::Subtract => ins.isub(x, y),
            BinaryOp::Multiply if float => ins.fmul(x, y),
            BinaryOp::Multiply => ins.imul(x, y),
            BinaryOp::Divide if float => ins.fdiv(x, y),
            BinaryOp::Divide => ins.udiv(x, y),
            BinaryOp::Modulo => ins.urem(x, y),
            BinaryOp::Min => match ty {
                Scalar::U32 => ins.umin(x, y),
                Scalar::I32 => ins.smin(x, y),
                _ => {
                    // f32::min: the other operand when one is NaN, else the
                    // smaller (LLVM's x86 lowering: y < x ? y : x, then x NaN -> y).
                    let less = ins.fcmp(FloatCC::LessThan, y, x);
                    let min = self.choose(vector, ty, less, y, x);
                    let nan = self.b.ins().fcmp(FloatCC::Unordered, x, x);
                    self.choose(vector, ty, nan, y, min)
                }
            },
            BinaryOp::And => ins.band(x, y),
            BinaryOp::Or => ins.bor(x, y),
            BinaryOp::ShiftLeft => ins.ishl(x, y),
            BinaryOp::ShiftRight => ins.ushr(x, y),
            BinaryOp::Less => match ty {
                Scalar::U32 => ins.icmp(IntCC::UnsignedLessThan, x, y),
                Scalar::I32 => ins.icmp(IntCC::SignedLessThan, x, y),
                _ => ins.fcmp(FloatCC::LessThan, x, y),
            },
            BinaryOp::Equal if float => ins.fcmp(FloatCC::Equal, x, y),
            BinaryOp::Equal => ins.icmp(IntCC::Equal, x, y),
            BinaryOp::NotEqual if float => ins.fcmp(FloatCC::NotEqual, x, y),
            BinaryOp::NotEqual => ins.icmp(IntCC::NotEqual, x, y),
        }
    }

    /// `a * b + c`, fused.
    pub fn fma(&mut self, a: Val, b: Val, c: Val) -> Val {
        if let (Some(x), Some(y), Some(z)) = (a.known(), b.known(), c.known()) {
            return Val::from_known(std::array::from_fn(|k| match (x[k], y[k], z[k]) {
                (Known::F32(x), Known::F32(y), Known::F32(z)) => Known::F32(x.mul_add(y, z)),
                other => unreachable!("validated IR: fma on {other:?}"),
            }));
        }
        if [a, b, c].iter().all(|v| !v.varies()) {
            let [x, y, z] = [a, b, c].map(|v| self.scalar(v));
            return Val::Uniform(self.b.ins().fma(x, y, z));
        }
        let [x, y, z] = [a, b, c].map(|v| self.vector(v, Scalar::F32));
        Val::Vector(self.b.ins().fma(x, y, z))
    }

    /// `if condition { accept } else { reject }` with values of type `ty`.
    pub fn select(&mut self, ty: Scalar, condition: Val, accept: Val, reject: Val) -> Val {
        match condition {
            Val::Const(Known::Bool(c)) => return if c { accept } else { reject },
            Val::Lanes(cs) => {
                if let (Some(a), Some(r)) = (accept.known(), reject.known()) {
                    return Val::from_known(std::array::from_fn(|k| {
                        if cs[k] == Known::Bool(true) {
                            a[k]
                        } else {
                            r[k]
                        }
                    }));
                }
            }
            _ => {}
        }
        if [condition, accept, reject].iter().all(|v| !v.varies()) {
            let c = self.scalar(condition);
            let (a, r) = (self.scalar(accept), self.scalar(reject));
            return Val::Uniform(self.b.ins().select(c, a, r));
        }
        let c = self.vector(condition, Scalar::Bool);
        let (a, r) = (self.vector(accept, ty), self.vector(reject, ty));
        Val::Vector(self.choose(true, ty, c, a, r))
    }

    /// f32 element `index` of the array at `base + offset` bytes.
    pub fn load_f32(
        &mut self,
        flags: MemFlagsData,
        base: ir::Value,
        offset: u32,
        index: Val,
    ) -> Val {
        let at = |i: u32| (offset + 4 * i) as i32;
        match index {
            Val::Const(k) => {
                Val::Uniform(self.b.ins().load(types::F32, flags, base, at(known_u32(k))))
            }
            Val::Uniform(i) => {
                let address = self.element(base, i);
                Val::Uniform(self.b.ins().load(types::F32, flags, address, offset as i32))
            }
            Val::Lanes(ks) if contiguous(ks.map(known_u32)) => Val::Vector(self.b.ins().load(
                types::F32X4,
                flags,
                base,
                at(known_u32(ks[0])),
            )),
            Val::Offset { base: row, offsets } if contiguous(offsets) => {
                let address = self.element(base, row);
                Val::Vector(
                    self.b
                        .ins()
                        .load(types::F32X4, flags, address, at(offsets[0])),
                )
            }
            _ => Val::Vector(self.build(Scalar::F32, |fx, k| {
                match index {
                    Val::Lanes(ks) => {
                        fx.b.ins()
                            .load(types::F32, flags, base, at(known_u32(ks[k])))
                    }
                    _ => {
                        let i = fx.lane(index, k, Scalar::U32);
                        let address = fx.element(base, i);
                        fx.b.ins().load(types::F32, flags, address, offset as i32)
                    }
                }
            })),
        }
    }

    /// `base + 4 * index` (index a u32).
    fn element(&mut self, base: ir::Value, index: ir::Value) -> ir::Value {
        let wide = self.b.ins().uextend(types::I64, index);
        let bytes = self.b.ins().ishl_imm_u(wide, 2);
        self.b.ins().iadd(base, bytes)
    }
}

/// `x` in every lane of `vector` (a Bool as a lane mask).
fn splat(pos: &mut FuncCursor, x: ir::Value, mask: bool, vector: ir::Type) -> ir::Value {
    if mask {
        let wide = pos.ins().uextend(types::I32, x);
        let ones = pos.ins().ineg(wide);
        pos.ins().splat(vector, ones)
    } else {
        pos.ins().splat(vector, x)
    }
}

/// Lanes `x, x+1, x+2, x+3`.
fn contiguous(lanes: [u32; LANES]) -> bool {
    lanes
        .iter()
        .enumerate()
        .all(|(k, &v)| v.wrapping_sub(lanes[0]) == k as u32)
}
