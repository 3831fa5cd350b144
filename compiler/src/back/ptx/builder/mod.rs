//! A typed PTX builder: virtual registers carry their PTX type in the Rust type,
//! so an `add.rn.f32` on a u32 register, a shared load through a 64-bit global
//! address or a `selp` on predicates does not compile. The builder emits text;
//! ptxas allocates the real registers.
//!
//! One [`Kernel`] builds one `.entry`; [`module`] wraps kernels into a PTX module
//! for a [`Target`](super::Target).

use std::fmt::Write;
use std::marker::PhantomData;

/// Instructions of one line, `opcode d, operands…`: each a method taking
/// its operands in order and returning the new register `d`, written as a
/// table rather than a function body per instruction.
macro_rules! instructions {
    ($($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $opcode:literal;)*) => {
        impl Kernel {
            $(
                $(#[$doc])*
                pub fn $name(&mut self, $($arg: $ty),*) -> Reg<$ret> {
                    self.op($opcode, &[$(&super::operand($arg)),*])
                }
            )*
        }
    };
}

mod arith;
mod memory;
mod rounding;
mod warp;

/// A PTX register type: how its registers are declared and named. A type
/// is a marker, so registers of it copy and compare by their number alone.
pub trait Type: Copy + Eq + 'static {
    /// Declared type, e.g. `.u32`.
    const DECL: &'static str;
    /// Register name prefix, unique per type so the declarations never overlap.
    const PREFIX: &'static str;
    /// Index of this type's register counter.
    const CLASS: usize;
    /// Rust type of an immediate operand.
    type Imm: Copy;
    fn imm(value: Self::Imm) -> String;
}

/// Types with arithmetic (`add`, `sub`, `mul`, `min`, `max`, `setp`).
pub trait Arith: Type {
    /// Type suffix of comparisons and min/max.
    const SUFFIX: &'static str;
    /// Suffix of add/sub/mul: floats round to nearest explicitly, which also
    /// forbids ptxas from contracting a mul and an add into an fma (the IR only
    /// fuses where it says `Fma`).
    const ADD: &'static str;
    const MUL: &'static str;
}

/// 32-bit types that move as raw bits (`mov.b32`, `selp.b32`, `shfl`, ld/st).
pub trait Bits32: Type {
    /// Suffix of loads, stores and `selp` (`u32`, `s32`, `f32`, `b32`).
    const SUFFIX: &'static str;
}

macro_rules! reg_type {
    ($name:ident, $decl:literal, $prefix:literal, $class:literal, $imm:ty, $fmt:expr) => {
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name;
        impl Type for $name {
            const DECL: &'static str = $decl;
            const PREFIX: &'static str = $prefix;
            const CLASS: usize = $class;
            type Imm = $imm;
            fn imm(value: $imm) -> String {
                let format: fn($imm) -> String = $fmt;
                format(value)
            }
        }
    };
}

reg_type!(U32, ".u32", "%r", 0, u32, |v| v.to_string());
reg_type!(S32, ".s32", "%s", 1, i32, |v| v.to_string());
// Hex float immediates are exact.
reg_type!(F32, ".f32", "%f", 2, f32, |v| format!(
    "0f{:08X}",
    v.to_bits()
));
reg_type!(B32, ".b32", "%b", 3, u32, |v| format!("0x{v:08X}"));
reg_type!(U64, ".u64", "%rd", 4, u64, |v| v.to_string());
reg_type!(B16, ".b16", "%h", 5, u16, |v| v.to_string());
reg_type!(Pred, ".pred", "%p", 6, bool, |v| u8::from(v).to_string());
const CLASSES: usize = 7;

/// The suffixes of each arithmetic type: min/max and comparisons, add/sub,
/// mul.
macro_rules! arith_types {
    ($($t:ident: $suffix:literal, $add:literal, $mul:literal;)*) => {
        $(impl Arith for $t {
            const SUFFIX: &'static str = $suffix;
            const ADD: &'static str = $add;
            const MUL: &'static str = $mul;
        })*
    };
}
arith_types! {
    U32: "u32", "u32", "lo.u32";
    S32: "s32", "s32", "lo.s32";
    F32: "f32", "rn.f32", "rn.f32";
    U64: "u64", "u64", "lo.u64";
}

