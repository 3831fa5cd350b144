//! The function shapes around the IR programs: the loops over a page's items,
//! over channel groups, over stage iterations, and the heads one call serves.
//!
//! ```text
//! score(page, count, tables, arrays, logits)          logits[h][i] = ⟨q_h, k_i⟩
//! accumulate(page, count, tables, weights, decays, acc)
//!                                                     acc[h][c] = acc[h][c]·decay[h][i] + weight[h][i]·v_i(c)
//!                                                     (the product rounded before the sum)
//! prologue(tables, arrays)                            one head's key arrays from its query
//! epilogue(tables, arrays, denominator)               one head's output from its accumulator
//! ```
//!
//! `score` runs `lanes` items per vector, one fma chain per lane, so each
//! item's sum keeps the IR's order; the expressions that read a head's shared
//! arrays are emitted once per head, next to each other, and everything else
//! (the decoding of the item) is shared by the heads. `accumulate` runs
//! `lanes` channels per vector, unrolled over the channel groups so channel
//! arithmetic folds to constants; what does not depend on the channel is
//! emitted once per item.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{self, types, BlockArg, InstBuilder};

use super::expr::{invariant, literal, writable, Fx, Val, LANES};
use super::stream::{item_bits, Items, Stream};
use super::Shape;
use crate::back::interp::eval::Value as Known;
use crate::ir::{Arena, Expr, Handle, Input, Kernel, Module, Scalar};
use crate::layout::{Side, HEADER_FIXED_BYTES};
use crate::proc::{known_zeros, operands};
use crate::valid::FunctionInfo;

/// What an expression depends on (transitively): anything that changes
/// inside the function's loop (item bits, channel, iteration), the channel,
/// or a head's shared arrays.
const VARYING: u8 = 1;
const CHANNEL: u8 = 2;
const HEAD: u8 = 4;

/// What expressions may read, set by the function shape around them.
struct Env<'a> {
    channel: Option<Val>,
    iteration: Option<Val>,
    denominator: Option<ir::Value>,
    page: Option<ir::Value>,
    stream: Option<Stream>,
    tables: ir::Value,
    /// Each head's arrays (the start of its block of `Shape::arrays_len` floats).
    arrays: Vec<ir::Value>,
    array_offsets: &'a [u32],
    /// Shared arrays are read-only while a score runs, not inside kernels.
    shared: ir::MemFlagsData,
}

impl<'a> Env<'a> {
    /// A per-item program's (score, accumulate) over the items of `page`,
    /// the shared arrays read-only.
    fn per_page(
        page: ir::Value,
        tables: ir::Value,
        arrays: Vec<ir::Value>,
        array_offsets: &'a [u32],
    ) -> Env<'a> {
        Env {
            channel: None,
            iteration: None,
            denominator: None,
            page: Some(page),
            stream: None,
            tables,
            arrays,
            array_offsets,
            shared: invariant(),
        }
    }
}

/// One IR program being lowered: its dependencies, the expressions its
/// results need, and the values lowered so far (one per head where an
/// expression reads a head's arrays).
struct Program<'m> {
    exprs: &'m Arena<Expr>,
    info: &'m FunctionInfo,
    deps: Vec<u8>,
    live: Vec<bool>,
    /// Known trailing zero bits of each u32 value (alignment of bit offsets).
    zeros: Vec<u32>,
    heads: usize,
    vals: Vec<Option<Val>>,
}

