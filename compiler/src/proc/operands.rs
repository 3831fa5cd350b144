//! The data flow of a program's expressions: each expression's operands, the
//! shared arrays a program reads, and which expressions a kind of input
//! reaches.

use std::collections::HashSet;

use crate::ir::{Arena, ArrayDecl, Expr, Handle};

/// The expressions `expr` reads, in operand order.
pub fn operands(expr: &Expr) -> Vec<Handle<Expr>> {
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

/// The shared arrays a program reads.
pub fn shared_reads(exprs: &Arena<Expr>) -> HashSet<Handle<ArrayDecl>> {
    exprs
        .iter()
        .filter_map(|(_, e)| match *e {
            Expr::Shared { array, .. } => Some(array),
            _ => None,
        })
        .collect()
}

/// Whether a program reads a table per item (a VQ codebook row, say): such
/// reads are latency-bound gathers, which both the PTX plan (one channel per
/// lane) and the runtime's cost model (smaller CTAs) account for.
pub fn reads_tables(exprs: &Arena<Expr>) -> bool {
    exprs.iter().any(|(_, e)| matches!(e, Expr::Table { .. }))
}

/// Whether a program reads the page header's scales: a kernel prepares
/// what depends on them (a query times per-page key scales) once per page.
pub fn reads_header(exprs: &Arena<Expr>) -> bool {
    exprs
        .iter()
        .any(|(_, e)| matches!(e, Expr::HeaderScale { .. }))
}

/// Per expression: whether its value depends on an expression that `source`
/// holds for (the sources themselves included).
pub fn depends_on(exprs: &Arena<Expr>, source: impl Fn(&Expr) -> bool) -> Vec<bool> {
    let mut depends: Vec<bool> = Vec::with_capacity(exprs.len());
    for (_, expr) in exprs.iter() {
        let operand = operands(expr).iter().any(|h| depends[h.index()]);
        depends.push(operand || source(expr));
    }
    depends
}