/// The load/store suffix of each 32-bit type.
macro_rules! bits32_types {
    ($($t:ident: $suffix:literal;)*) => {
        $(impl Bits32 for $t {
            const SUFFIX: &'static str = $suffix;
        })*
    };
}
bits32_types! {
    U32: "u32";
    S32: "s32";
    F32: "f32";
    B32: "b32";
}

/// A virtual register of type `T`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Reg<T> {
    id: u32,
    marker: PhantomData<T>,
}

impl<T: Type> std::fmt::Display for Reg<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", T::PREFIX, self.id)
    }
}
impl<T> std::fmt::Debug for Reg<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "reg{}", self.id)
    }
}

/// A source operand: a register or an immediate of the same type.
pub enum Op<T: Type> {
    Reg(Reg<T>),
    Imm(T::Imm),
}

impl<T: Type> Clone for Op<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: Type> Copy for Op<T> {}
impl<T: Type> std::fmt::Display for Op<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::Reg(r) => write!(f, "{r}"),
            Op::Imm(v) => f.write_str(&T::imm(*v)),
        }
    }
}
impl<T: Type> From<Reg<T>> for Op<T> {
    fn from(r: Reg<T>) -> Self {
        Op::Reg(r)
    }
}
/// Immediates: each register type's Rust value as an operand.
macro_rules! immediates {
    ($($rust:ty => $t:ident),*) => {
        $(impl From<$rust> for Op<$t> {
            fn from(v: $rust) -> Self {
                Op::Imm(v)
            }
        })*
    };
}
immediates!(u32 => U32, i32 => S32, f32 => F32, u64 => U64, bool => Pred);

/// A shared-memory address: 32-bit register plus byte offset.
#[derive(Debug, Clone, Copy)]
pub struct Shared {
    pub base: Reg<U32>,
    pub offset: i64,
}

/// A global-memory address: 64-bit register plus byte offset, and the L2
/// cache policy (from [`Kernel::l2_policy`]) its loads and copies take.
#[derive(Debug, Clone, Copy)]
pub struct Global {
    pub base: Reg<U64>,
    pub offset: i64,
    pub policy: Option<Reg<U64>>,
}

/// Which lines an L2 cache policy evicts first or keeps longest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Evict {
    First,
    Last,
}

impl Shared {
    pub fn at(base: Reg<U32>) -> Shared {
        Shared { base, offset: 0 }
    }
    pub fn plus(self, bytes: i64) -> Shared {
        Shared {
            base: self.base,
            offset: self.offset + bytes,
        }
    }
}

impl Global {
    pub fn at(base: Reg<U64>) -> Global {
        Global {
            base,
            offset: 0,
            policy: None,
        }
    }
    pub fn plus(self, bytes: i64) -> Global {
        Global {
            offset: self.offset + bytes,
            ..self
        }
    }
    /// The same address, read under L2 cache policy `policy`.
    pub fn cached(self, policy: Reg<U64>) -> Global {
        Global {
            policy: Some(policy),
            ..self
        }
    }
    /// The `.L2::cache_hint` qualifier and trailing policy operand of an
    /// access to this address (empty without a policy).
    fn hint(&self) -> (&'static str, String) {
        match self.policy {
            Some(p) => (".L2::cache_hint", format!(", {p}")),
            None => ("", String::new()),
        }
    }
}

fn address(base: impl std::fmt::Display, offset: i64) -> String {
    match offset {
        0 => format!("[{base}]"),
        // PTX spells a negative displacement `+-n`.
        o => format!("[{base}+{o}]"),
    }
}

impl std::fmt::Display for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&address(self.base, self.offset))
    }
}
impl std::fmt::Display for Global {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&address(self.base, self.offset))
    }
}

/// A kernel parameter of type `T`.
pub struct Param<T> {
    name: String,
    marker: PhantomData<T>,
}

/// A branch target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Label(u32);

impl std::fmt::Display for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "$L{}", self.0)
    }
}

/// Comparison of `setp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Lt,
    Le,
    Gt,
    Ge,
    Eq,
    Ne,
    /// Float not-equal that is true when either side is NaN (Rust's `!=`).
    Neu,
}

