//! IR expressions -> PTX, generic over programs: the skeleton says where the
//! program's memories are ([`Env`]) and the emitter walks the arena once.
//!
//! **Replicas.** The per-item programs run for several query heads or several
//! channels of the same item at once. An expression that depends on the
//! replica (a shared-array read when replicas are heads; `Input::Channel` when
//! they are channels; anything computed from those) is emitted once per
//! replica, everything else once: a key's codes are decoded once and looked up
//! for every head of the group, a value item's scale read once for all of a
//! thread's channels. Emission follows arena order, so the live ranges are the
//! program's own.
//!
//! **Item bits** come from the item's bytes in shared memory, at any bit
//! alignment: see [`ItemReader`].

use std::collections::HashMap;

use super::builder::{Cmp, Global, Kernel, Op, Pred, Reg, Shared, B16, F32, S32, U32, U64};
use crate::ir::{Arena, BinaryOp, Expr, Function, Handle, Input, Literal, UnaryOp};
use crate::valid::Range;

/// A value of an IR type.
#[derive(Clone, Copy)]
pub enum Val {
    U32(Op<U32>),
    I32(Op<S32>),
    F32(Op<F32>),
    Bool(Reg<Pred>),
}

impl Val {
    pub fn u32(self) -> Op<U32> {
        match self {
            Val::U32(v) => v,
            _ => unreachable!("validated IR: expected u32"),
        }
    }
    pub fn f32(self) -> Op<F32> {
        match self {
            Val::F32(v) => v,
            _ => unreachable!("validated IR: expected f32"),
        }
    }
    pub fn bool(self) -> Reg<Pred> {
        match self {
            Val::Bool(v) => v,
            _ => unreachable!("validated IR: expected bool"),
        }
    }
}

/// Where a table is read from; table starts are 16-byte aligned and padded
/// to 16 bytes (abi::TableBuffer, plan), so four elements load as one vector.
#[derive(Clone, Copy)]
pub enum TableAccess {
    /// Staged in shared memory at this address.
    Shared(Reg<U32>),
    /// In global memory (read-only cache) at this address.
    Global(Reg<U64>),
}

/// A shared array as a program sees it: replica `r`'s copy starts at
/// `base + r * replica_stride`. Bases and strides are 16-byte aligned and
/// copies are padded to 16 bytes, so four elements load as one vector.
#[derive(Clone, Copy)]
pub struct ArrayAccess {
    pub base: Reg<U32>,
    pub replica_stride: u32,
}

/// The current item of the program's stream in shared memory: its byte
/// address and the alignment the address is known to have.
#[derive(Clone, Copy)]
pub struct ItemSource {
    pub base: Reg<U32>,
    pub align: u32,
}

/// What a program's replicas are.
#[derive(Clone, Copy)]
pub enum Replicas<'a> {
    One,
    /// Query heads: shared arrays are per head.
    Heads(u32),
    /// Channels: `Input::Channel` of each replica. Replicas come in packs of
    /// `pack` adjacent channels (`c, c + 1, ..`, `c` a multiple of `pack`):
    /// what is the same across a pack is emitted once per pack, and item
    /// fields at adjacent offsets come from one load ([`pack_steps`]).
    /// `ranges`: the validator's u32 ranges of the program.
    Channels {
        channels: &'a [Reg<U32>],
        pack: u32,
        ranges: &'a [Option<Range>],
    },
}

/// Everything a program may read, as the skeleton provides it.
pub struct Env<'a> {
    pub replicas: Replicas<'a>,
    /// Per IR array (`None`: the program may not read it).
    pub arrays: &'a [Option<ArrayAccess>],
    /// Per IR table.
    pub tables: &'a [Option<TableAccess>],
    /// Shared address of the page header's scale slot 0.
    pub header: Option<Reg<U32>>,
    pub item: Option<ItemSource>,
    pub iteration: Option<Reg<U32>>,
    pub denominator: Option<Reg<F32>>,
    /// Shared-array elements at constant indices already in registers
    /// ([`preload`]): the program reads them from there.
    pub preloaded: Option<&'a Preloaded>,
}

/// Constant-index shared reads of a program loaded once ([`preload`]).
#[derive(Default)]
pub struct Preloaded(Chunks);

/// Loads every shared-array element `exprs` reads at a constant index, for
/// every replica, from the arrays `env` gives: a program that runs per item
/// with the same arrays (the score's query slice) then keeps them in
/// registers across items and tiles instead of reloading them.
pub fn preload(k: &mut Kernel, exprs: &Arena<Expr>, env: &Env) -> Preloaded {
    let replicas = match env.replicas {
        Replicas::Heads(n) => n,
        _ => 1,
    };
    let mut chunks = Chunks::default();
    for (_, e) in exprs.iter() {
        if let Expr::Shared { array, index } = *e {
            if let Some(Expr::Literal(Literal::U32(i))) = exprs.try_get(index) {
                let access =
                    env.arrays[array.index()].expect("skeleton provides every readable array");
                for r in 0..replicas {
                    let key = (Source::Array(array.index()), r as usize);
                    chunks.shared(k, key, access.base, access.replica_stride * r, *i);
                }
            }
        }
    }
    Preloaded(chunks)
}

/// Elements [`preload`] would keep in registers per replica.
pub fn preloaded_elements(exprs: &Arena<Expr>) -> u32 {
    let mut chunks = std::collections::HashSet::new();
    for (_, e) in exprs.iter() {
        if let Expr::Shared { array, index } = *e {
            if let Some(Expr::Literal(Literal::U32(i))) = exprs.try_get(index) {
                chunks.insert((array.index(), i / 4));
            }
        }
    }
    4 * chunks.len() as u32
}

/// A score program split over `lanes` adjacent lanes ([`lane_split`]).
#[derive(Debug, Clone)]
pub struct LaneSplit {
    /// Lane 0's part: the first `terms / lanes` terms of the program's fma
    /// chain, summed from 0. Lane `l` runs it on the item `l · item_step`
    /// bytes further and on shared arrays `l · index_step` elements further.
    pub program: Function,
    pub item_step: u32,
    pub index_step: u32,
    /// Terms of the whole chain.
    pub terms: u32,
    /// Whether every shared read of the part is at a constant index (so all
    /// of them can stay in registers, [`preload`]).
    pub constant_reads: bool,
}

