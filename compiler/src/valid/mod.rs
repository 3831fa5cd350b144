//! The IR validator. Backends take a [`ValidModule`], which only [`validate`] can
//! make, so an unchecked program never reaches code generation.
//!
//! Checks: SSA order, operand types, which inputs and memories each program may
//! touch, and bounds — every item-bit read, table, shared-array and header index
//! is proven in range by interval analysis over the u32 index arithmetic.

mod range;

use std::collections::HashSet;

use crate::ir::{
    Arena, ArrayDecl, BinaryOp, Expr, Function, Handle, Input, Kernel, Literal, Module, Scalar,
    Stage, UnaryOp,
};
use crate::layout::Side;
pub use range::Range;

/// Types (and u32 ranges) of one program's expressions, indexed like its arena.
#[derive(Debug, Clone)]
pub struct FunctionInfo {
    pub types: Vec<Scalar>,
    pub ranges: Vec<Option<Range>>,
}

#[derive(Debug, Clone)]
pub struct ModuleInfo {
    pub prologue: Vec<FunctionInfo>,
    pub score: FunctionInfo,
    pub accumulate: FunctionInfo,
    pub epilogue: Vec<FunctionInfo>,
}

/// A module that passed [`validate`].
#[derive(Debug, Clone)]
pub struct ValidModule {
    module: Module,
    info: ModuleInfo,
}

impl ValidModule {
    pub fn module(&self) -> &Module {
        &self.module
    }
    pub fn info(&self) -> &ModuleInfo {
        &self.info
    }