impl Cmp {
    fn name(self) -> &'static str {
        match self {
            Cmp::Lt => "lt",
            Cmp::Le => "le",
            Cmp::Gt => "gt",
            Cmp::Ge => "ge",
            Cmp::Eq => "eq",
            Cmp::Ne => "ne",
            Cmp::Neu => "neu",
        }
    }
}

/// Grid axis of `%ctaid`.
#[derive(Debug, Clone, Copy)]
pub enum Axis {
    X,
    Y,
    Z,
}

impl Axis {
    fn name(self) -> &'static str {
        match self {
            Axis::X => "x",
            Axis::Y => "y",
            Axis::Z => "z",
        }
    }
}

/// An operand as the instruction text shows it.
fn operand<T: Type>(x: impl Into<Op<T>>) -> Op<T> {
    x.into()
}

/// Builds one kernel entry.
pub struct Kernel {
    name: String,
    params: Vec<(String, &'static str)>,
    threads: u32,
    counters: [u32; CLASSES],
    labels: u32,
    guard: Option<String>,
    body: String,
    shared_symbol: &'static str,
}

impl Kernel {
    /// A kernel launched with exactly `threads` threads per block, whose
    /// dynamic shared memory is the symbol `shared_symbol`. The entry starts by
    /// trapping on any other block size. It carries no `.reqntid`/`.maxntid`:
    /// with those, ptxas trades small spills for occupancy, and these kernels'
    /// occupancy is bounded by shared memory anyway.
    pub fn new(name: &str, threads: u32, shared_symbol: &'static str) -> Kernel {
        Kernel {
            name: name.to_string(),
            params: Vec::new(),
            threads,
            counters: [0; CLASSES],
            labels: 0,
            guard: None,
            body: String::new(),
            shared_symbol,
        }
    }

    /// Declares the next parameter (parameters are positional, in call order).
    pub fn param<T: Type>(&mut self, name: &str) -> Param<T> {
        debug_assert!(
            self.params.iter().all(|(n, _)| n != name),
            "duplicate parameter {name}"
        );
        self.params.push((name.to_string(), T::DECL));
        Param {
            name: name.to_string(),
            marker: PhantomData,
        }
    }

    pub fn reg<T: Type>(&mut self) -> Reg<T> {
        let id = self.counters[T::CLASS];
        self.counters[T::CLASS] += 1;
        Reg {
            id,
            marker: PhantomData,
        }
    }

    fn line(&mut self, text: std::fmt::Arguments) {
        self.body.push('\t');
        if let Some(guard) = &self.guard {
            self.body.push_str(guard);
            self.body.push(' ');
        }
        let _ = self.body.write_fmt(text);
        self.body.push_str(";\n");
    }

    /// `opcode d, operands…` into a new register `d`.
    fn op<D: Type>(
        &mut self,
        opcode: impl std::fmt::Display,
        operands: &[&dyn std::fmt::Display],
    ) -> Reg<D> {
        let d = self.reg();
        self.op_to(opcode, d, operands);
        d
    }

    /// `opcode dst, operands…` into an existing register.
    fn op_to<D: Type>(
        &mut self,
        opcode: impl std::fmt::Display,
        dst: Reg<D>,
        operands: &[&dyn std::fmt::Display],
    ) {
        let mut text = format!("{opcode} {dst}");
        for operand in operands {
            let _ = write!(text, ", {operand}");
        }
        self.line(format_args!("{text}"));
    }

    /// A comment line in the output, to keep the PTX reviewable.
    pub fn comment(&mut self, text: &str) {
        // ptxas (13.0) rejects any non-ASCII character, comments included.
        assert!(text.is_ascii(), "PTX comments are ASCII: {text}");
        let _ = writeln!(self.body, "\t// {text}");
    }

    /// Emits the instructions of `f` under the predicate `p` (negated if `!when`).
    pub fn guarded(&mut self, p: Reg<Pred>, when: bool, f: impl FnOnce(&mut Kernel)) {
        debug_assert!(self.guard.is_none(), "guards do not nest");
        self.guard = Some(format!("@{}{p}", if when { "" } else { "!" }));
        f(self);
        self.guard = None;
    }

    // ---- control flow -------------------------------------------------------