impl<'m> Program<'m> {
    fn new(
        exprs: &'m Arena<Expr>,
        info: &'m FunctionInfo,
        roots: &[Handle<Expr>],
        heads: usize,
    ) -> Program<'m> {
        let mut deps = vec![0u8; exprs.len()];
        for (h, expr) in exprs.iter() {
            let own = match expr {
                Expr::ItemBits { .. } | Expr::Input(Input::Iteration) => VARYING,
                Expr::Input(Input::Channel) => VARYING | CHANNEL,
                Expr::Shared { .. } => HEAD,
                _ => 0,
            };
            deps[h.index()] = operands(expr).iter().fold(own, |d, o| d | deps[o.index()]);
        }
        // A channel is not known to be aligned.
        let zeros = known_zeros(exprs, 0);
        let mut live = vec![false; exprs.len()];
        for root in roots {
            live[root.index()] = true;
        }
        for (h, expr) in exprs.iter().collect::<Vec<_>>().into_iter().rev() {
            if live[h.index()] {
                for o in operands(expr) {
                    live[o.index()] = true;
                }
            }
        }
        Program {
            exprs,
            info,
            deps,
            live,
            zeros,
            heads,
            vals: vec![None; exprs.len() * heads],
        }
    }

    fn slot(&self, h: Handle<Expr>, head: usize) -> usize {
        let head = if self.deps[h.index()] & HEAD != 0 {
            head
        } else {
            0
        };
        h.index() * self.heads + head
    }

    fn get(&self, h: Handle<Expr>, head: usize) -> Val {
        self.vals[self.slot(h, head)].expect("operands are lowered first (SSA order)")
    }

    /// Lowers, in arena order, the live expressions whose dependencies pass
    /// `filter` and that are not lowered yet.
    fn lower(&mut self, fx: &mut Fx, env: &Env, filter: impl Fn(u8) -> bool) {
        for (h, expr) in self.exprs.iter() {
            let i = h.index();
            if !self.live[i] || !filter(self.deps[i]) || self.vals[self.slot(h, 0)].is_some() {
                continue;
            }
            let heads = if self.deps[i] & HEAD != 0 {
                self.heads
            } else {
                1
            };
            for head in 0..heads {
                let v = self.lower_one(fx, env, expr, head);
                let slot = self.slot(h, head);
                self.vals[slot] = Some(v);
            }
        }
    }

    /// Forgets the values of expressions whose dependencies include `deps`.
    fn forget(&mut self, deps: u8) {
        for (i, d) in self.deps.iter().enumerate() {
            if d & deps != 0 {
                self.vals[i * self.heads..(i + 1) * self.heads].fill(None);
            }
        }
    }

    fn lower_one(&self, fx: &mut Fx, env: &Env, expr: &Expr, head: usize) -> Val {
        let get = |o: Handle<Expr>| self.get(o, head);
        let ty = |o: Handle<Expr>| self.info.types[o.index()];
        const AVAILABLE: &str = "validated IR reads only what its program has";
        match *expr {
            Expr::Literal(l) => Val::Const(literal(l)),
            Expr::Input(Input::Channel) => env.channel.expect(AVAILABLE),
            Expr::Input(Input::Iteration) => env.iteration.expect(AVAILABLE),
            Expr::Input(Input::Denominator) => Val::Uniform(env.denominator.expect(AVAILABLE)),
            Expr::ItemBits { bit_offset, width } => {
                let stream = env.stream.as_ref().expect(AVAILABLE);
                let max =
                    self.info.ranges[bit_offset.index()].map_or(u64::from(u32::MAX), |r| r.hi);
                let byte_aligned = self.zeros[bit_offset.index()] >= 3;
                item_bits(fx, stream, get(bit_offset), width, max, byte_aligned)
            }
            Expr::HeaderScale { slot } => {
                let page = env.page.expect(AVAILABLE);
                fx.load_f32(invariant(), page, HEADER_FIXED_BYTES, get(slot))
            }
            Expr::Table { table, index } => {
                let base = fx.b.ins().load(
                    types::I64,
                    invariant(),
                    env.tables,
                    8 * table.index() as i32,
                );
                fx.load_f32(invariant(), base, 0, get(index))
            }
            Expr::Shared { array, index } => {
                let offset = 4 * env.array_offsets[array.index()];
                fx.load_f32(env.shared, env.arrays[head], offset, get(index))
            }
            Expr::Unary { op, arg } => fx.unary(op, ty(arg), get(arg)),
            Expr::Binary { op, left, right } => fx.binary(op, ty(left), get(left), get(right)),
            Expr::Fma { a, b, c } => fx.fma(get(a), get(b), get(c)),
            Expr::Select {
                condition,
                accept,
                reject,
            } => fx.select(ty(accept), get(condition), get(accept), get(reject)),
        }
    }
}

/// A counted loop `for i in (0..end).step_by(step)` whose body `body(fx, i)`
/// emits, from the current block (the preheader, where code that does not
/// change in the loop goes); returns with the exit block current.
fn counted(fx: &mut Fx, end: ir::Value, step: u32, body: impl FnOnce(&mut Fx, ir::Value)) {
    let preheader = fx.b.current_block().expect("inside a block");
    let header = fx.b.create_block();
    let block = fx.b.create_block();
    let exit = fx.b.create_block();
    let i = fx.b.append_block_param(header, types::I32);
    let zero = fx.iconst(0);
    let enter = fx.b.ins().jump(header, &[BlockArg::Value(zero)]);
    fx.switch_to(header);
    let more = fx.b.ins().icmp(IntCC::UnsignedLessThan, i, end);
    fx.b.ins().brif(more, block, &[], exit, &[]);
    fx.switch_to(block);
    fx.begin_loop(preheader, enter);
    body(fx, i);
    fx.end_loop();
    let next = fx.b.ins().iadd_imm_u(i, i64::from(step));
    fx.b.ins().jump(header, &[BlockArg::Value(next)]);
    fx.switch_to(exit);
}

