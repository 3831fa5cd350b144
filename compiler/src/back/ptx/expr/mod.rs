//! IR expressions -> PTX, generic over programs: the kernel says where the
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

use super::builder::{Arith, Cmp, Global, Kernel, Op, Pred, Reg, Shared, F32, S32, U32, U64};
use crate::ir::{Arena, BinaryOp, Expr, Handle, Input, Literal, UnaryOp};
use crate::proc::{known_zeros, operands, significant_bits};
use crate::spec::Fp8;
use crate::valid::Range;

mod reads;

use reads::{aligned_table_reads, AlignedRead, Chunks, ItemReader, Source};

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

/// Everything a program may read, as the kernel provides it.
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

impl<'a> Env<'a> {
    /// A per-item program's (score, accumulate): the item in shared memory
    /// and its page header, with the arrays and tables given.
    pub fn per_item(
        replicas: Replicas<'a>,
        arrays: &'a [Option<ArrayAccess>],
        tables: &'a [Option<TableAccess>],
        header: Reg<U32>,
        item: ItemSource,
    ) -> Env<'a> {
        Env {
            replicas,
            arrays,
            tables,
            header: Some(header),
            item: Some(item),
            iteration: None,
            denominator: None,
            preloaded: None,
        }
    }
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
                    env.arrays[array.index()].expect("the kernel provides every readable array");
                for r in 0..replicas {
                    let key = (Source::Array(array.index()), r as usize);
                    chunks.shared(k, key, access.base, access.replica_stride * r, *i);
                }
            }
        }
    }
    Preloaded(chunks)
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
        Replicas::Channels { pack, ranges, .. } if pack > 1 => pack_steps(exprs, pack, |h| {
            ranges[h.index()].is_some_and(|r| r.hi < u64::from(u32::MAX))
        }),
        _ => vec![None; exprs.len()],
    };
    // Trailing zeros at a pack's first channel (a multiple of `pack`).
    let pack_zeros = known_zeros(exprs, pack.trailing_zeros());
    let zeros = known_zeros(exprs, 0);
    let known = Known {
        aligned: aligned_table_reads(exprs, &zeros),
        zeros,
        bits: significant_bits(exprs),
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
            let access =
                env.arrays[array.index()].expect("the kernel provides every readable array");
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
        } else if let Some((table, index)) = match *expr {
            Expr::Table { table, index }
                if vary && table_row_per_pack(index, pack, &steps, &pack_zeros) =>
            {
                Some((table, index))
            }
            _ => None,
        } {
            // Four channels of a pack from one 16-byte load at the first one's
            // index (a multiple of four, so aligned).
            let access = env.tables[table.index()].expect("the kernel provides every table");
            let mut chunk = None;
            for r in 0..count {
                if r % 4 == 0 {
                    let at = values[index.index()][r].u32();
                    chunk = Some(table_vector(k, access, at, 0));
                }
                let loaded: [Reg<F32>; 4] = chunk.expect("replica 0 loads first");
                out.push(Val::F32(Op::Reg(loaded[r % 4])));
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

/// How each expression changes across a pack of adjacent channels `c + e`
/// (`c` a multiple of `pack`, `e < pack`): `Some(step)` when its value at
/// `e` is exactly (as integers, no wrap) its value at `c` plus `step · e`.
/// Step 0: the same for the whole pack (any type), so emitted once per pack;
/// a nonzero step exists only on u32 chains from the channel (adds, constant
/// multiples and shifts proven not to wrap by the validator's ranges, and
/// power-of-two divisions and remainders whose pack stays within one
/// quotient). An `ItemBits` at such an offset reads the pack's fields with
/// one load ([`ItemReader::read_pack`]). `None`: emitted per channel.
/// `no_wrap(h)`: expression `h` is proven not to wrap (the validator's ranges).
fn pack_steps(
    exprs: &Arena<Expr>,
    pack: u32,
    no_wrap: impl Fn(Handle<Expr>) -> bool,
) -> Vec<Option<u32>> {
    // Trailing zeros at the pack's first channel.
    let zeros = known_zeros(exprs, pack.trailing_zeros());
    let mut steps: Vec<Option<u32>> = Vec::with_capacity(exprs.len());
    for (handle, expr) in exprs.iter() {
        let s = |h: Handle<Expr>| steps[h.index()];
        let no_wrap = no_wrap(handle);
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

/// Whether a table read at `index` gives a pack's channels four consecutive
/// elements at a time from one 16-byte load: its index steps by one over the
/// pack (`steps`, a multiple of four channels) from a multiple of four
/// (`pack_zeros`), as a codebook row read per channel of a VQ group does.
fn table_row_per_pack(
    index: Handle<Expr>,
    pack: usize,
    steps: &[Option<u32>],
    zeros: &[u32],
) -> bool {
    pack.is_multiple_of(4) && steps[index.index()] == Some(1) && zeros[index.index()] >= 2
}

/// Whether every table read of `exprs` that depends on the channel reads
/// whole 16-byte rows over packs of `pack` channels ([`table_row_per_pack`]),
/// should the validator prove its index does not wrap (the plan's question:
/// the emitter falls back to a load per channel where it does not).
pub fn table_rows_per_pack(exprs: &Arena<Expr>, pack: u32) -> bool {
    let steps = pack_steps(exprs, pack, |_| true);
    let zeros = known_zeros(exprs, pack.trailing_zeros());
    exprs.iter().all(|(_, expr)| match *expr {
        Expr::Table { index, .. } => {
            steps[index.index()] == Some(0)
                || table_row_per_pack(index, pack as usize, &steps, &zeros)
        }
        _ => true,
    })
}

/// The 16 bytes `bytes` past element `index` of a table (both 16-byte aligned).
fn table_vector(k: &mut Kernel, access: TableAccess, index: Op<U32>, bytes: i64) -> [Reg<F32>; 4] {
    match access {
        TableAccess::Shared(base) => {
            let at = shared_element(k, base, index);
            k.ld_shared_v4(at.plus(bytes))
        }
        TableAccess::Global(base) => {
            let at = global_element(k, base, index);
            k.ld_global_nc_v4(at.plus(bytes))
        }
    }
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
    /// Significant bits ([`significant_bits`]).
    bits: Vec<u32>,
    /// Item reads emitted as f32 ([`half_reads`]).
    halves: Vec<bool>,
    /// Table reads at a constant offset from an aligned index
    /// ([`aligned_table_reads`]).
    aligned: Vec<Option<AlignedRead>>,
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
            let access = env.tables[table.index()].expect("the kernel provides every table");
            // A vector where the program reads enough of its elements: any two
            // through L1 (a lane's row is one wavefront either way), all four in
            // shared memory (a vector takes up to four wavefronts a warp).
            let vector = known.aligned[handle.index()].filter(|read| match access {
                TableAccess::Global(_) => read.elements >= 2,
                TableAccess::Shared(_) => read.elements == 4,
            });
            let index = get(index).u32();
            let key = (Source::Table(table.index()), 0);
            let at_row = (Source::Table(table.index()), replica);
            let value = match (access, index, vector) {
                (TableAccess::Shared(base), Op::Imm(i), _) => chunks.shared(k, key, base, 0, i),
                (TableAccess::Global(base), Op::Imm(i), _) => chunks.global(k, key, base, i),
                (_, _, Some(read)) => {
                    let row = get(read.base).u32();
                    chunks.aligned(at_row, read, |bytes| table_vector(k, access, row, bytes))
                }
                (TableAccess::Shared(base), index, None) => {
                    let at = shared_element(k, base, index);
                    k.ld_shared(at)
                }
                (TableAccess::Global(base), index, None) => {
                    let at = global_element(k, base, index);
                    k.ld_global_nc(at)
                }
            };
            Val::F32(Op::Reg(value))
        }
        Expr::Shared { array, index } => {
            let access =
                env.arrays[array.index()].expect("the kernel provides every readable array");
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
        (UnaryOp::Fp8ToFloat(format), Val::U32(x)) => {
            let x = materialize_u32(k, x);
            f(fp8_to_f32(k, format, x))
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

/// An fp8 code in the low 8 bits as f32 (`Fp8::decode`), through the f16 it
/// widens to, with integer operations any target has: e5m2 is an f16's high
/// byte; e4m3 shifted down one bit is an f16 of 2^-8 its value, times 256
/// exactly, its NaN pattern selected apart.
pub(crate) fn fp8_to_f32(k: &mut Kernel, format: Fp8, x: Reg<U32>) -> Reg<F32> {
    let x = k.and(x, 0xFFu32);
    match format {
        Fp8::E5m2 => {
            let h = k.shl(x, 8u32);
            let half = k.low16(h);
            k.f16_to_f32(half)
        }
        Fp8::E4m3 => {
            let magnitude = k.and(x, 0x7Fu32);
            let shifted = k.shl(magnitude, 7u32);
            let sign = k.and(x, 0x80u32);
            let sign = k.shl(sign, 8u32);
            let h = k.or(shifted, sign);
            let half = k.low16(h);
            let v = k.f16_to_f32(half);
            let v = k.mul(v, 256.0f32);
            let is_nan = k.setp(Cmp::Eq, magnitude, 0x7Fu32);
            k.selp(f32::NAN, v, is_nan)
        }
    }
}

fn binary(k: &mut Kernel, op: BinaryOp, left: Val, right: Val) -> Val {
    use BinaryOp::*;
    match (left, right) {
        (Val::U32(a), Val::U32(b)) => {
            // Keep one operand in a register (two immediates only arise from
            // literals the IR builder did not fold, e.g. a wrapping subtraction).
            let a = Op::Reg(materialize_u32(k, a));
            arithmetic(k, op, a, b, Val::U32).unwrap_or_else(|| {
                let r = |r: Reg<U32>| Val::U32(Op::Reg(r));
                match op {
                    Divide => r(k.div_u32(a, b)),
                    Modulo => r(k.rem_u32(a, b)),
                    And => r(k.and(a, b)),
                    Or => r(k.or(a, b)),
                    ShiftLeft => r(k.shl(a, b)),
                    ShiftRight => r(k.shr(a, b)),
                    NotEqual => Val::Bool(k.setp(Cmp::Ne, a, b)),
                    _ => unreachable!("{op:?}: an arithmetic operation"),
                }
            })
        }
        (Val::I32(a), Val::I32(b)) => {
            let a = Op::Reg(materialize_s32(k, a));
            arithmetic(k, op, a, b, Val::I32).unwrap_or_else(|| match op {
                NotEqual => Val::Bool(k.setp(Cmp::Ne, a, b)),
                _ => unreachable!("validated IR: {op:?} on i32"),
            })
        }
        (Val::F32(a), Val::F32(b)) => {
            let a = Op::Reg(materialize_f32(k, a));
            arithmetic(k, op, a, b, Val::F32).unwrap_or_else(|| match op {
                Divide => Val::F32(Op::Reg(k.div_f32(a, b))),
                // Rust's != is true when either side is NaN.
                NotEqual => Val::Bool(k.setp(Cmp::Neu, a, b)),
                _ => unreachable!("validated IR: {op:?} on f32"),
            })
        }
        _ => unreachable!("validated IR: {op:?} operands of one type"),
    }
}

/// The operations of every arithmetic type (`None` for the others). PTX
/// `min.f32` returns the non-NaN operand, as `f32::min` does.
fn arithmetic<T: Arith>(
    k: &mut Kernel,
    op: BinaryOp,
    a: Op<T>,
    b: Op<T>,
    wrap: fn(Op<T>) -> Val,
) -> Option<Val> {
    use BinaryOp::*;
    let r = |r: Reg<T>| wrap(Op::Reg(r));
    Some(match op {
        Add => r(k.add(a, b)),
        Subtract => r(k.sub(a, b)),
        Multiply => r(k.mul(a, b)),
        Min => r(k.min(a, b)),
        Less => Val::Bool(k.setp(Cmp::Lt, a, b)),
        Equal => Val::Bool(k.setp(Cmp::Eq, a, b)),
        _ => return None,
    })
}