    pub fn label(&mut self) -> Label {
        self.labels += 1;
        Label(self.labels)
    }
    pub fn place(&mut self, label: Label) {
        debug_assert!(self.guard.is_none());
        let _ = writeln!(self.body, "{label}:");
    }
    pub fn bra(&mut self, label: Label) {
        debug_assert!(self.guard.is_none(), "use bra_if for a conditional branch");
        self.line(format_args!("bra.uni {label}"));
    }
    /// Branches when `p` equals `when`.
    pub fn bra_if(&mut self, p: Reg<Pred>, when: bool, label: Label) {
        debug_assert!(self.guard.is_none());
        let bang = if when { "" } else { "!" };
        self.line(format_args!("@{bang}{p} bra {label}"));
    }
    /// `for i in (start..count).step_by(step) { body(i) }` as a loop; no
    /// barrier inside (threads leave it after different trips).
    pub fn counted(
        &mut self,
        start: impl Into<Op<U32>>,
        count: impl Into<Op<U32>>,
        step: impl Into<Op<U32>>,
        body: impl FnOnce(&mut Kernel, Reg<U32>),
    ) {
        let (count, step) = (count.into(), step.into());
        let i = self.mov(start);
        let (top, end) = (self.label(), self.label());
        self.place(top);
        let done = self.setp(Cmp::Ge, i, count);
        self.bra_if(done, true, end);
        body(self, i);
        self.add_to(i, i, step);
        self.bra(top);
        self.place(end);
    }
    /// Lets the grid launched after this one with programmatic dependent
    /// launch start once every CTA of this one has passed here (or exited).
    pub fn launch_dependents(&mut self) {
        self.line(format_args!("griddepcontrol.launch_dependents"));
    }
    /// Waits until the grids this one depends on have finished and their
    /// memory is visible (at once without a programmatic dependent launch).
    pub fn wait_for_prerequisites(&mut self) {
        self.line(format_args!("griddepcontrol.wait"));
    }
    pub fn bar_sync(&mut self) {
        self.line(format_args!("bar.sync 0"));
    }
    /// `bar.sync` that the CTA's warps may reach at different instructions
    /// (`bar.sync` is `barrier.sync.aligned`: one instruction for all).
    pub fn barrier_sync(&mut self) {
        self.line(format_args!("barrier.sync 0"));
    }
    /// `bar.sync` that also returns, to every thread, whether `p` held in any
    /// thread of the CTA (`__syncthreads_or`); it orders memory as `bar.sync`.
    pub fn bar_red_or(&mut self, p: Reg<Pred>) -> Reg<Pred> {
        let d = self.reg();
        self.line(format_args!("bar.red.or.pred {d}, 0, {p}"));
        d
    }
    /// Orders the shared-memory accesses of all 32 lanes of the warp: lanes
    /// are scheduled independently (sm_70+), so a value lanes read and one
    /// lane then overwrites needs this between the reads and the write.
    pub fn bar_warp_sync(&mut self) {
        self.line(format_args!("bar.warp.sync 0xffffffff"));
    }
    pub fn ret(&mut self) {
        self.line(format_args!("ret"));
    }

    // ---- special registers and parameters ----------------------------------

    pub fn tid_x(&mut self) -> Reg<U32> {
        let d = self.reg();
        self.line(format_args!("mov.u32 {d}, %tid.x"));
        d
    }
    pub fn ctaid(&mut self, axis: Axis) -> Reg<U32> {
        let d = self.reg();
        self.line(format_args!("mov.u32 {d}, %ctaid.{}", axis.name()));
        d
    }
    /// CTAs of the grid along `axis`.
    pub fn nctaid(&mut self, axis: Axis) -> Reg<U32> {
        let d = self.reg();
        self.line(format_args!("mov.u32 {d}, %nctaid.{}", axis.name()));
        d
    }
    /// Shared-window address of the dynamic shared memory.
    pub fn shared_base(&mut self) -> Reg<U32> {
        let d = self.reg();
        let symbol = self.shared_symbol;
        self.line(format_args!("mov.u32 {d}, {symbol}"));
        d
    }
    pub fn ld_param<T: Type>(&mut self, param: &Param<T>) -> Reg<T> {
        let d = self.reg();
        self.line(format_args!("ld.param{} {d}, [{}]", T::DECL, param.name));
        d
    }
    /// A global pointer parameter, converted to a global-space address.
    pub fn ld_pointer(&mut self, param: &Param<U64>) -> Reg<U64> {
        let generic = self.ld_param(param);
        let d = self.reg();
        self.line(format_args!("cvta.to.global.u64 {d}, {generic}"));
        d
    }

