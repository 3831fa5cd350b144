//! Inlines a per-query lookup table into the per-item score.
//!
//! A key prologue stage may build a table that the score reads per item (a
//! codebook key's `key.lut[j·E + i] = ⟨q'_j, c_i⟩`). This pass replaces each
//! read by the stage's own expressions for that entry, the iteration replaced
//! by the read's index, and drops the stage and its array: the score then
//! computes the entry from the codeword. The same expressions in the same
//! order give bitwise the value the table held, in every backend.

use crate::ir::builder::ExprBuilder;
use crate::ir::{
    Arena, ArrayDecl, BinaryOp, Expr, Function, Handle, Input, Kernel, Literal, Module, Stage,
    Store,
};
use crate::valid::{Range, ValidModule};

/// `module` with its first lookup table inlined (see the module docs), or
/// `None` when no prologue stage builds one. The result needs validating.
pub fn inline_lut(module: &ValidModule) -> Option<Module> {
    let m = module.module();
    let ranges = &module.info().score.ranges;
    let s = (0..m.key.prologue.stages.len()).find(|&s| inlinable(m, s, ranges))?;
    let stage = &m.key.prologue.stages[s];
    let table = stage.stores[0].array;
    let score = inline_reads(&m.key.score, stage, table, ranges);
    let mut out = m.clone();
    out.key.score = score;
    out.key.prologue.stages.remove(s);
    drop_array(&mut out, table);
    Some(out)
}

/// Whether prologue stage `s` writes one array at its iteration index, which
/// only the score reads, always below the stage's iteration count.
fn inlinable(m: &Module, s: usize, ranges: &[Option<Range>]) -> bool {
    let stage = &m.key.prologue.stages[s];
    let [store] = stage.stores[..] else {
        return false;
    };
    let at_iteration = matches!(stage.exprs[store.index], Expr::Input(Input::Iteration));
    let table = store.array;
    let special = [m.query, m.value.accumulator, m.value.output].contains(&table);
    let elsewhere = (m.key.prologue.stages.iter().enumerate())
        .filter(|&(other, _)| other != s)
        .chain(m.value.epilogue.stages.iter().enumerate())
        .any(|(_, other)| touches(other, table));
    let mut reads = score_reads(&m.key.score, table).peekable();
    let bounded = reads.peek().is_some()
        && reads
            .all(|index| ranges[index.index()].is_some_and(|r| r.hi < u64::from(stage.iterations)));
    at_iteration && !special && !elsewhere && bounded
}

fn touches(stage: &Stage, array: Handle<ArrayDecl>) -> bool {
    stage.stores.iter().any(|s| s.array == array)
        || (stage.exprs.iter())
            .any(|(_, e)| matches!(*e, Expr::Shared { array: a, .. } if a == array))
}

/// Index expressions of the score's reads of `array`.
fn score_reads(
    score: &Function,
    array: Handle<ArrayDecl>,
) -> impl Iterator<Item = Handle<Expr>> + '_ {
    score.exprs.iter().filter_map(move |(_, e)| match *e {
        Expr::Shared { array: a, index } if a == array => Some(index),
        _ => None,
    })
}

/// The score with each read of `table` replaced by `stage`'s computation of
/// that entry.
fn inline_reads(
    score: &Function,
    stage: &Stage,
    table: Handle<ArrayDecl>,
    ranges: &[Option<Range>],
) -> Function {
    let mut function = Function::default();
    let mut b = ExprBuilder::new(&mut function.exprs);
    let mut map: Vec<Handle<Expr>> = Vec::with_capacity(score.exprs.len());
    for (_, expr) in score.exprs.iter() {
        let new = match *expr {
            Expr::Shared { array, index } if array == table => {
                let entry = Entry::of(score, index, &map, ranges);
                inline_stage(&mut b, stage, entry)
            }
            _ => copy(&mut b, expr, |h| map[h.index()]),
        };
        map.push(new);
    }
    function.result = score.result.map(|r| map[r.index()]);
    function
}

/// A read's index as `offset + constant`, `offset` below `offset_end`.
#[derive(Clone, Copy)]
struct Entry {
    index: Handle<Expr>,
    offset: Handle<Expr>,
    constant: u32,
    offset_end: u64,
}

impl Entry {
    fn of(
        score: &Function,
        index: Handle<Expr>,
        map: &[Handle<Expr>],
        ranges: &[Option<Range>],
    ) -> Entry {
        let end = |h: Handle<Expr>| ranges[h.index()].map_or(u64::MAX, |r| r.hi + 1);
        let (offset, constant) = match score.exprs[index] {
            Expr::Binary {
                op: BinaryOp::Add,
                left,
                right,
            } => match score.exprs[right] {
                Expr::Literal(Literal::U32(c)) => (left, c),
                _ => (index, 0),
            },
            _ => (index, 0),
        };
        Entry {
            index: map[index.index()],
            offset: map[offset.index()],
            constant,
            offset_end: end(offset),
        }
    }