/// Splits a program that is a dot product — a chain `fma(a_t, b_t, ..)` from
/// 0.0 — into `lanes` equal runs of terms when run `s` is run 0 with every
/// item bit offset moved by `s · Δb` and every shared index by `s · Δi`
/// (whole bytes; Δi a multiple of 4 so vector loads stay aligned). The sum
/// of the lanes' partial sums is the program's value up to rounding (the
/// chain is reassociated into `lanes` partial chains).
pub fn lane_split(f: &Function, lanes: u32) -> Option<LaneSplit> {
    let exprs = &f.exprs;
    let mut terms = Vec::new();
    let mut cur = f.result?;
    loop {
        match exprs.try_get(cur)? {
            Expr::Fma { a, b, c } => {
                terms.push((*a, *b));
                cur = *c;
            }
            Expr::Literal(Literal::F32(z)) if *z == 0.0 => break,
            _ => return None,
        }
    }
    terms.reverse();
    let n = terms.len() as u32;
    if lanes < 2 || n == 0 || !n.is_multiple_of(lanes) {
        return None;
    }
    let per = (n / lanes) as usize;
    let mut steps = Steps::default();
    for s in 1..lanes as usize {
        for t in 0..per {
            let (a0, b0) = terms[t];
            let (a1, b1) = terms[s * per + t];
            if !shifted(exprs, a0, a1, s as u32, &mut steps)
                || !shifted(exprs, b0, b1, s as u32, &mut steps)
            {
                return None;
            }
        }
    }
    let item_bits = steps.bits.unwrap_or(0);
    let index_step = steps.index.unwrap_or(0);
    if !item_bits.is_multiple_of(8) || !index_step.is_multiple_of(4) {
        return None;
    }
    // Copy what lane 0's terms read, in arena order, then its chain.
    let mut needed = vec![false; exprs.len()];
    let mut stack: Vec<Handle<Expr>> = terms[..per].iter().flat_map(|&(a, b)| [a, b]).collect();
    while let Some(h) = stack.pop() {
        if !needed[h.index()] {
            needed[h.index()] = true;
            stack.extend(operands(exprs.try_get(h)?));
        }
    }
    let mut program = Function::default();
    let mut map: HashMap<usize, Handle<Expr>> = HashMap::new();
    let mut constant_reads = true;
    for (h, e) in exprs.iter() {
        if !needed[h.index()] {
            continue;
        }
        let m = |x: Handle<Expr>| map[&x.index()];
        let copy = match *e {
            Expr::Literal(l) => Expr::Literal(l),
            Expr::Input(i) => Expr::Input(i),
            Expr::ItemBits { bit_offset, width } => Expr::ItemBits {
                bit_offset: m(bit_offset),
                width,
            },
            Expr::HeaderScale { slot } => Expr::HeaderScale { slot: m(slot) },
            Expr::Table { table, index } => Expr::Table {
                table,
                index: m(index),
            },
            Expr::Shared { array, index } => {
                constant_reads &=
                    matches!(exprs.try_get(index), Some(Expr::Literal(Literal::U32(_))));
                Expr::Shared {
                    array,
                    index: m(index),
                }
            }
            Expr::Unary { op, arg } => Expr::Unary { op, arg: m(arg) },
            Expr::Binary { op, left, right } => Expr::Binary {
                op,
                left: m(left),
                right: m(right),
            },
            Expr::Fma { a, b, c } => Expr::Fma {
                a: m(a),
                b: m(b),
                c: m(c),
            },
            Expr::Select {
                condition,
                accept,
                reject,
            } => Expr::Select {
                condition: m(condition),
                accept: m(accept),
                reject: m(reject),
            },
        };
        map.insert(h.index(), program.exprs.append(copy));
    }
    let mut acc = program.exprs.append(Expr::Literal(Literal::F32(0.0)));
    for &(a, b) in &terms[..per] {
        acc = program.exprs.append(Expr::Fma {
            a: map[&a.index()],
            b: map[&b.index()],
            c: acc,
        });
    }
    program.result = Some(acc);
    Some(LaneSplit {
        program,
        item_step: item_bits / 8,
        index_step,
        terms: n,
        constant_reads,
    })
}

/// The per-lane shifts [`lane_split`] has found so far.
#[derive(Default)]
struct Steps {
    bits: Option<u32>,
    index: Option<u32>,
}

/// Whether two expressions apply the same operation (kind, operator,
/// table) to their operands, whatever the operands.
fn same_operation(a: &Expr, b: &Expr) -> bool {
    match (a, b) {
        (Expr::HeaderScale { .. }, Expr::HeaderScale { .. })
        | (Expr::Fma { .. }, Expr::Fma { .. })
        | (Expr::Select { .. }, Expr::Select { .. }) => true,
        (Expr::Table { table: x, .. }, Expr::Table { table: y, .. }) => x == y,
        (Expr::Unary { op: x, .. }, Expr::Unary { op: y, .. }) => x == y,
        (Expr::Binary { op: x, .. }, Expr::Binary { op: y, .. }) => x == y,
        _ => false,
    }
}

fn literal_u32(exprs: &Arena<Expr>, h: Handle<Expr>) -> Option<u32> {
    match exprs.try_get(h)? {
        Expr::Literal(Literal::U32(v)) => Some(*v),
        _ => None,
    }
}