    /// The finished `.entry` text.
    pub fn finish(self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, ".visible .entry {}(", self.name);
        for (i, (name, ty)) in self.params.iter().enumerate() {
            let comma = if i + 1 < self.params.len() { "," } else { "" };
            let _ = writeln!(out, "\t.param {ty} {name}{comma}");
        }
        let _ = writeln!(out, ")");
        let _ = writeln!(out, "{{");
        let decls: [(&str, &str); CLASSES] = [
            (U32::DECL, U32::PREFIX),
            (S32::DECL, S32::PREFIX),
            (F32::DECL, F32::PREFIX),
            (B32::DECL, B32::PREFIX),
            (U64::DECL, U64::PREFIX),
            (B16::DECL, B16::PREFIX),
            (Pred::DECL, Pred::PREFIX),
        ];
        // The launch guard's two registers come after the body's.
        let mut counters = self.counters;
        counters[U32::CLASS] += 1;
        counters[Pred::CLASS] += 1;
        for ((decl, prefix), &count) in decls.iter().zip(&counters) {
            let _ = writeln!(out, "\t.reg {decl} {prefix}<{count}>;");
        }
        let (ntid, wrong) = (
            format!("{}{}", U32::PREFIX, self.counters[U32::CLASS]),
            format!("{}{}", Pred::PREFIX, self.counters[Pred::CLASS]),
        );
        let _ = writeln!(out, "\tmov.u32 {ntid}, %ntid.x;");
        let _ = writeln!(out, "\tsetp.ne.u32 {wrong}, {ntid}, {};", self.threads);
        let _ = writeln!(out, "\t@{wrong} trap;");
        out.push_str(&self.body);
        out.push_str("}\n");
        out
    }
}