    /// `(offset + constant) / d` or `% d` without dividing, where exact:
    /// `constant` a multiple of `d` and `offset` below it.
    fn split(&self, b: &mut ExprBuilder, op: BinaryOp, d: u32) -> Option<Handle<Expr>> {
        if d == 0 || !self.constant.is_multiple_of(d) || self.offset_end > u64::from(d) {
            return None;
        }
        match op {
            BinaryOp::Divide => Some(b.u32(self.constant / d)),
            BinaryOp::Modulo => Some(self.offset),
            _ => None,
        }
    }
}

/// `stage`'s stored value for iteration `entry.index`, emitted into `b`.
fn inline_stage(b: &mut ExprBuilder, stage: &Stage, entry: Entry) -> Handle<Expr> {
    let mut map: Vec<Handle<Expr>> = Vec::with_capacity(stage.exprs.len());
    for (_, expr) in stage.exprs.iter() {
        let is_iteration =
            |h: Handle<Expr>| matches!(stage.exprs[h], Expr::Input(Input::Iteration));
        let new = match *expr {
            Expr::Input(Input::Iteration) => entry.index,
            Expr::Binary { op, left, right } if is_iteration(left) => {
                let divisor = match stage.exprs[right] {
                    Expr::Literal(Literal::U32(d)) => entry.split(b, op, d),
                    _ => None,
                };
                divisor.unwrap_or_else(|| copy(b, expr, |h| map[h.index()]))
            }
            _ => copy(b, expr, |h| map[h.index()]),
        };
        map.push(new);
    }
    map[stage.stores[0].value.index()]
}

/// `expr` re-emitted with its operands mapped.
fn copy(
    b: &mut ExprBuilder,
    expr: &Expr,
    m: impl Fn(Handle<Expr>) -> Handle<Expr>,
) -> Handle<Expr> {
    match *expr {
        Expr::Literal(literal) => b.literal(literal),
        Expr::Input(input) => b.input(input),
        Expr::ItemBits { bit_offset, width } => b.item_bits(m(bit_offset), width.into()),
        Expr::HeaderScale { slot } => b.header_scale(m(slot)),
        Expr::Table { table, index } => b.table(table, m(index)),
        Expr::Shared { array, index } => b.shared(array, m(index)),
        Expr::Unary { op, arg } => b.unary(op, m(arg)),
        Expr::Binary { op, left, right } => b.binary(op, m(left), m(right)),
        Expr::Fma { a, b: x, c } => b.fma(m(a), m(x), m(c)),
        Expr::Select {
            condition,
            accept,
            reject,
        } => b.select(m(condition), m(accept), m(reject)),
    }
}

/// Removes `dropped` from the module's arrays; every reference to a later
/// array moves down one.
fn drop_array(m: &mut Module, dropped: Handle<ArrayDecl>) {
    let mut arrays = Arena::default();
    let moved: Vec<Option<Handle<ArrayDecl>>> = m
        .arrays
        .iter()
        .map(|(h, decl)| (h != dropped).then(|| arrays.append(decl.clone())))
        .collect();
    let to = |h: Handle<ArrayDecl>| moved[h.index()].expect("the dropped array is not referenced");
    m.arrays = arrays;
    m.query = to(m.query);
    m.value.accumulator = to(m.value.accumulator);
    m.value.output = to(m.value.output);
    for kernel in [&mut m.key.prologue, &mut m.value.epilogue] {
        remap_kernel(kernel, &to);
    }
    for function in [&mut m.key.score, &mut m.value.accumulate] {
        function.exprs = remap_exprs(&function.exprs, &to);
    }
}

fn remap_kernel(kernel: &mut Kernel, to: &impl Fn(Handle<ArrayDecl>) -> Handle<ArrayDecl>) {
    for stage in &mut kernel.stages {
        stage.exprs = remap_exprs(&stage.exprs, to);
        for store in &mut stage.stores {
            *store = Store {
                array: to(store.array),
                ..*store
            };
        }
    }
}

/// A copy of `exprs` (same handles) with shared reads of remapped arrays.
fn remap_exprs(
    exprs: &Arena<Expr>,
    to: &impl Fn(Handle<ArrayDecl>) -> Handle<ArrayDecl>,
) -> Arena<Expr> {
    let mut out = Arena::default();
    for (_, expr) in exprs.iter() {
        out.append(match *expr {
            Expr::Shared { array, index } => Expr::Shared {
                array: to(array),
                index,
            },
            other => other,
        });
    }
    out
}