/// Whether `x` is `y` with item bit offsets `s · Δb` and shared indices
/// `s · Δi` further (one Δ per kind for the whole program).
fn shifted(
    exprs: &Arena<Expr>,
    y: Handle<Expr>,
    x: Handle<Expr>,
    s: u32,
    steps: &mut Steps,
) -> bool {
    let step = |slot: &mut Option<u32>, y: Option<u32>, x: Option<u32>| -> bool {
        let (Some(y), Some(x)) = (y, x) else {
            return false;
        };
        if x < y || !(x - y).is_multiple_of(s) {
            return false;
        }
        let d = (x - y) / s;
        match *slot {
            None => {
                *slot = Some(d);
                true
            }
            Some(old) => old == d,
        }
    };
    let (Some(ey), Some(ex)) = (exprs.try_get(y), exprs.try_get(x)) else {
        return false;
    };
    match (*ey, *ex) {
        (Expr::Literal(a), Expr::Literal(b)) => a == b,
        (Expr::Input(a), Expr::Input(b)) => a == b,
        (
            Expr::ItemBits {
                bit_offset: oy,
                width: wy,
            },
            Expr::ItemBits {
                bit_offset: ox,
                width: wx,
            },
        ) => {
            wy == wx
                && step(
                    &mut steps.bits,
                    literal_u32(exprs, oy),
                    literal_u32(exprs, ox),
                )
        }
        (
            Expr::Shared {
                array: aa,
                index: a,
            },
            Expr::Shared {
                array: ab,
                index: b,
            },
        ) => {
            aa == ab
                && step(
                    &mut steps.index,
                    literal_u32(exprs, a),
                    literal_u32(exprs, b),
                )
        }
        (a, b) if same_operation(&a, &b) => operands(&a)
            .into_iter()
            .zip(operands(&b))
            .all(|(a, b)| shifted(exprs, a, b, s, steps)),
        _ => false,
    }
}

/// Emitted values: one per expression, or one per replica for those that vary.
pub struct Values(Vec<Vec<Val>>);

impl Values {
    pub fn get(&self, handle: Handle<Expr>, replica: usize) -> Val {
        let v = &self.0[handle.index()];
        if v.len() == 1 {
            v[0]
        } else {
            v[replica]
        }
    }
}

/// Emits a program (a function body or one stage iteration).
pub fn emit(k: &mut Kernel, exprs: &Arena<Expr>, env: &Env) -> Values {
    let replicas = match env.replicas {
        Replicas::One => 1,
        Replicas::Heads(n) => n as usize,
        Replicas::Channels { channels, .. } => channels.len(),
    };
    let pack = match env.replicas {
        Replicas::Channels { pack, .. } => pack as usize,
        _ => 1,
    };
    let steps = match env.replicas {
        Replicas::Channels { pack, ranges, .. } if pack > 1 => pack_steps(exprs, ranges, pack),
        _ => vec![None; exprs.len()],
    };
    // Trailing zeros at a pack's first channel (a multiple of `pack`).
    let pack_zeros = known_zeros(exprs, pack.trailing_zeros());
    let known = Known {
        zeros: known_zeros(exprs, 0),
        bits: known_bits(exprs),
        halves: half_reads(exprs),
    };
    let mut reader = env.item.map(ItemReader::new);
    let mut chunks = env.preloaded.map(|p| p.0.clone()).unwrap_or_default();
    let mut varies = Vec::with_capacity(exprs.len());
    let mut values: Vec<Vec<Val>> = Vec::with_capacity(exprs.len());
    for (handle, expr) in exprs.iter() {
        let vary = match *expr {
            Expr::Input(Input::Channel) => matches!(env.replicas, Replicas::Channels { .. }),
            Expr::Shared { index, .. } => {
                matches!(env.replicas, Replicas::Heads(_)) || varies[index.index()]
            }
            _ => operands(expr).iter().any(|h| varies[h.index()]),
        };
        varies.push(vary);
        let count = if vary { replicas } else { 1 };
        let mut out = Vec::with_capacity(count);
        // Replica `r` of this expression from replica `r` of each operand (or
        // its only value).
        let emit_replica = |k: &mut Kernel,
                            r: usize,
                            reader: &mut Option<ItemReader>,
                            chunks: &mut Chunks,
                            values: &[Vec<Val>]| {
            let get = |h: Handle<Expr>| {
                let v = &values[h.index()];
                if v.len() == 1 {
                    v[0]
                } else {
                    v[r]
                }
            };
            emit_one(k, handle, expr, r, get, env, reader, chunks, &known)
        };
        // A shared read whose index is the same for every head computes the
        // address once; each head's load adds its copy's offset.
        let per_head_copy = match *expr {
            Expr::Shared { array, index } if vary && !varies[index.index()] => Some((array, index)),
            _ => None,
        };
        if let Some((array, index)) = per_head_copy {
            let access = env.arrays[array.index()].expect("skeleton provides every readable array");
            let index = values[index.index()][0].u32();
            let at = shared_element(k, access.base, index);
            for r in 0..count {
                let stride = access.replica_stride * r as u32;
                let value = match index {
                    Op::Imm(i) => {
                        chunks.shared(k, (Source::Array(array.index()), r), access.base, stride, i)
                    }
                    Op::Reg(_) => k.ld_shared(at.plus(i64::from(stride))),
                };
                out.push(Val::F32(Op::Reg(value)));
            }
        } else if let (true, Some(0)) = (vary, steps[handle.index()]) {
            // The same for every channel of a pack: once per pack.
            for r in 0..count {
                let value = match r % pack {
                    0 => emit_replica(k, r, &mut reader, &mut chunks, &values),
                    e => out[r - e],
                };
                out.push(value);
            }
        } else if let Some(fields) = match *expr {
            Expr::ItemBits { bit_offset, width } if vary => {
                steps[bit_offset.index()].and_then(|step| {
                    let reader = reader
                        .as_mut()
                        .expect("validated IR: item bits in item programs");
                    let offsets = &values[bit_offset.index()];
                    reader.read_pack(
                        k,
                        offsets,
                        pack,
                        step,
                        width.into(),
                        pack_zeros[bit_offset.index()],
                    )
                })
            }
            _ => None,
        } {
            out.extend(fields.into_iter().map(|f| Val::U32(Op::Reg(f))));
        } else {
            for r in 0..count {
                let value = emit_replica(k, r, &mut reader, &mut chunks, &values);
                out.push(value);
            }
        }
        values.push(out);
    }
    Values(values)
}

/// `array[index] = value` for a stage store (one replica).
pub fn store(k: &mut Kernel, access: ArrayAccess, index: Val, value: Val) {
    let at = shared_element(k, access.base, index.u32());
    let value = materialize_f32(k, value.f32());
    k.st_shared(at, value);
}

