//! A score program that is a dot product split over adjacent lanes: an IR
//! transform the plan chooses ([`super::plan::ScoreSplit`]) and the decode
//! kernel runs, each lane on its slice of the item and of the queries.

use std::collections::HashMap;

use crate::ir::{Arena, Expr, Function, Handle, Literal};
use crate::proc::operands;

/// Elements the emitter's preload (`expr::preload`) keeps in registers per
/// replica.
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
    /// of them can stay in registers, `expr::preload`).
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