/// `base + offset + scale * index` (index an i32, as u32).
fn address(fx: &mut Fx, base: ir::Value, offset: u32, scale: u32, index: ir::Value) -> ir::Value {
    let wide = fx.b.ins().uextend(types::I64, index);
    let scaled = fx.b.ins().imul_imm_u(wide, i64::from(scale));
    let at = fx.b.ins().iadd(base, scaled);
    fx.b.ins().iadd_imm_u(at, i64::from(offset))
}

/// Stores `v` as `lanes` f32s at `address`.
fn store(fx: &mut Fx, v: Val, address: ir::Value, offset: u32) {
    let x = if fx.lanes > 1 {
        fx.vector(v, Scalar::F32)
    } else {
        fx.scalar(v)
    };
    fx.b.ins().store(writable(), x, address, offset as i32);
}

/// The f32 at `base + 4 * index + offset`.
fn load_f32(fx: &mut Fx, base: ir::Value, offset: u32, index: ir::Value) -> ir::Value {
    let at = address(fx, base, offset, 4, index);
    fx.b.ins().load(types::F32, invariant(), at, 0)
}

/// `acc[start..start + len] *= decay` unless `decay` is 1. The interpreter's
/// `acc * decay + weight * v` rounds the product before the sum, so scaling
/// first and adding `weight * v` later is the same arithmetic; a decay other
/// than 1 (a new running max) is rare, so this stays off the hot path.
fn rescale(fx: &mut Fx, acc: ir::Value, start: usize, len: usize, decay: ir::Value) {
    let ty = if fx.lanes > 1 {
        types::F32X4
    } else {
        types::F32
    };
    let one = fx.b.ins().f32const(1.0);
    let unit = fx.b.ins().fcmp(FloatCC::Equal, decay, one);
    let scale = fx.b.create_block();
    let done = fx.b.create_block();
    fx.b.set_cold_block(scale);
    fx.b.ins().brif(unit, done, &[], scale, &[]);
    fx.b.switch_to_block(scale);
    let factor = if fx.lanes > 1 {
        fx.b.ins().splat(ty, decay)
    } else {
        decay
    };
    for at in (start..start + len).step_by(fx.lanes) {
        let old = fx.b.ins().load(ty, writable(), acc, (4 * at) as i32);
        let new = fx.b.ins().fmul(old, factor);
        fx.b.ins().store(writable(), new, acc, (4 * at) as i32);
    }
    fx.b.ins().jump(done, &[]);
    // `done` is dominated by the block before the branch: what lowering has
    // cached there stays valid.
    fx.b.switch_to_block(done);
}

/// Bytes readable from the start of any item of `side`'s stream.
fn readable(module: &Module, side: Side) -> u32 {
    let layout = &module.layout;
    let last = layout.stream_offset(side) + (layout.items_per_page - 1) * layout.codec(side).stride;
    layout.page_bytes - last
}

/// `score(page, count, tables, arrays, logits)`.
pub(super) fn score(
    fx: &mut Fx,
    module: &Module,
    info: &FunctionInfo,
    shape: &Shape,
    args: &[ir::Value],
) {
    let &[page, count, tables, arrays, logits] = args else {
        unreachable!("score takes five arguments")
    };
    let layout = &module.layout;
    let heads = shape.heads;
    let lanes = fx.lanes;
    let mut program = Program::new(
        &module.key.score.exprs,
        info,
        &[result(&module.key.score)],
        heads,
    );
    let arrays = (0..heads)
        .map(|h| {
            fx.b.ins()
                .iadd_imm_u(arrays, (4 * h * shape.arrays_len) as i64)
        })
        .collect();
    let mut env = Env::per_page(page, tables, arrays, &shape.array_offsets);
    program.lower(fx, &env, |d| d & VARYING == 0);
    counted(fx, count, lanes as u32, |fx, i| {
        let last = fx.b.ins().iadd_imm_s(count, -1);
        let addresses: [ir::Value; LANES] = std::array::from_fn(|k| {
            // Lanes past the last item re-read it; their logits are not used.
            let item = if k == 0 {
                i
            } else {
                let next = fx.b.ins().iadd_imm_u(i, k as i64);
                fx.b.ins().umin(next, last)
            };
            address(fx, page, layout.key_stream_offset, layout.key.stride, item)
        });
        let items = if lanes > 1 {
            Items::Lanes(addresses)
        } else {
            Items::One(addresses[0])
        };
        env.stream = Some(Stream {
            items,
            readable: readable(module, Side::Key),
        });
        program.lower(fx, &env, |_| true);
        let result = result(&module.key.score);
        for head in 0..heads {
            let at = address(fx, logits, (4 * head * shape.items_stride) as u32, 4, i);
            store(fx, program.get(result, head), at, 0);
        }
    });
    fx.b.ins().return_(&[]);
}