pub fn materialize_f32(k: &mut Kernel, v: Op<F32>) -> Reg<F32> {
    match v {
        Op::Reg(r) => r,
        imm => k.mov(imm),
    }
}

fn materialize_u32(k: &mut Kernel, v: Op<U32>) -> Reg<U32> {
    match v {
        Op::Reg(r) => r,
        imm => k.mov(imm),
    }
}

fn materialize_s32(k: &mut Kernel, v: Op<S32>) -> Reg<S32> {
    match v {
        Op::Reg(r) => r,
        imm => k.mov(imm),
    }
}

/// Address of f32 element `index` of a shared array.
pub fn shared_element(k: &mut Kernel, base: Reg<U32>, index: Op<U32>) -> Shared {
    match index {
        Op::Imm(i) => Shared::at(base).plus(4 * i64::from(i)),
        Op::Reg(r) => Shared::at(k.mad_lo(r, 4u32, base)),
    }
}

fn global_element(k: &mut Kernel, base: Reg<U64>, index: Op<U32>) -> Global {
    match index {
        Op::Imm(i) => Global::at(base).plus(4 * i64::from(i)),
        Op::Reg(r) => Global::at(k.global_index(base, r, 4)),
    }
}

pub(super) fn operands(expr: &Expr) -> Vec<Handle<Expr>> {
    match *expr {
        Expr::Literal(_) | Expr::Input(_) => vec![],
        Expr::ItemBits { bit_offset, .. } => vec![bit_offset],
        Expr::HeaderScale { slot } => vec![slot],
        Expr::Table { index, .. } | Expr::Shared { index, .. } => vec![index],
        Expr::Unary { arg, .. } => vec![arg],
        Expr::Binary { left, right, .. } => vec![left, right],
        Expr::Fma { a, b, c } => vec![a, b, c],
        Expr::Select {
            condition,
            accept,
            reject,
        } => vec![condition, accept, reject],
    }
}