    /// The same module over pages of `items` items: programs address items
    /// within a page and never the page size, so only the layout's page
    /// geometry changes and the proofs still hold.
    pub(crate) fn with_page_items(&self, items: u32) -> ValidModule {
        let mut repaged = self.clone();
        repaged.module.layout.set_page_items(items);
        repaged
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid IR in {location}{}: {kind}", expr.map(|e| format!(" at %{e}")).unwrap_or_default())]
pub struct ValidationError {
    /// `format/tier, program`, e.g. `spherical/mid, key.prologue[0]`.
    pub location: String,
    pub expr: Option<usize>,
    pub kind: ErrorKind,
}

fn located(
    module: &Module,
    program: &str,
    expr: Option<usize>,
    kind: ErrorKind,
) -> ValidationError {
    ValidationError {
        location: format!("{}/{}, {program}", module.format, module.tier),
        expr,
        kind,
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ErrorKind {
    #[error("operand %{0} is not defined before its use")]
    ForwardReference(usize),
    #[error("operand type {found:?} where {expected} is required")]
    Type {
        expected: &'static str,
        found: Scalar,
    },
    #[error("operands of {op:?} have different types {left:?} and {right:?}")]
    Mismatch {
        op: BinaryOp,
        left: Scalar,
        right: Scalar,
    },
    #[error("input {0:?} is not available in this program")]
    InputNotAllowed(Input),
    #[error("{0} is not available in this program")]
    MemoryNotAllowed(&'static str),
    #[error("{what} index may reach {max} but the length is {len}")]
    OutOfBounds { what: String, max: u64, len: u64 },
    #[error("item bits {offset_max}+{width} may pass the stream's {bits} bits")]
    ItemBitsOutOfBounds {
        offset_max: u64,
        width: u8,
        bits: u32,
    },
    #[error("bit width {0} is outside 1..=32")]
    Width(u8),
    #[error("shift amount may reach {0}; it must stay below 32")]
    Shift(u64),
    #[error("divisor may be zero")]
    DivisionByZero,
    #[error("array `{0}` is read in the stage that writes it")]
    ReadWhileWritten(String),
    #[error("array `{0}` is read before any stage writes it")]
    ReadBeforeWrite(String),
    #[error("the program has no result")]
    MissingResult,
    #[error("the epilogue never writes the output array")]
    OutputNotWritten,
    #[error("stage has zero iterations")]
    EmptyStage,
}

/// Which inputs and memories a program may use.
struct Context<'a> {
    module: &'a Module,
    program: String,
    input: Option<Input>,
    stream: Option<Side>,
    iterations: u32,
    readable: &'a HashSet<Handle<ArrayDecl>>,
}

pub fn validate(module: Module) -> Result<ValidModule, ValidationError> {
    let mut readable = HashSet::from([module.query]);
    let prologue = validate_kernel(
        &module,
        &module.key.prologue,
        "key.prologue",
        &mut readable,
        None,
    )?;
    let score = validate_function(
        &Context {
            module: &module,
            program: "key.score".into(),
            input: None,
            stream: Some(Side::Key),
            iterations: 0,
            readable: &readable,
        },
        &module.key.score,
    )?;
    let no_arrays = HashSet::new();
    let accumulate = validate_function(
        &Context {
            module: &module,
            program: "value.accumulate".into(),
            input: Some(Input::Channel),
            stream: Some(Side::Value),
            iterations: module.value.dims,
            readable: &no_arrays,
        },
        &module.value.accumulate,
    )?;
    let mut readable = HashSet::from([module.value.accumulator]);
    let epilogue = validate_kernel(
        &module,
        &module.value.epilogue,
        "value.epilogue",
        &mut readable,
        Some(Input::Denominator),
    )?;
    if !readable.contains(&module.value.output) {
        return Err(located(
            &module,
            "value.epilogue",
            None,
            ErrorKind::OutputNotWritten,
        ));
    }
    let info = ModuleInfo {
        prologue,
        score,
        accumulate,
        epilogue,
    };
    Ok(ValidModule { module, info })
}

fn validate_kernel(
    module: &Module,
    kernel: &Kernel,
    name: &str,
    readable: &mut HashSet<Handle<ArrayDecl>>,
    extra_input: Option<Input>,
) -> Result<Vec<FunctionInfo>, ValidationError> {
    let mut infos = Vec::new();
    for (index, stage) in kernel.stages.iter().enumerate() {
        let program = format!("{name}[{index}]");
        let info = validate_stage(module, stage, &program, readable, extra_input)?;
        readable.extend(stage.stores.iter().map(|s| s.array));
        infos.push(info);
    }
    Ok(infos)
}

fn validate_stage(
    module: &Module,
    stage: &Stage,
    program: &str,
    readable: &HashSet<Handle<ArrayDecl>>,
    extra_input: Option<Input>,
) -> Result<FunctionInfo, ValidationError> {
    let error = |expr, kind| located(module, program, expr, kind);
    if stage.iterations == 0 {
        return Err(error(None, ErrorKind::EmptyStage));
    }
    let written: HashSet<_> = stage.stores.iter().map(|s| s.array).collect();
    // Iterations run in any order, so nothing written here may also be read here.
    let stage_readable: HashSet<_> = readable.difference(&written).copied().collect();
    for (handle, expr) in stage.exprs.iter() {
        if let Expr::Shared { array, .. } = expr {
            if written.contains(array) {
                let name = module.arrays[*array].name.clone();
                return Err(error(
                    Some(handle.index()),
                    ErrorKind::ReadWhileWritten(name),
                ));
            }
        }
    }
    let context = Context {
        module,
        program: program.to_string(),
        input: extra_input,
        stream: None,
        iterations: stage.iterations,
        readable: &stage_readable,
    };
    let info = check_exprs(&context, &stage.exprs)?;
    for store in &stage.stores {
        let at = store.index.index();
        let decl = &module.arrays[store.array];
        expect_type(&info, store.index, Scalar::U32).map_err(|k| error(Some(at), k))?;
        expect_type(&info, store.value, Scalar::F32)
            .map_err(|k| error(Some(store.value.index()), k))?;
        let max = info.ranges[at].map_or(u64::from(u32::MAX), |r| r.hi);
        if max >= u64::from(decl.len) {
            return Err(error(
                Some(at),
                ErrorKind::OutOfBounds {
                    what: format!("store to `{}`", decl.name),
                    max,
                    len: decl.len.into(),
                },
            ));
        }
    }
    Ok(info)
}

fn validate_function(
    context: &Context,
    function: &Function,
) -> Result<FunctionInfo, ValidationError> {
    let info = check_exprs(context, &function.exprs)?;
    let error = |expr, kind| located(context.module, &context.program, expr, kind);
    let result = function
        .result
        .ok_or_else(|| error(None, ErrorKind::MissingResult))?;
    if result.index() >= info.types.len() {
        return Err(error(None, ErrorKind::ForwardReference(result.index())));
    }
    expect_type(&info, result, Scalar::F32).map_err(|k| error(Some(result.index()), k))?;
    Ok(info)
}

fn expect_type(
    info: &FunctionInfo,
    handle: Handle<Expr>,
    expected: Scalar,
) -> Result<(), ErrorKind> {
    let found = *info
        .types
        .get(handle.index())
        .ok_or(ErrorKind::ForwardReference(handle.index()))?;
    if found == expected {
        Ok(())
    } else {
        Err(ErrorKind::Type {
            expected: scalar_name(expected),
            found,
        })
    }
}

fn scalar_name(scalar: Scalar) -> &'static str {
    match scalar {
        Scalar::U32 => "u32",
        Scalar::I32 => "i32",
        Scalar::F32 => "f32",
        Scalar::Bool => "bool",
    }
}

fn check_exprs(
    context: &Context,
    exprs: &crate::ir::Arena<Expr>,
) -> Result<FunctionInfo, ValidationError> {
    let mut info = FunctionInfo {
        types: Vec::with_capacity(exprs.len()),
        ranges: Vec::with_capacity(exprs.len()),
    };
    for (handle, expr) in exprs.iter() {
        let (ty, range) = check_expr(context, &info, handle, expr).map_err(|kind| {
            located(context.module, &context.program, Some(handle.index()), kind)
        })?;
        info.types.push(ty);
        info.ranges.push(range);
    }
    Ok(info)
}

/// The table or array `handle` names; `what` says which kind is missing.
fn declared<'a, T>(
    arena: &'a Arena<T>,
    handle: Handle<T>,
    what: &'static str,
) -> Result<&'a T, ErrorKind> {
    arena
        .try_get(handle)
        .ok_or(ErrorKind::MemoryNotAllowed(what))
}

fn check_expr(
    context: &Context,
    info: &FunctionInfo,
    handle: Handle<Expr>,
    expr: &Expr,
) -> Result<(Scalar, Option<Range>), ErrorKind> {
    let operand = |h: Handle<Expr>| -> Result<(Scalar, Option<Range>), ErrorKind> {
        if h.index() >= handle.index() {
            return Err(ErrorKind::ForwardReference(h.index()));
        }
        Ok((info.types[h.index()], info.ranges[h.index()]))
    };
    let index_max = |h: Handle<Expr>| -> Result<u64, ErrorKind> {
        let (ty, range) = operand(h)?;
        if ty != Scalar::U32 {
            return Err(ErrorKind::Type {
                expected: "u32",
                found: ty,
            });
        }
        Ok(range.map_or(u64::from(u32::MAX), |r| r.hi))
    };
    // Every indexed read (header slot, table, array) checks the index's range the same way.
    let bounded = |what: String, index: Handle<Expr>, len: u32| {
        let max = index_max(index)?;
        if max < u64::from(len) {
            Ok(())
        } else {
            Err(ErrorKind::OutOfBounds {
                what,
                max,
                len: len.into(),
            })
        }
    };
    let module = context.module;
    Ok(match *expr {
        Expr::Literal(literal) => {
            let range = match literal {
                Literal::U32(v) => Some(Range::exact(v.into())),
                _ => None,
            };
            (literal.scalar(), range)
        }
        Expr::Input(input) => {
            let allowed = match input {
                Input::Iteration => context.stream.is_none() && context.iterations > 0,
                other => context.input == Some(other),
            };
            if !allowed {
                return Err(ErrorKind::InputNotAllowed(input));
            }
            match input {
                Input::Channel | Input::Iteration => (
                    Scalar::U32,
                    Some(Range::new(0, u64::from(context.iterations) - 1)),
                ),
                Input::Denominator => (Scalar::F32, None),
            }
        }
        Expr::ItemBits { bit_offset, width } => {
            let side = context
                .stream
                .ok_or(ErrorKind::MemoryNotAllowed("the item stream"))?;
            if !(1..=32).contains(&width) {
                return Err(ErrorKind::Width(width));
            }
            let max = index_max(bit_offset)?;
            let bits = module.stream_bits(side);
            if max + u64::from(width) > u64::from(bits) {
                return Err(ErrorKind::ItemBitsOutOfBounds {
                    offset_max: max,
                    width,
                    bits,
                });
            }
            (Scalar::U32, Some(Range::new(0, (1u64 << width) - 1)))
        }
        Expr::HeaderScale { slot } => {
            if context.stream.is_none() {
                return Err(ErrorKind::MemoryNotAllowed("the page header"));
            }
            bounded("header scale".into(), slot, module.layout.header_slots)?;
            (Scalar::F32, None)
        }
        Expr::Table { table, index } => {
            let decl = declared(&module.tables, table, "an undeclared table")?;
            bounded(format!("table `{}`", decl.name), index, decl.len)?;
            (Scalar::F32, None)
        }
        Expr::Shared { array, index } => {
            let decl = declared(&module.arrays, array, "an undeclared array")?;
            if !context.readable.contains(&array) {
                return Err(ErrorKind::ReadBeforeWrite(decl.name.clone()));
            }
            bounded(format!("array `{}`", decl.name), index, decl.len)?;
            (Scalar::F32, None)
        }
        Expr::Unary { op, arg } => {
            let (ty, range) = operand(arg)?;
            let need = |ok: bool, expected| {
                if ok {
                    Ok(())
                } else {
                    Err(ErrorKind::Type {
                        expected,
                        found: ty,
                    })
                }
            };
            match op {
                UnaryOp::Negate => {
                    need(matches!(ty, Scalar::F32 | Scalar::I32), "f32 or i32")?;
                    (ty, None)
                }
                UnaryOp::Popcount => {
                    need(ty == Scalar::U32, "u32")?;
                    let max = range.map_or(32, |r| u64::from(64 - r.hi.leading_zeros()));
                    (Scalar::U32, Some(Range::new(0, max.min(32))))
                }
                UnaryOp::HalfToFloat
                | UnaryOp::BfloatToFloat
                | UnaryOp::BitsToFloat
                | UnaryOp::Fp8ToFloat(_) => {
                    need(ty == Scalar::U32, "u32")?;
                    (Scalar::F32, None)
                }
                UnaryOp::ToFloat => {
                    need(matches!(ty, Scalar::U32 | Scalar::I32), "u32 or i32")?;
                    (Scalar::F32, None)
                }
                UnaryOp::SignExtend(bits) => {
                    need(ty == Scalar::U32, "u32")?;
                    if !(1..=32).contains(&bits) {
                        return Err(ErrorKind::Width(bits));
                    }
                    (Scalar::I32, None)
                }
            }
        }
        Expr::Binary { op, left, right } => {
            let (lt, lr) = operand(left)?;
            let (rt, rr) = operand(right)?;
            if lt != rt {
                return Err(ErrorKind::Mismatch {
                    op,
                    left: lt,
                    right: rt,
                });
            }
            let allowed: &[Scalar] = match op {
                BinaryOp::Add
                | BinaryOp::Subtract
                | BinaryOp::Multiply
                | BinaryOp::Min
                | BinaryOp::Less => &[Scalar::U32, Scalar::I32, Scalar::F32],
                BinaryOp::Divide => &[Scalar::U32, Scalar::F32],
                BinaryOp::Modulo
                | BinaryOp::And
                | BinaryOp::Or
                | BinaryOp::ShiftLeft
                | BinaryOp::ShiftRight => &[Scalar::U32],
                BinaryOp::Equal | BinaryOp::NotEqual => &[Scalar::U32, Scalar::I32, Scalar::F32],
            };
            if !allowed.contains(&lt) {
                return Err(ErrorKind::Type {
                    expected: "a type the operation supports",
                    found: lt,
                });
            }
            let result = match op {
                BinaryOp::Less | BinaryOp::Equal | BinaryOp::NotEqual => Scalar::Bool,
                _ => lt,
            };
            let range = if lt == Scalar::U32 {
                let full = Range::full();
                let (a, b) = (lr.unwrap_or(full), rr.unwrap_or(full));
                if matches!(op, BinaryOp::Divide | BinaryOp::Modulo) && b.lo == 0 {
                    return Err(ErrorKind::DivisionByZero);
                }
                if matches!(op, BinaryOp::ShiftLeft | BinaryOp::ShiftRight) && b.hi >= 32 {
                    return Err(ErrorKind::Shift(b.hi));
                }
                range::binary(op, a, b)
            } else {
                None
            };
            (result, range)
        }
        Expr::Fma { a, b, c } => {
            for h in [a, b, c] {
                let (ty, _) = operand(h)?;
                if ty != Scalar::F32 {
                    return Err(ErrorKind::Type {
                        expected: "f32",
                        found: ty,
                    });
                }
            }
            (Scalar::F32, None)
        }
        Expr::Select {
            condition,
            accept,
            reject,
        } => {
            let (ct, _) = operand(condition)?;
            if ct != Scalar::Bool {
                return Err(ErrorKind::Type {
                    expected: "bool",
                    found: ct,
                });
            }
            let (at, ar) = operand(accept)?;
            let (rt, rr) = operand(reject)?;
            if at != rt {
                return Err(ErrorKind::Type {
                    expected: scalar_name(at),
                    found: rt,
                });
            }
            let range = match (ar, rr) {
                (Some(a), Some(b)) => Some(a.union(b)),
                _ => None,
            };
            (at, range)
        }
    })
}