/// A PTX module: header, the dynamic shared-memory symbol, then the kernels.
pub fn module(version: &str, target: &str, shared_symbol: &str, kernels: &[String]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "//\n// Generated by kvcc (kvcc_compiler::back::ptx). Do not edit.\n//"
    );
    let _ = writeln!(out, ".version {version}");
    let _ = writeln!(out, ".target {target}");
    let _ = writeln!(out, ".address_size 64\n");
    // 1024: the 128-byte swizzle of tensor copies repeats every 1024 bytes.
    let _ = writeln!(out, ".extern .shared .align 1024 .b8 {shared_symbol}[];\n");
    for kernel in kernels {
        out.push_str(kernel);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registers_are_typed_and_declared_per_type() {
        let mut k = Kernel::new("k", 64, "smem");
        let n = k.param::<U32>("n");
        let n = k.ld_param(&n);
        let x = k.add(n, 3u32);
        let f = k.u32_to_f32(x);
        let g = k.fma(f, 2.0f32, f);
        let p = k.setp(Cmp::Neu, g, 0.0f32);
        let s = k.selp(g, 1.0f32, p);
        let base = k.shared_base();
        k.st_shared(Shared::at(base).plus(8), s);
        k.ret();
        let text = k.finish();
        assert!(text.contains(".param .u32 n\n"));
        assert!(text.contains(".reg .u32 %r<4>;"));
        assert!(text.contains(".reg .f32 %f<3>;"));
        assert!(text.contains("add.u32 %r1, %r0, 3;"));
        assert!(text.contains("fma.rn.f32 %f1, %f0, 0f40000000, %f0;"));
        assert!(text.contains("setp.neu.f32 %p0, %f1, 0f00000000;"));
        assert!(text.contains("st.shared.f32 [%r2+8], %f2;"));
        assert!(text.contains("setp.ne.u32 %p1, %r3, 64;\n\t@%p1 trap;"));
    }

    #[test]
    fn narrow_loads_and_warp_barrier() {
        let mut k = Kernel::new("k", 32, "smem");
        let base = k.shared_base();
        let byte = k.ld_shared_narrow(Shared::at(base).plus(3), 8);
        let half = k.ld_shared_narrow(Shared::at(base).plus(6), 16);
        let sum = k.add(byte, half);
        k.bar_warp_sync();
        k.st_shared(Shared::at(base), sum);
        let text = k.finish();
        assert!(text.contains("ld.shared.u8 %r1, [%r0+3];"));
        assert!(text.contains("ld.shared.u16 %r2, [%r0+6];"));
        assert!(text.contains("bar.warp.sync 0xffffffff;"));
    }

    #[test]
    fn bit_instructions_keep_their_types() {
        let mut k = Kernel::new("k", 32, "smem");
        let base = k.shared_base();
        let word = k.ld_shared::<U32>(Shared::at(base));
        let field = k.bfe_u32(word, 3u32, 5u32);
        let merged = k.bfi(field, word, 8u32, 5u32);
        let raw: Reg<B32> = k.bitcast(merged);
        let signed = k.bfe_s32(merged, 0u32, 4u32);
        let f = k.s32_to_f32(signed);
        k.st_shared(Shared::at(base).plus(4), raw);
        k.st_shared(Shared::at(base).plus(8), f);
        let text = k.finish();
        assert!(text.contains("bfi.b32 %r3, %r2, %r1, 8, 5;"));
        assert!(text.contains("mov.b32 %b0, %r3;"));
        assert!(text.contains("bfe.s32 %s0, %r3, 0, 4;"));
        assert!(text.contains("st.shared.b32 [%r0+4], %b0;"));
    }

    #[test]
    fn bulk_copies_complete_on_mbarriers() {
        let mut k = Kernel::new("k", 32, "smem");
        let base = k.shared_base();
        let bar = Shared::at(base).plus(8);
        k.mbarrier_init(bar, 1);
        k.fence_mbarrier_init();
        let tid = k.tid_x();
        let src = k.u32_to_u64(tid);
        let bytes = k.shl(tid, 4u32);
        k.fence_proxy_async_shared();
        k.mbarrier_arrive_expect_tx(bar, bytes);
        k.cp_async_bulk(Shared::at(base).plus(32), Global::at(src), bytes, bar);
        let streamed = k.l2_policy(Evict::First);
        let source = Global::at(src).plus(64).cached(streamed);
        k.cp_async_bulk(Shared::at(base).plus(64), source, bytes, bar);
        k.cp_async_bulk_tensor_4d(
            Shared::at(base).plus(1024),
            src,
            [tid, tid, bytes, tid],
            bar,
            streamed,
        );
        let parity = k.and(tid, 1u32);
        k.mbarrier_wait(bar, parity);
        let kept = k.l2_policy(Evict::Last);
        k.ld_global_nc::<U32>(Global::at(src).plus(4).cached(kept));
        let text = k.finish();
        assert!(text.contains("mbarrier.init.shared::cta.b64 [%r0+8], 1;"));
        assert!(text.contains("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r0+8], %r2;"));
        assert!(text.contains(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r0+32], [%rd0], %r2, [%r0+8];"
        ));
        assert!(text.contains("createpolicy.fractional.L2::evict_first.b64 %rd1, 1.0;"));
        assert!(text.contains(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%r0+64], [%rd0+64], %r2, [%r0+8], %rd1;"
        ));
        assert!(text.contains(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%r0+1024], [%rd0, {%r1, %r1, %r2, %r1}], [%r0+8], %rd1;"
        ));
        assert!(text.contains("createpolicy.fractional.L2::evict_last.b64 %rd2, 1.0;"));
        assert!(text.contains("ld.global.nc.L2::cache_hint.u32 %r4, [%rd0+4], %rd2;"));
        // The wait spins on try_wait until the phase completes.
        assert!(text
            .contains("mbarrier.try_wait.parity.shared::cta.b64 %p0, [%r0+8], %r3;\n\t@!%p0 bra"));
    }

    #[test]
    fn guards_prefix_every_instruction_in_their_scope() {
        let mut k = Kernel::new("k", 32, "smem");
        let t = k.tid_x();
        let p = k.setp(Cmp::Lt, t, 4u32);
        k.guarded(p, false, |k| {
            k.add(t, 1u32);
        });
        assert!(k.finish().contains("@!%p0 add.u32 %r1, %r0, 1;"));
    }
}