/// `accumulate(page, count, tables, weights, decays, acc)`.
pub(super) fn accumulate(
    fx: &mut Fx,
    module: &Module,
    info: &FunctionInfo,
    shape: &Shape,
    args: &[ir::Value],
) {
    let &[page, count, tables, weights, decays, acc] = args else {
        unreachable!("accumulate takes six arguments")
    };
    let layout = &module.layout;
    let lanes = fx.lanes;
    let dims = module.value.dims;
    let function = &module.value.accumulate;
    let mut program = Program::new(&function.exprs, info, &[result(function)], 1);
    let mut env = Env::per_page(page, tables, Vec::new(), &shape.array_offsets);
    program.lower(fx, &env, |d| d & VARYING == 0);
    counted(fx, count, 1, |fx, i| {
        let item = address(fx, page, layout.value_stream_offset, layout.value.stride, i);
        env.stream = Some(Stream {
            items: Items::One(item),
            readable: readable(module, Side::Value),
        });
        let weights: Vec<ir::Value> = (0..shape.heads)
            .map(|h| {
                let offset = (4 * h * shape.items_stride) as u32;
                let decay = load_f32(fx, decays, offset, i);
                rescale(fx, acc, h * shape.dims_stride, shape.dims_stride, decay);
                let weight = load_f32(fx, weights, offset, i);
                if lanes > 1 {
                    fx.vector(Val::Uniform(weight), Scalar::F32)
                } else {
                    weight
                }
            })
            .collect();
        program.lower(fx, &env, |d| d & CHANNEL == 0);
        for group in 0..dims.div_ceil(lanes as u32) {
            program.forget(CHANNEL);
            // Lanes past the last channel repeat it; acc is padded for them.
            let channels: [Known; LANES] = std::array::from_fn(|k| {
                Known::U32((group * lanes as u32 + k as u32).min(dims - 1))
            });
            env.channel = Some(if lanes > 1 {
                Val::from_known(channels)
            } else {
                Val::Const(channels[0])
            });
            program.lower(fx, &env, |d| d & CHANNEL != 0);
            let v = program.get(result(function), 0);
            let v = if lanes > 1 {
                fx.vector(v, Scalar::F32)
            } else {
                fx.scalar(v)
            };
            let ty = if lanes > 1 { types::F32X4 } else { types::F32 };
            for (h, &weight) in weights.iter().enumerate() {
                let offset = (4 * (h * shape.dims_stride + group as usize * lanes)) as i32;
                let old = fx.b.ins().load(ty, writable(), acc, offset);
                let added = fx.b.ins().fmul(weight, v);
                let new = fx.b.ins().fadd(old, added);
                fx.b.ins().store(writable(), new, acc, offset);
            }
        }
    });
    fx.b.ins().return_(&[]);
}

/// `prologue(tables, arrays)` or `epilogue(tables, arrays, denominator)`:
/// the stages in order, each a loop over its iterations, for one head.
pub(super) fn kernel(
    fx: &mut Fx,
    kernel: &Kernel,
    infos: &[FunctionInfo],
    shape: &Shape,
    args: &[ir::Value],
) {
    let (tables, arrays, denominator) = match *args {
        [tables, arrays] => (tables, arrays, None),
        [tables, arrays, denominator] => (tables, arrays, Some(denominator)),
        _ => unreachable!("kernels take two or three arguments"),
    };
    for (stage, info) in kernel.stages.iter().zip(infos) {
        let roots: Vec<_> = stage
            .stores
            .iter()
            .flat_map(|s| [s.index, s.value])
            .collect();
        let mut program = Program::new(&stage.exprs, info, &roots, 1);
        let mut env = Env {
            channel: None,
            iteration: None,
            denominator,
            page: None,
            stream: None,
            tables,
            arrays: vec![arrays],
            array_offsets: &shape.array_offsets,
            // Later stages read what earlier ones stored: keep loads in order.
            shared: writable(),
        };
        program.lower(fx, &env, |d| d & VARYING == 0);
        let mut run = |fx: &mut Fx, iteration: Val| {
            env.iteration = Some(iteration);
            program.lower(fx, &env, |_| true);
            for s in &stage.stores {
                let index = fx.scalar(program.get(s.index, 0));
                let value = fx.scalar(program.get(s.value, 0));
                let at = address(
                    fx,
                    arrays,
                    4 * shape.array_offsets[s.array.index()],
                    4,
                    index,
                );
                fx.b.ins().store(writable(), value, at, 0);
            }
        };
        if stage.iterations == 1 {
            run(fx, Val::Const(Known::U32(0)));
        } else {
            let end = fx.iconst(stage.iterations);
            counted(fx, end, 1, |fx, i| run(fx, Val::Uniform(i)));
        }
    }
    fx.b.ins().return_(&[]);
}

fn result(function: &crate::ir::Function) -> Handle<Expr> {
    function.result.expect("validated functions have a result")
}
