//! Writes a validated module as readable text: the snapshot format under
//! `generated/`, so a change in lowering shows up as a reviewable diff.

use std::fmt::Write;

use crate::ir::{Arena, Expr, Function, Kernel, Literal, Module};
use crate::valid::{FunctionInfo, ValidModule};

/// No options yet; kept so every backend has the same shape.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options;

pub fn write(module: &ValidModule, _options: &Options) -> String {
    let (m, info) = (module.module(), module.info());
    let layout = &m.layout;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "; format {} tier {} (head_dim {})",
        m.format, m.tier, m.head_dim
    );
    let _ = writeln!(
        out,
        "; page: {} items, {} B; header {} B ({} scale slots); key stream @{} stride {} B ({} bits); value stream @{} stride {} B ({} bits)",
        layout.items_per_page,
        layout.page_bytes,
        layout.header_bytes,
        layout.header_slots,
        layout.key_stream_offset,
        layout.key.stride,
        layout.key.bits,
        layout.value_stream_offset,
        layout.value.stride,
        layout.value.bits
    );
    for (handle, table) in m.tables.iter() {
        write_decl(&mut out, "table T", handle.index(), &table.name, table.len);
    }
    for (handle, array) in m.arrays.iter() {
        write_decl(&mut out, "shared S", handle.index(), &array.name, array.len);
    }
    write_kernel(&mut out, "key.prologue", &m.key.prologue, &info.prologue);
    write_function(&mut out, "key.score", &m.key.score, &info.score);
    write_function(
        &mut out,
        "value.accumulate",
        &m.value.accumulate,
        &info.accumulate,
    );
    write_kernel(
        &mut out,
        "value.epilogue",
        &m.value.epilogue,
        &info.epilogue,
    );
    out
}

/// A declared table or array: `<kind><index> <name> [<len>]`.
fn write_decl(out: &mut String, kind: &str, index: usize, name: &str, len: u32) {
    let _ = writeln!(out, "{kind}{index} {name} [{len}]");
}

fn write_kernel(out: &mut String, name: &str, kernel: &Kernel, infos: &[FunctionInfo]) {
    for (index, (stage, info)) in kernel.stages.iter().zip(infos).enumerate() {
        let _ = writeln!(
            out,
            "\n{name}[{index}]: for iteration in 0..{} {{",
            stage.iterations
        );
        write_exprs(out, &stage.exprs, info);
        for store in &stage.stores {
            let _ = writeln!(
                out,
                "  S{}[%{}] = %{}",
                store.array.index(),
                store.index.index(),
                store.value.index()
            );
        }
        let _ = writeln!(out, "}}");
    }
}

fn write_function(out: &mut String, name: &str, function: &Function, info: &FunctionInfo) {
    let _ = writeln!(out, "\n{name} {{");
    write_exprs(out, &function.exprs, info);
    if let Some(result) = function.result {
        let _ = writeln!(out, "  return %{}", result.index());
    }
    let _ = writeln!(out, "}}");
}

fn write_exprs(out: &mut String, exprs: &Arena<Expr>, info: &FunctionInfo) {
    for (handle, expr) in exprs.iter() {
        let ty = format!("{:?}", info.types[handle.index()]).to_lowercase();
        let text = match *expr {
            Expr::Literal(Literal::U32(v)) => format!("{v}"),
            Expr::Literal(Literal::I32(v)) => format!("{v}i"),
            Expr::Literal(Literal::F32(v)) => format!("{v:?}"),
            Expr::Input(input) => format!("{input:?}").to_lowercase(),
            Expr::ItemBits { bit_offset, width } => {
                format!("item_bits(%{}, {width})", bit_offset.index())
            }
            Expr::HeaderScale { slot } => format!("header_scale(%{})", slot.index()),
            Expr::Table { table, index } => format!("T{}[%{}]", table.index(), index.index()),
            Expr::Shared { array, index } => format!("S{}[%{}]", array.index(), index.index()),
            Expr::Unary { op, arg } => format!("{op:?}(%{})", arg.index()).to_lowercase(),
            Expr::Binary { op, left, right } => {
                format!(
                    "{}(%{}, %{})",
                    format!("{op:?}").to_lowercase(),
                    left.index(),
                    right.index()
                )
            }
            Expr::Fma { a, b, c } => format!("fma(%{}, %{}, %{})", a.index(), b.index(), c.index()),
            Expr::Select {
                condition,
                accept,
                reject,
            } => {
                format!(
                    "select(%{}, %{}, %{})",
                    condition.index(),
                    accept.index(),
                    reject.index()
                )
            }
        };
        let range = match info.ranges[handle.index()] {
            Some(r) if r.lo != r.hi => format!("  ; {}..={}", r.lo, r.hi),
            _ => String::new(),
        };
        let _ = writeln!(out, "  %{} : {ty} = {text}{range}", handle.index());
    }
}

/// Snapshot file name of a tier's IR inside `generated/<format>/`.
pub fn file_name(module: &Module) -> String {
    format!("{}.ir", module.tier)
}