/// Trailing zero bits every u32 expression is known to have (32 for zero):
/// lets a runtime-offset bit read use one 32-bit load when the field cannot
/// straddle two words (an f16 at `16 * channel`, say).
/// `channel`: the zeros `Input::Channel` is known to have.
fn known_zeros(exprs: &Arena<Expr>, channel: u32) -> Vec<u32> {
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
fn known_bits(exprs: &Arena<Expr>) -> Vec<u32> {
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

/// How each expression changes across a pack of adjacent channels `c + e`
/// (`c` a multiple of `pack`, `e < pack`): `Some(step)` when its value at
/// `e` is exactly (as integers, no wrap) its value at `c` plus `step · e`.
/// Step 0: the same for the whole pack (any type), so emitted once per pack;
/// a nonzero step exists only on u32 chains from the channel (adds, constant
/// multiples and shifts proven not to wrap by the validator's ranges, and
/// power-of-two divisions and remainders whose pack stays within one
/// quotient). An `ItemBits` at such an offset reads the pack's fields with
/// one load ([`ItemReader::read_pack`]). `None`: emitted per channel.
fn pack_steps(exprs: &Arena<Expr>, ranges: &[Option<Range>], pack: u32) -> Vec<Option<u32>> {
    // Trailing zeros at the pack's first channel.
    let zeros = known_zeros(exprs, pack.trailing_zeros());
    let mut steps: Vec<Option<u32>> = Vec::with_capacity(exprs.len());
    for (handle, expr) in exprs.iter() {
        let s = |h: Handle<Expr>| steps[h.index()];
        let no_wrap = ranges[handle.index()].is_some_and(|r| r.hi < u64::from(u32::MAX));
        let literal = |h: Handle<Expr>| match exprs[h] {
            Expr::Literal(Literal::U32(v)) => Some(v),
            _ => None,
        };
        let operands = operands(expr);
        let step = if let Expr::Input(Input::Channel) = expr {
            Some(1)
        } else if operands.iter().all(|&h| s(h) == Some(0)) {
            // Item fields read at a varying offset are not uniform even
            // when a uniform operand selects them: only their offsets are.
            Some(0)
        } else {
            match *expr {
                Expr::Binary { op, left, right } => {
                    let (sl, sr) = (s(left), s(right));
                    match op {
                        BinaryOp::Add if no_wrap => sl.zip(sr).and_then(|(a, b)| a.checked_add(b)),
                        BinaryOp::Multiply if no_wrap => match (literal(left), literal(right)) {
                            (_, Some(v)) => sl.and_then(|a| a.checked_mul(v)),
                            (Some(v), _) => sr.and_then(|b| b.checked_mul(v)),
                            _ => None,
                        },
                        BinaryOp::ShiftLeft if no_wrap => {
                            literal(right).and_then(|a| sl.and_then(|s| s.checked_shl(a)))
                        }
                        BinaryOp::Divide | BinaryOp::Modulo => {
                            let d = literal(right).filter(|d| d.is_power_of_two());
                            match (d, sl) {
                                // x + step·e with d | step: the quotient
                                // grows by step / d, the remainder is fixed.
                                (Some(d), Some(step)) if step.is_multiple_of(d) => {
                                    Some(if op == BinaryOp::Divide { step / d } else { 0 })
                                }
                                // The first value is a multiple of 2^z, so
                                // it is at most d - 2^z past a multiple of d:
                                // a pack spanning less than 2^z (and d)
                                // keeps its quotient.
                                (Some(d), Some(step))
                                    if step.checked_mul(pack - 1).is_some_and(|m| {
                                        m < 1 << zeros[left.index()].min(d.trailing_zeros())
                                    }) =>
                                {
                                    Some(if op == BinaryOp::Divide { 0 } else { step })
                                }
                                _ => None,
                            }
                        }
                        _ => None,
                    }
                }
                _ => None,
            }
        };
        steps.push(step);
    }
    steps
}

/// Item reads that are one whole half of an item word (16 bits at a constant
/// offset that is a multiple of 16) and that only `half_to_float` consumes:
/// they are emitted as the f32 directly, converting the word's half in place
/// (`mov.b32 {lo, hi}`, then `cvt.f32.f16`, which ptxas turns into one HADD2
/// with a half selector) instead of extracting it first (a PRMT per
/// coordinate: 128 of ~600 SASS in the dense f16 score per key). Item reads
/// occur only in score and accumulate, whose one root is an f32 result, so
/// only other expressions can consume them.
fn half_reads(exprs: &Arena<Expr>) -> Vec<bool> {
    let mut halves: Vec<bool> = exprs
        .iter()
        .map(|(_, expr)| match *expr {
            Expr::ItemBits { bit_offset, width } => {
                width == 16
                    && matches!(exprs[bit_offset], Expr::Literal(Literal::U32(o)) if o.is_multiple_of(16))
            }
            _ => false,
        })
        .collect();
    for (_, expr) in exprs.iter() {
        if !matches!(
            expr,
            Expr::Unary {
                op: UnaryOp::HalfToFloat,
                ..
            }
        ) {
            for h in operands(expr) {
                halves[h.index()] = false;
            }
        }
    }
    halves
}

/// What the analyses prove about each expression's value.
struct Known {
    /// Known trailing zero bits ([`known_zeros`]).
    zeros: Vec<u32>,
    /// Significant bits ([`known_bits`]).
    bits: Vec<u32>,
    /// Item reads emitted as f32 ([`half_reads`]).
    halves: Vec<bool>,
}

/// Integers of at most this many bits convert to f32 exactly by placing them
/// in the mantissa of 2^23 (or 1.5 * 2^23 for signed) and subtracting that.
const MANTISSA_BITS: u32 = 23;

/// `x` as f32 for `x` of at most [`MANTISSA_BITS`] bits: an integer add or
/// or, plus an f32 subtract, both exact. `cvt.rn.f32.{u32,s32}` runs on the
/// quarter-rate conversion unit (16 per clock per SM on sm_80/sm_90), which
/// bounded the score of int8/int4 codecs (one conversion per coordinate per
/// head block).
fn small_int_to_f32(k: &mut Kernel, x: Val) -> Val {
    let (biased, bias): (Reg<U32>, f32) = match x {
        Val::U32(Op::Imm(v)) => return Val::F32(Op::Imm(v as f32)),
        Val::I32(Op::Imm(v)) => return Val::F32(Op::Imm(v as f32)),
        Val::U32(x) => (k.or(x, 0x4B00_0000u32), 8_388_608.0),
        Val::I32(x) => {
            let sum = k.add(x, 0x4B40_0000i32);
            (k.bitcast(sum), 12_582_912.0)
        }
        _ => unreachable!("validated IR: to_float of an integer"),
    };
    let float: Reg<F32> = k.bitcast(biased);
    Val::F32(Op::Reg(k.sub(float, bias)))
}

#[allow(clippy::too_many_arguments)]
fn emit_one(
    k: &mut Kernel,
    handle: Handle<Expr>,
    expr: &Expr,
    replica: usize,
    get: impl Fn(Handle<Expr>) -> Val,
    env: &Env,
    reader: &mut Option<ItemReader>,
    chunks: &mut Chunks,
    known: &Known,
) -> Val {
    match *expr {
        Expr::Literal(Literal::U32(v)) => Val::U32(Op::Imm(v)),
        Expr::Literal(Literal::I32(v)) => Val::I32(Op::Imm(v)),
        Expr::Literal(Literal::F32(v)) => Val::F32(Op::Imm(v)),
        Expr::Input(input) => match input {
            Input::Channel => match env.replicas {
                Replicas::Channels { channels, .. } => Val::U32(Op::Reg(channels[replica])),
                _ => unreachable!("validated IR: channel only in accumulate"),
            },
            Input::Iteration => Val::U32(Op::Reg(
                env.iteration
                    .expect("validated IR: iteration only in stages"),
            )),
            Input::Denominator => Val::F32(Op::Reg(
                env.denominator
                    .expect("validated IR: denominator only in the epilogue"),
            )),
        },
        Expr::ItemBits { bit_offset, width } => {
            let reader = reader
                .as_mut()
                .expect("validated IR: item bits in item programs");
            let bits = match get(bit_offset).u32() {
                Op::Imm(offset) if known.halves[handle.index()] => {
                    return Val::F32(Op::Reg(reader.read_half(k, offset)));
                }
                Op::Imm(offset) => reader.read_static(k, offset, width.into()),
                Op::Reg(offset) => {
                    reader.read_dynamic(k, offset, width.into(), known.zeros[bit_offset.index()])
                }
            };
            Val::U32(Op::Reg(bits))
        }
        Expr::HeaderScale { slot } => {
            let header = env.header.expect("validated IR: header in item programs");
            let at = shared_element(k, header, get(slot).u32());
            Val::F32(Op::Reg(k.ld_shared(at)))
        }
        Expr::Table { table, index } => {
            let index = get(index).u32();
            let key = (Source::Table(table.index()), 0);
            let value = match (
                env.tables[table.index()].expect("skeleton provides every table"),
                index,
            ) {
                (TableAccess::Shared(base), Op::Imm(i)) => chunks.shared(k, key, base, 0, i),
                (TableAccess::Global(base), Op::Imm(i)) => chunks.global(k, key, base, i),
                (TableAccess::Shared(base), index) => {
                    let at = shared_element(k, base, index);
                    k.ld_shared(at)
                }
                (TableAccess::Global(base), index) => {
                    let at = global_element(k, base, index);
                    k.ld_global_nc(at)
                }
            };
            Val::F32(Op::Reg(value))
        }
        Expr::Shared { array, index } => {
            let access = env.arrays[array.index()].expect("skeleton provides every readable array");
            let stride = match env.replicas {
                Replicas::Heads(_) => access.replica_stride * replica as u32,
                _ => 0,
            };
            let value = match get(index).u32() {
                Op::Imm(i) => {
                    let key = (Source::Array(array.index()), replica);
                    chunks.shared(k, key, access.base, stride, i)
                }
                index => {
                    let base = match stride {
                        0 => access.base,
                        _ => k.add(access.base, stride),
                    };
                    let at = shared_element(k, base, index);
                    k.ld_shared(at)
                }
            };
            Val::F32(Op::Reg(value))
        }
        Expr::Unary {
            op: UnaryOp::ToFloat,
            arg,
        } if known.bits[arg.index()] <= MANTISSA_BITS => small_int_to_f32(k, get(arg)),
        Expr::Unary { op, arg } => unary(k, op, get(arg)),
        Expr::Binary { op, left, right } => binary(k, op, get(left), get(right)),
        Expr::Fma { a, b, c } => {
            let a = get(a).f32();
            let a = Op::Reg(materialize_f32(k, a));
            Val::F32(Op::Reg(k.fma(a, get(b).f32(), get(c).f32())))
        }
        Expr::Select {
            condition,
            accept,
            reject,
        } => {
            let p = get(condition).bool();
            match (get(accept), get(reject)) {
                (Val::U32(a), Val::U32(b)) => Val::U32(Op::Reg(k.selp(a, b, p))),
                (Val::I32(a), Val::I32(b)) => Val::I32(Op::Reg(k.selp(a, b, p))),
                (Val::F32(a), Val::F32(b)) => Val::F32(Op::Reg(k.selp(a, b, p))),
                (Val::Bool(a), Val::Bool(b)) => {
                    let not_p = k.not_pred(p);
                    let take_a = k.and_pred(p, a);
                    let take_b = k.and_pred(not_p, b);
                    Val::Bool(k.or_pred(take_a, take_b))
                }
                _ => unreachable!("validated IR: select arms of one type"),
            }
        }
    }
}

fn unary(k: &mut Kernel, op: UnaryOp, arg: Val) -> Val {
    let f = |r: Reg<F32>| Val::F32(Op::Reg(r));
    match (op, arg) {
        (UnaryOp::Negate, Val::F32(x)) => {
            let x = materialize_f32(k, x);
            f(k.neg_f32(x))
        }
        (UnaryOp::Negate, Val::I32(x)) => {
            let x = materialize_s32(k, x);
            Val::I32(Op::Reg(k.neg_s32(x)))
        }
        (UnaryOp::Popcount, Val::U32(x)) => {
            let x = materialize_u32(k, x);
            Val::U32(Op::Reg(k.popc(x)))
        }
        // Already converted where it was read ([`half_reads`]).
        (UnaryOp::HalfToFloat, Val::F32(x)) => Val::F32(x),
        (UnaryOp::HalfToFloat, Val::U32(x)) => {
            let x = materialize_u32(k, x);
            let half = k.low16(x);
            f(k.f16_to_f32(half))
        }
        (UnaryOp::BfloatToFloat, Val::U32(x)) => {
            // bf16 is the high half of an f32: shifting drops the unused bits.
            let high = k.shl(x, 16u32);
            f(k.bitcast(high))
        }
        (UnaryOp::BitsToFloat, Val::U32(x)) => {
            let x = materialize_u32(k, x);
            f(k.bitcast(x))
        }
        (UnaryOp::ToFloat, Val::U32(x)) => {
            let x = materialize_u32(k, x);
            f(k.u32_to_f32(x))
        }
        (UnaryOp::ToFloat, Val::I32(x)) => {
            let x = materialize_s32(k, x);
            f(k.s32_to_f32(x))
        }
        (UnaryOp::SignExtend(bits), Val::U32(x)) => {
            let x = materialize_u32(k, x);
            Val::I32(Op::Reg(k.bfe_s32(x, 0u32, u32::from(bits))))
        }
        _ => unreachable!("validated IR: {op:?} operand type"),
    }
}

fn binary(k: &mut Kernel, op: BinaryOp, left: Val, right: Val) -> Val {
    use BinaryOp::*;
    match (left, right) {
        (Val::U32(a), Val::U32(b)) => {
            // Keep one operand in a register (two immediates only arise from
            // literals the IR builder did not fold, e.g. a wrapping subtraction).
            let a = Op::Reg(materialize_u32(k, a));
            let r = |r: Reg<U32>| Val::U32(Op::Reg(r));
            match op {
                Add => r(k.add(a, b)),
                Subtract => r(k.sub(a, b)),
                Multiply => r(k.mul(a, b)),
                Divide => r(k.div_u32(a, b)),
                Modulo => r(k.rem_u32(a, b)),
                Min => r(k.min(a, b)),
                And => r(k.and(a, b)),
                Or => r(k.or(a, b)),
                ShiftLeft => r(k.shl(a, b)),
                ShiftRight => r(k.shr(a, b)),
                Less => Val::Bool(k.setp(Cmp::Lt, a, b)),
                Equal => Val::Bool(k.setp(Cmp::Eq, a, b)),
                NotEqual => Val::Bool(k.setp(Cmp::Ne, a, b)),
            }
        }
        (Val::I32(a), Val::I32(b)) => {
            let a = Op::Reg(materialize_s32(k, a));
            let r = |r: Reg<S32>| Val::I32(Op::Reg(r));
            match op {
                Add => r(k.add(a, b)),
                Subtract => r(k.sub(a, b)),
                Multiply => r(k.mul(a, b)),
                Min => r(k.min(a, b)),
                Less => Val::Bool(k.setp(Cmp::Lt, a, b)),
                Equal => Val::Bool(k.setp(Cmp::Eq, a, b)),
                NotEqual => Val::Bool(k.setp(Cmp::Ne, a, b)),
                _ => unreachable!("validated IR: {op:?} on i32"),
            }
        }
        (Val::F32(a), Val::F32(b)) => {
            let a = Op::Reg(materialize_f32(k, a));
            let r = |r: Reg<F32>| Val::F32(Op::Reg(r));
            match op {
                Add => r(k.add(a, b)),
                Subtract => r(k.sub(a, b)),
                Multiply => r(k.mul(a, b)),
                Divide => r(k.div_f32(a, b)),
                // PTX min returns the non-NaN operand, as f32::min does.
                Min => r(k.min(a, b)),
                Less => Val::Bool(k.setp(Cmp::Lt, a, b)),
                Equal => Val::Bool(k.setp(Cmp::Eq, a, b)),
                // Rust's != is true when either side is NaN.
                NotEqual => Val::Bool(k.setp(Cmp::Neu, a, b)),
                _ => unreachable!("validated IR: {op:?} on f32"),
            }
        }
        _ => unreachable!("validated IR: {op:?} operands of one type"),
    }
}

/// A memory a program reads f32 elements from.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Source {
    Array(usize),
    Table(usize),
}

/// Elements at constant indices load 16 bytes at a time, once per program:
/// a dot product with the query reads a quarter as many times, for every
/// head. Keyed by memory, replica and 16-byte chunk.
#[derive(Default, Clone)]
struct Chunks(HashMap<(Source, usize, u32), [Reg<F32>; 4]>);

impl Chunks {
    /// Element `index` of the 16-byte-aligned shared memory at `base + offset`.
    fn shared(
        &mut self,
        k: &mut Kernel,
        (source, replica): (Source, usize),
        base: Reg<U32>,
        offset: u32,
        index: u32,
    ) -> Reg<F32> {
        let chunk = self
            .0
            .entry((source, replica, index / 4))
            .or_insert_with(|| {
                k.ld_shared_v4(Shared::at(base).plus(i64::from(offset + 16 * (index / 4))))
            });
        chunk[(index % 4) as usize]
    }

    /// Element `index` of the 16-byte-aligned global memory at `base`.
    fn global(
        &mut self,
        k: &mut Kernel,
        (source, replica): (Source, usize),
        base: Reg<U64>,
        index: u32,
    ) -> Reg<F32> {
        let chunk = self
            .0
            .entry((source, replica, index / 4))
            .or_insert_with(|| k.ld_global_nc_v4(Global::at(base).plus(16 * i64::from(index / 4))));
        chunk[(index % 4) as usize]
    }
}

/// Reads bit fields of one item in shared memory, LSB-first little-endian.
///
/// A field at a constant bit offset lives in the item's 32-bit words `k` (and
/// `k + 1` when it straddles them): one `bfe`, or a funnel shift of the two
/// words and a `bfe`. Words are loaded once per program. When the item's
/// address is 16-byte aligned they come four at a time (`ld.shared.v4`); when
/// it is not 4-byte aligned (6- or 14-byte items) each item word is rebuilt
/// from the two aligned words around it with a funnel shift by the item's
/// byte misalignment, once, and everything after that is as if aligned.
/// Runtime offsets compute the word address and shift per read.
struct ItemReader {
    base: Reg<U32>,
    align: u32,
    words: HashMap<u32, Reg<U32>>,
    chunks: HashMap<u32, [Reg<U32>; 4]>,
    /// Item words split into their low and high halves ([`half_reads`]).
    halves: HashMap<u32, (Reg<B16>, Reg<B16>)>,
    raw: HashMap<u32, Reg<U32>>,
    /// For unaligned items: the aligned address below the item and the bit
    /// shift from it to the item's first bit.
    unaligned: Option<(Reg<U32>, Reg<U32>)>,
}

impl ItemReader {
    fn new(source: ItemSource) -> ItemReader {
        ItemReader {
            base: source.base,
            align: source.align,
            words: HashMap::new(),
            chunks: HashMap::new(),
            halves: HashMap::new(),
            raw: HashMap::new(),
            unaligned: None,
        }
    }

    fn unaligned(&mut self, k: &mut Kernel) -> (Reg<U32>, Reg<U32>) {
        let base = self.base;
        *self.unaligned.get_or_insert_with(|| {
            let word_base = k.and(base, !3u32);
            let bytes = k.and(base, 3u32);
            let shift = k.shl(bytes, 3u32);
            (word_base, shift)
        })
    }

    /// Item word `index`: bits `32 * index ..` of the item.
    fn word(&mut self, k: &mut Kernel, index: u32) -> Reg<U32> {
        if let Some(&w) = self.words.get(&index) {
            return w;
        }
        let word = if self.align >= 16 {
            let base = self.base;
            let chunk = *self.chunks.entry(index / 4).or_insert_with(|| {
                k.ld_shared_v4(Shared::at(base).plus(16 * i64::from(index / 4)))
            });
            chunk[(index % 4) as usize]
        } else if self.align >= 4 {
            k.ld_shared(Shared::at(self.base).plus(4 * i64::from(index)))
        } else {
            let (_, shift) = self.unaligned(k);
            let lo = self.raw(k, index);
            let hi = self.raw(k, index + 1);
            k.shf_r_wrap(lo, hi, shift)
        };
        self.words.insert(index, word);
        word
    }

    /// Aligned word `index` at or below the item's start.
    fn raw(&mut self, k: &mut Kernel, index: u32) -> Reg<U32> {
        if let Some(&w) = self.raw.get(&index) {
            return w;
        }
        let (word_base, _) = self.unaligned(k);
        let w = k.ld_shared(Shared::at(word_base).plus(4 * i64::from(index)));
        self.raw.insert(index, w);
        w
    }

    fn mask(k: &mut Kernel, value: Reg<U32>, position: Op<U32>, width: u32) -> Reg<U32> {
        match position {
            _ if width == 32 => value,
            Op::Imm(_) => k.bfe_u32(value, position, width),
            // `bfe` with a register position becomes four SASS instructions
            // (two PRMTs unpack position and length every time); the field
            // fits in the word here, so shift and mask say the same in two.
            Op::Reg(_) => {
                let shifted = k.shr(value, position);
                k.and(shifted, (1u32 << width) - 1)
            }
        }
    }

    /// The unit (8 or 16 bits) one naturally aligned narrow load can read a
    /// field of `width` bits from, when the field's offset has `zeros` known
    /// trailing zero bits: a field no wider than the power-of-two block its
    /// offset is aligned to never leaves that block, so it never leaves the
    /// byte (or halfword) holding it.
    fn narrow_unit(&self, width: u32, zeros: u32) -> Option<u32> {
        if width <= 8 && width <= 1 << zeros.min(3) {
            Some(8)
        } else if width <= 16 && zeros >= 4 && self.align >= 2 {
            Some(16)
        } else {
            None
        }
    }

    /// The field at bit `offset` (`offset & (unit - 1)` within the unit) from a
    /// byte or halfword load at `at`.
    fn narrow(
        k: &mut Kernel,
        at: Shared,
        unit: u32,
        shift: Option<Op<U32>>,
        width: u32,
    ) -> Reg<U32> {
        let value = k.ld_shared_narrow(at, unit);
        let value = match shift {
            Some(shift) => k.shr(value, shift),
            None => value,
        };
        if width == unit {
            value
        } else {
            k.and(value, (1u32 << width) - 1)
        }
    }

    fn read_static(&mut self, k: &mut Kernel, offset: u32, width: u32) -> Reg<U32> {
        let (index, shift) = (offset / 32, offset % 32);
        // Items at odd addresses: whole words cost two loads and a funnel
        // shift, so a byte or halfword field not already in a loaded word
        // is loaded alone.
        let unit = self.narrow_unit(width, offset.trailing_zeros());
        if let Some(unit) = unit.filter(|_| self.align < 4 && !self.words.contains_key(&index)) {
            let at = Shared::at(self.base).plus(i64::from(offset / 8 / (unit / 8) * (unit / 8)));
            let within = offset % unit;
            return Self::narrow(k, at, unit, (within > 0).then_some(Op::Imm(within)), width);
        }
        let lo = self.word(k, index);
        if shift + width <= 32 {
            Self::mask(k, lo, Op::Imm(shift), width)
        } else {
            let hi = self.word(k, index + 1);
            let joined = k.shf_r_wrap(lo, hi, shift);
            Self::mask(k, joined, Op::Imm(0), width)
        }
    }

    /// The f16 at bit `offset` (a multiple of 16) as f32.
    fn read_half(&mut self, k: &mut Kernel, offset: u32) -> Reg<F32> {
        let index = offset / 32;
        // Odd-address items load a lone halfword (see `read_static`).
        let half = if self.align < 4 && !self.words.contains_key(&index) {
            let bits = self.read_static(k, offset, 16);
            k.low16(bits)
        } else {
            let (lo, hi) = match self.halves.get(&index) {
                Some(&pair) => pair,
                None => {
                    let word = self.word(k, index);
                    let pair = k.split_halves(word);
                    self.halves.insert(index, pair);
                    pair
                }
            };
            if offset.is_multiple_of(32) {
                lo
            } else {
                hi
            }
        };
        k.f16_to_f32(half)
    }

    /// The fields of a pack of channels at bit offsets `offsets[r]`, which
    /// grow by `step` per channel of a pack, the first known to have `zeros`
    /// trailing zeros: when every pack's fields lie in one naturally aligned
    /// byte, halfword or word (the item's alignment permitting), one load
    /// per pack and a constant shift per channel (kivi int8 pairs: one
    /// `ld.shared.u16` instead of an address and a byte load each; f16
    /// quads: one `ld.shared.v2.u32`). `None`
    /// when they may not.
    fn read_pack(
        &mut self,
        k: &mut Kernel,
        offsets: &[Val],
        pack: usize,
        step: u32,
        width: u32,
        zeros: u32,
    ) -> Option<Vec<Reg<U32>>> {
        let span = step.checked_mul(pack as u32 - 1)?.checked_add(width)?;
        // Two or four words (quads or octets of f16 channels) when no field
        // straddles them.
        let in_words = (0..pack as u32).all(|e| (step * e) % 32 + width <= 32);
        let unit = [8, 16, 32, 64, 128].into_iter().find(|&unit| {
            span <= unit
                && zeros >= unit.trailing_zeros()
                && self.align >= unit / 8
                && (unit < 64 || in_words)
        })?;
        let mut fields = Vec::with_capacity(offsets.len());
        for first in offsets.iter().step_by(pack) {
            let words = match first.u32() {
                Op::Reg(offset) => {
                    let byte = k.shr(offset, 3u32);
                    let at = Shared::at(k.add(self.base, byte));
                    match unit {
                        128 => k.ld_shared_v4(at).to_vec(),
                        64 => k.ld_shared_v2(at).to_vec(),
                        32 => vec![k.ld_shared(at)],
                        _ => vec![k.ld_shared_narrow(at, unit)],
                    }
                }
                Op::Imm(_) => unreachable!("a varying offset is a register"),
            };
            let top = unit.min(32);
            for e in 0..pack as u32 {
                let bits = words[(step * e / 32) as usize];
                let shift = step * e % 32;
                // The load zero-extends, so the top field needs no mask.
                fields.push(match (shift, shift + width == top) {
                    (0, true) => bits,
                    (_, true) => k.shr(bits, shift),
                    _ => Self::mask(k, bits, Op::Imm(shift), width),
                });
            }
        }
        Some(fields)
    }

    /// `zeros`: trailing zero bits `offset` is known to have.
    fn read_dynamic(
        &mut self,
        k: &mut Kernel,
        offset: Reg<U32>,
        width: u32,
        zeros: u32,
    ) -> Reg<U32> {
        if let Some(unit) = self.narrow_unit(width, zeros) {
            // Byte address and one narrow load, at any item alignment: three
            // or four instructions instead of a word address, one or two
            // word loads and a funnel shift.
            let byte = k.shr(offset, 3u32);
            let at = k.add(self.base, byte);
            let shift = (zeros < 3).then(|| Op::Reg(k.and(offset, 7u32)));
            return Self::narrow(k, Shared::at(at), unit, shift, width);
        }
        let (word_base, bit) = if self.align >= 4 {
            (self.base, offset)
        } else {
            let (word_base, shift) = self.unaligned(k);
            (word_base, k.add(offset, shift))
        };
        let index = k.shr(bit, 5u32);
        let at = k.mad_lo(index, 4u32, word_base);
        let shift = k.and(bit, 31u32);
        let lo = k.ld_shared(Shared::at(at));
        // A field that starts on a multiple of its width never straddles two
        // words (widths of 1, 2, 4, 8, 16, 32 bits at aligned offsets).
        let single = self.align >= 4 && width <= 1 << zeros.min(5);
        if single {
            Self::mask(k, lo, Op::Reg(shift), width)
        } else {
            let hi = k.ld_shared(Shared::at(at).plus(4));
            let joined = k.shf_r_wrap(lo, hi, shift);
            Self::mask(k, joined, Op::Imm(0), width)
        }
    }
}
