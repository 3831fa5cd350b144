//! A typed PTX builder: virtual registers carry their PTX type in the Rust type,
//! so an `add.rn.f32` on a u32 register, a shared load through a 64-bit global
//! address or a `selp` on predicates does not compile. The builder emits text;
//! ptxas allocates the real registers.
//!
//! One [`Kernel`] builds one `.entry`; [`module`] wraps kernels into a PTX module
//! for a [`Target`](super::Target).

use std::fmt::Write;
use std::marker::PhantomData;

/// A PTX register type: how its registers are declared and named.
pub trait Type: Copy + 'static {
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

impl Arith for U32 {
    const SUFFIX: &'static str = "u32";
    const ADD: &'static str = "u32";
    const MUL: &'static str = "lo.u32";
}
impl Arith for S32 {
    const SUFFIX: &'static str = "s32";
    const ADD: &'static str = "s32";
    const MUL: &'static str = "lo.s32";
}
impl Arith for F32 {
    const SUFFIX: &'static str = "f32";
    const ADD: &'static str = "rn.f32";
    const MUL: &'static str = "rn.f32";
}
impl Arith for U64 {
    const SUFFIX: &'static str = "u64";
    const ADD: &'static str = "u64";
    const MUL: &'static str = "lo.u64";
}
impl Bits32 for U32 {
    const SUFFIX: &'static str = "u32";
}
impl Bits32 for S32 {
    const SUFFIX: &'static str = "s32";
}
impl Bits32 for F32 {
    const SUFFIX: &'static str = "f32";
}
impl Bits32 for B32 {
    const SUFFIX: &'static str = "b32";
}

/// A virtual register of type `T`.
pub struct Reg<T> {
    id: u32,
    marker: PhantomData<T>,
}

impl<T> Clone for Reg<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Reg<T> {}
impl<T> PartialEq for Reg<T> {
    fn eq(&self, other: &Self) -> bool {
        self.id == other.id
    }
}
impl<T> Eq for Reg<T> {}
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
impl From<u32> for Op<U32> {
    fn from(v: u32) -> Self {
        Op::Imm(v)
    }
}
impl From<i32> for Op<S32> {
    fn from(v: i32) -> Self {
        Op::Imm(v)
    }
}
impl From<f32> for Op<F32> {
    fn from(v: f32) -> Self {
        Op::Imm(v)
    }
}
impl From<u64> for Op<U64> {
    fn from(v: u64) -> Self {
        Op::Imm(v)
    }
}

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

    /// A comment line in the output, to keep the PTX reviewable.
    pub fn comment(&mut self, text: &str) {
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

    // ---- moves and arithmetic ----------------------------------------------

    pub fn mov<T: Type>(&mut self, src: impl Into<Op<T>>) -> Reg<T> {
        let d = self.reg();
        self.assign(d, src);
        d
    }
    /// `dst = src` for a register updated in a loop.
    pub fn assign<T: Type>(&mut self, dst: Reg<T>, src: impl Into<Op<T>>) {
        let src = src.into();
        self.line(format_args!("mov{} {dst}, {src}", T::DECL));
    }
    pub fn add<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        let d = self.reg();
        self.add_to(d, a, b);
        d
    }
    /// `dst = a + b` into an existing register (loop counters).
    pub fn add_to<T: Arith>(&mut self, dst: Reg<T>, a: impl Into<Op<T>>, b: impl Into<Op<T>>) {
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("add.{} {dst}, {a}, {b}", T::ADD));
    }
    pub fn sub<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("sub.{} {d}, {a}, {b}", T::ADD));
        d
    }
    /// Low half of the product (wrapping) for integers, rounded for floats.
    pub fn mul<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("mul.{} {d}, {a}, {b}", T::MUL));
        d
    }
    /// `dst = a * b` into an existing register.
    pub fn mul_to<T: Arith>(&mut self, dst: Reg<T>, a: impl Into<Op<T>>, b: impl Into<Op<T>>) {
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("mul.{} {dst}, {a}, {b}", T::MUL));
    }
    pub fn min<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("min.{} {d}, {a}, {b}", T::SUFFIX));
        d
    }
    pub fn max<T: Arith>(&mut self, a: impl Into<Op<T>>, b: impl Into<Op<T>>) -> Reg<T> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("max.{} {d}, {a}, {b}", T::SUFFIX));
        d
    }
    /// `a * b + c` on u32, wrapping.
    pub fn mad_lo(
        &mut self,
        a: impl Into<Op<U32>>,
        b: impl Into<Op<U32>>,
        c: impl Into<Op<U32>>,
    ) -> Reg<U32> {
        let d = self.reg();
        let (a, b, c) = (a.into(), b.into(), c.into());
        self.line(format_args!("mad.lo.u32 {d}, {a}, {b}, {c}"));
        d
    }
    /// `c` plus the products of the unsigned bytes of `a` and `b`, byte by
    /// byte (`dp4a.u32.u32`): with `b` one nonzero byte, a byte of `a`
    /// scaled and offset in one instruction.
    pub fn dp4a(&mut self, a: Reg<U32>, b: impl Into<Op<U32>>, c: impl Into<Op<U32>>) -> Reg<U32> {
        let d = self.reg();
        let (b, c) = (b.into(), c.into());
        self.line(format_args!("dp4a.u32.u32 {d}, {a}, {b}, {c}"));
        d
    }
    /// Full 64-bit product of two u32.
    pub fn mul_wide(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U64> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("mul.wide.u32 {d}, {a}, {b}"));
        d
    }
    /// Fused `a * b + c`, rounded once (the IR's `Fma`).
    pub fn fma(
        &mut self,
        a: impl Into<Op<F32>>,
        b: impl Into<Op<F32>>,
        c: impl Into<Op<F32>>,
    ) -> Reg<F32> {
        let d = self.reg();
        self.fma_to(d, a, b, c);
        d
    }
    /// Fused `dst = a * b + c` into an existing register (accumulators).
    pub fn fma_to(
        &mut self,
        dst: Reg<F32>,
        a: impl Into<Op<F32>>,
        b: impl Into<Op<F32>>,
        c: impl Into<Op<F32>>,
    ) {
        let (a, b, c) = (a.into(), b.into(), c.into());
        self.line(format_args!("fma.rn.f32 {dst}, {a}, {b}, {c}"));
    }
    /// IEEE division, correctly rounded.
    pub fn div_f32(&mut self, a: impl Into<Op<F32>>, b: impl Into<Op<F32>>) -> Reg<F32> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("div.rn.f32 {d}, {a}, {b}"));
        d
    }
    /// Division by a power-of-two immediate is a shift: ptxas emits its
    /// generic reciprocal sequence (~8 instructions) for `div.u32 x, 8`.
    pub fn div_u32(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        let (a, b) = (a.into(), b.into());
        if let Op::Imm(n) = b {
            if n.is_power_of_two() {
                return self.shr(a, n.trailing_zeros());
            }
        }
        let d = self.reg();
        self.line(format_args!("div.u32 {d}, {a}, {b}"));
        d
    }
    /// Remainder by a power-of-two immediate is a mask (see [`Self::div_u32`]).
    pub fn rem_u32(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        let (a, b) = (a.into(), b.into());
        if let Op::Imm(n) = b {
            if n.is_power_of_two() {
                return self.and(a, n - 1);
            }
        }
        let d = self.reg();
        self.line(format_args!("rem.u32 {d}, {a}, {b}"));
        d
    }
    pub fn abs_f32(&mut self, a: Reg<F32>) -> Reg<F32> {
        let d = self.reg();
        self.line(format_args!("abs.f32 {d}, {a}"));
        d
    }
    pub fn neg_f32(&mut self, a: Reg<F32>) -> Reg<F32> {
        let d = self.reg();
        self.line(format_args!("neg.f32 {d}, {a}"));
        d
    }
    /// Two's-complement negation (wrapping).
    pub fn neg_s32(&mut self, a: Reg<S32>) -> Reg<S32> {
        let d = self.reg();
        self.line(format_args!("neg.s32 {d}, {a}"));
        d
    }
    /// 2^a, approximate (flushes subnormal results to zero).
    pub fn ex2(&mut self, a: Reg<F32>) -> Reg<F32> {
        let d = self.reg();
        self.line(format_args!("ex2.approx.ftz.f32 {d}, {a}"));
        d
    }
    /// exp(a − b) as 2^((a − b)·log2 e): relative error about 2^-21 for the
    /// exponents of a softmax, and exp(−∞) = 0.
    pub fn exp_diff(&mut self, a: Reg<F32>, b: Reg<F32>) -> Reg<F32> {
        let d = self.sub(a, b);
        let x = self.mul(d, std::f32::consts::LOG2_E);
        self.ex2(x)
    }

    // ---- bits ---------------------------------------------------------------

    pub fn and(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("and.b32 {d}, {a}, {b}"));
        d
    }
    pub fn or(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("or.b32 {d}, {a}, {b}"));
        d
    }
    pub fn xor(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("xor.b32 {d}, {a}, {b}"));
        d
    }
    /// `a << b`; amounts of 32 or more give 0.
    pub fn shl(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("shl.b32 {d}, {a}, {b}"));
        d
    }
    /// Logical `a >> b`.
    pub fn shr(&mut self, a: impl Into<Op<U32>>, b: impl Into<Op<U32>>) -> Reg<U32> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("shr.u32 {d}, {a}, {b}"));
        d
    }
    /// Low 32 bits of the 64-bit `hi:lo` shifted right by `shift & 31`.
    pub fn shf_r_wrap(
        &mut self,
        lo: Reg<U32>,
        hi: Reg<U32>,
        shift: impl Into<Op<U32>>,
    ) -> Reg<U32> {
        let d = self.reg();
        let shift = shift.into();
        self.line(format_args!("shf.r.wrap.b32 {d}, {lo}, {hi}, {shift}"));
        d
    }
    /// `len` bits of `a` from bit `pos`, zero-extended.
    pub fn bfe_u32(
        &mut self,
        a: Reg<U32>,
        pos: impl Into<Op<U32>>,
        len: impl Into<Op<U32>>,
    ) -> Reg<U32> {
        let d = self.reg();
        let (pos, len) = (pos.into(), len.into());
        self.line(format_args!("bfe.u32 {d}, {a}, {pos}, {len}"));
        d
    }
    /// `len` bits of `a` from bit `pos` as a two's-complement integer.
    pub fn bfe_s32(
        &mut self,
        a: Reg<U32>,
        pos: impl Into<Op<U32>>,
        len: impl Into<Op<U32>>,
    ) -> Reg<S32> {
        let d = self.reg();
        let (pos, len) = (pos.into(), len.into());
        self.line(format_args!("bfe.s32 {d}, {a}, {pos}, {len}"));
        d
    }
    /// `base` with `len` bits from bit `pos` replaced by the low bits of `field`.
    pub fn bfi(
        &mut self,
        field: Reg<U32>,
        base: Reg<U32>,
        pos: impl Into<Op<U32>>,
        len: impl Into<Op<U32>>,
    ) -> Reg<U32> {
        let d = self.reg();
        let (pos, len) = (pos.into(), len.into());
        self.line(format_args!("bfi.b32 {d}, {field}, {base}, {pos}, {len}"));
        d
    }
    pub fn popc(&mut self, a: Reg<U32>) -> Reg<U32> {
        let d = self.reg();
        self.line(format_args!("popc.b32 {d}, {a}"));
        d
    }
    /// The bits of `a` in reverse order.
    pub fn brev(&mut self, a: Reg<U32>) -> Reg<U32> {
        let d = self.reg();
        self.line(format_args!("brev.b32 {d}, {a}"));
        d
    }
    /// Leading zeros of a nonzero `a` (`bfind.shiftamt`: one SASS `FLO.SH`,
    /// where `clz` adds a subtraction).
    pub fn leading_zeros(&mut self, a: Reg<U32>) -> Reg<U32> {
        let d = self.reg();
        self.line(format_args!("bfind.shiftamt.u32 {d}, {a}"));
        d
    }

    // ---- conversions --------------------------------------------------------

    /// Low 16 bits.
    pub fn low16(&mut self, a: Reg<U32>) -> Reg<B16> {
        let d = self.reg();
        self.line(format_args!("cvt.u16.u32 {d}, {a}"));
        d
    }
    /// The low and high 16 bits of `a`.
    pub fn split_halves(&mut self, a: Reg<U32>) -> (Reg<B16>, Reg<B16>) {
        let (lo, hi) = (self.reg(), self.reg());
        self.line(format_args!("mov.b32 {{{lo}, {hi}}}, {a}"));
        (lo, hi)
    }
    /// IEEE binary16 bits to f32 (exact).
    pub fn f16_to_f32(&mut self, a: Reg<B16>) -> Reg<F32> {
        let d = self.reg();
        self.line(format_args!("cvt.f32.f16 {d}, {a}"));
        d
    }
    pub fn u32_to_f32(&mut self, a: Reg<U32>) -> Reg<F32> {
        let d = self.reg();
        self.line(format_args!("cvt.rn.f32.u32 {d}, {a}"));
        d
    }
    /// The nearest integer (ties to even).
    pub fn f32_to_s32(&mut self, a: Reg<F32>) -> Reg<S32> {
        let d = self.reg();
        self.line(format_args!("cvt.rni.s32.f32 {d}, {a}"));
        d
    }
    pub fn s32_to_f32(&mut self, a: Reg<S32>) -> Reg<F32> {
        let d = self.reg();
        self.line(format_args!("cvt.rn.f32.s32 {d}, {a}"));
        d
    }
    pub fn u32_to_u64(&mut self, a: Reg<U32>) -> Reg<U64> {
        let d = self.reg();
        self.line(format_args!("cvt.u64.u32 {d}, {a}"));
        d
    }
    /// Reinterprets 32 bits as another 32-bit type.
    pub fn bitcast<A: Bits32, B: Bits32>(&mut self, a: Reg<A>) -> Reg<B> {
        let d = self.reg();
        self.line(format_args!("mov.b32 {d}, {a}"));
        d
    }

    // ---- comparisons and selection -----------------------------------------

    pub fn setp<T: Arith>(
        &mut self,
        cmp: Cmp,
        a: impl Into<Op<T>>,
        b: impl Into<Op<T>>,
    ) -> Reg<Pred> {
        debug_assert!(cmp != Cmp::Neu || T::SUFFIX == "f32", "neu compares floats");
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!(
            "setp.{}.{} {d}, {a}, {b}",
            cmp.name(),
            T::SUFFIX
        ));
        d
    }
    /// `p ? a : b`.
    pub fn selp<T: Bits32>(
        &mut self,
        a: impl Into<Op<T>>,
        b: impl Into<Op<T>>,
        p: Reg<Pred>,
    ) -> Reg<T> {
        let d = self.reg();
        let (a, b) = (a.into(), b.into());
        self.line(format_args!("selp.{} {d}, {a}, {b}, {p}", T::SUFFIX));
        d
    }
    pub fn and_pred(&mut self, a: Reg<Pred>, b: Reg<Pred>) -> Reg<Pred> {
        let d = self.reg();
        self.line(format_args!("and.pred {d}, {a}, {b}"));
        d
    }
    pub fn or_pred(&mut self, a: Reg<Pred>, b: Reg<Pred>) -> Reg<Pred> {
        let d = self.reg();
        self.line(format_args!("or.pred {d}, {a}, {b}"));
        d
    }
    pub fn not_pred(&mut self, a: Reg<Pred>) -> Reg<Pred> {
        let d = self.reg();
        self.line(format_args!("not.pred {d}, {a}"));
        d
    }

    // ---- packed halves and tensor cores -------------------------------------

    /// Bytes of `a:b` picked by `selector` (`prmt.b32`: nibble `i` names the
    /// source byte 0..7 of result byte `i`).
    pub fn prmt(&mut self, a: Reg<U32>, b: Reg<U32>, selector: u32) -> Reg<U32> {
        let d = self.reg();
        self.line(format_args!("prmt.b32 {d}, {a}, {b}, 0x{selector:04X}"));
        d
    }
    /// [`Self::prmt`] with the selector in a register.
    pub fn prmt_by(&mut self, a: Reg<U32>, b: Reg<U32>, selector: Reg<U32>) -> Reg<U32> {
        let d = self.reg();
        self.line(format_args!("prmt.b32 {d}, {a}, {b}, {selector}"));
        d
    }
    /// Any function of three words bit by bit (`lop3.b32`; `lut` is the truth
    /// table over the operands' bit patterns 0xF0, 0xCC, 0xAA).
    pub fn lop3(
        &mut self,
        a: Reg<U32>,
        b: impl Into<Op<U32>>,
        c: impl Into<Op<U32>>,
        lut: u8,
    ) -> Reg<U32> {
        let d = self.reg();
        let (b, c) = (b.into(), c.into());
        self.line(format_args!("lop3.b32 {d}, {a}, {b}, {c}, 0x{lut:02X}"));
        d
    }
    /// Lane-wise `a - b` of two f16 pairs (round to nearest; exact on the
    /// small integers it is used for).
    pub fn sub_f16x2(&mut self, a: Reg<U32>, b: Reg<U32>) -> Reg<U32> {
        // f16x2 operands must be .b32 registers.
        let (a, b) = (self.bitcast::<U32, B32>(a), self.bitcast::<U32, B32>(b));
        let d = self.reg::<B32>();
        self.line(format_args!("sub.rn.f16x2 {d}, {a}, {b}"));
        self.bitcast(d)
    }
    /// Lane-wise `a · b + c` of f16 pairs, rounded once.
    pub fn fma_f16x2(&mut self, a: Reg<U32>, b: Reg<U32>, c: Reg<U32>) -> Reg<U32> {
        let [a, b, c] = [a, b, c].map(|r| self.bitcast::<U32, B32>(r));
        let d = self.reg::<B32>();
        self.line(format_args!("fma.rn.f16x2 {d}, {a}, {b}, {c}"));
        self.bitcast(d)
    }
    /// Two f32 rounded to f16 and packed: `low` in bits 0..16, `high` above.
    pub fn pack_f16x2(&mut self, low: Reg<F32>, high: Reg<F32>) -> Reg<U32> {
        // The f16x2 destination must be a .b32 register.
        let d = self.reg::<B32>();
        self.line(format_args!("cvt.rn.f16x2.f32 {d}, {high}, {low}"));
        self.bitcast(d)
    }
    /// `acc += a · b` on the tensor cores: a 16×16 f16 tile (`a`, row-major
    /// fragment) times a 16×8 f16 tile (`b`, column-major fragment) into a
    /// 16×8 f32 tile, every lane holding its fragment registers.
    pub fn mma_f16_f32(&mut self, acc: [Reg<F32>; 4], a: [Reg<U32>; 4], b: [Reg<U32>; 2]) {
        let [c0, c1, c2, c3] = acc;
        // f16x2 operands must be .b32 registers.
        let [a0, a1, a2, a3] = a.map(|r| self.bitcast::<U32, B32>(r));
        let [b0, b1] = b.map(|r| self.bitcast::<U32, B32>(r));
        self.line(format_args!(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{{c0}, {c1}, {c2}, {c3}}}, \
             {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}}"
        ));
    }

    /// `acc += a · b` on the tensor cores: `m16n8k32`, four 8-bit integers
    /// per register (A two's complement when `signed_a`, else unsigned; B
    /// two's complement), exact s32 sums.
    pub fn mma_i8_s32(
        &mut self,
        acc: [Reg<S32>; 4],
        a: [Reg<U32>; 4],
        b: [Reg<U32>; 2],
        signed_a: bool,
    ) {
        let [c0, c1, c2, c3] = acc;
        let [a0, a1, a2, a3] = a.map(|r| self.bitcast::<U32, B32>(r));
        let [b0, b1] = b.map(|r| self.bitcast::<U32, B32>(r));
        let a_type = if signed_a { "s8" } else { "u8" };
        self.line(format_args!(
            "mma.sync.aligned.m16n8k32.row.col.s32.{a_type}.s8.s32 {{{c0}, {c1}, {c2}, {c3}}}, \
             {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}}"
        ));
    }

    // ---- warp ---------------------------------------------------------------

    /// The value of lane `lane ^ mask` (all 32 lanes take part).
    pub fn shfl_bfly<T: Bits32>(&mut self, a: Reg<T>, mask: u32) -> Reg<T> {
        debug_assert!(mask < 32);
        let d = self.reg();
        self.line(format_args!(
            "shfl.sync.bfly.b32 {d}, {a}, {mask}, 31, 0xffffffff"
        ));
        d
    }

    /// The value of lane `lane` (all 32 lanes take part).
    pub fn shfl_idx<T: Bits32>(&mut self, a: Reg<T>, lane: Reg<U32>) -> Reg<T> {
        let d = self.reg();
        self.line(format_args!(
            "shfl.sync.idx.b32 {d}, {a}, {lane}, 31, 0xffffffff"
        ));
        d
    }

    /// Whether `p` holds in any lane of the warp (all 32 lanes take part).
    pub fn vote_any(&mut self, p: Reg<Pred>) -> Reg<Pred> {
        let d = self.reg();
        self.line(format_args!("vote.sync.any.pred {d}, {p}, 0xffffffff"));
        d
    }

    // ---- memory -------------------------------------------------------------

    pub fn ld_shared<T: Bits32>(&mut self, at: Shared) -> Reg<T> {
        let d = self.reg();
        self.line(format_args!("ld.shared.{} {d}, {at}", T::SUFFIX));
        d
    }
    /// Into `dst` (under a guard, a load that leaves `dst` as it was when the
    /// guard fails).
    pub fn ld_shared_to<T: Bits32>(&mut self, dst: Reg<T>, at: Shared) {
        self.line(format_args!("ld.shared.{} {dst}, {at}", T::SUFFIX));
    }
    /// One byte (`bits` 8) or an aligned halfword (`bits` 16), zero-extended.
    pub fn ld_shared_narrow(&mut self, at: Shared, bits: u32) -> Reg<U32> {
        debug_assert!(bits == 8 || bits == 16);
        let d = self.reg();
        self.line(format_args!("ld.shared.u{bits} {d}, {at}"));
        d
    }
    /// 8 bytes; `at` must be 8-byte aligned.
    pub fn ld_shared_v2<T: Bits32>(&mut self, at: Shared) -> [Reg<T>; 2] {
        let d = [self.reg(), self.reg()];
        self.line(format_args!(
            "ld.shared.v2.{} {{{}, {}}}, {at}",
            T::SUFFIX,
            d[0],
            d[1]
        ));
        d
    }
    /// 16 bytes; `at` must be 16-byte aligned.
    pub fn ld_shared_v4<T: Bits32>(&mut self, at: Shared) -> [Reg<T>; 4] {
        let d = [self.reg(), self.reg(), self.reg(), self.reg()];
        self.line(format_args!(
            "ld.shared.v4.{} {{{}, {}, {}, {}}}, {at}",
            T::SUFFIX,
            d[0],
            d[1],
            d[2],
            d[3]
        ));
        d
    }
    pub fn st_shared<T: Bits32>(&mut self, at: Shared, value: impl Into<Op<T>>) {
        let value = value.into();
        self.line(format_args!("st.shared.{} {at}, {value}", T::SUFFIX));
    }
    /// The low 8 or 16 bits of `value`.
    pub fn st_shared_narrow(&mut self, at: Shared, value: Reg<U32>, bits: u32) {
        debug_assert!(bits == 8 || bits == 16);
        self.line(format_args!("st.shared.u{bits} {at}, {value}"));
    }
    /// 16 bytes; `at` must be 16-byte aligned.
    pub fn st_shared_v4<T: Bits32>(&mut self, at: Shared, values: [Reg<T>; 4]) {
        self.line(format_args!(
            "st.shared.v4.{} {at}, {{{}, {}, {}, {}}}",
            T::SUFFIX,
            values[0],
            values[1],
            values[2],
            values[3]
        ));
    }
    /// Atomic `*at = max(*at, value)` in shared memory, no result.
    pub fn red_shared_max(&mut self, at: Shared, value: Reg<U32>) {
        self.line(format_args!("red.shared.max.u32 {at}, {value}"));
    }
    /// An L2 cache policy for every line an access touches (sm_80+).
    pub fn l2_policy(&mut self, evict: Evict) -> Reg<U64> {
        let d = self.reg();
        let priority = match evict {
            Evict::First => "evict_first",
            Evict::Last => "evict_last",
        };
        self.line(format_args!(
            "createpolicy.fractional.L2::{priority}.b64 {d}, 1.0"
        ));
        d
    }
    /// Read-only, non-coherent global load (tables, page lists, queries).
    pub fn ld_global_nc<T: Bits32>(&mut self, at: Global) -> Reg<T> {
        let d = self.reg();
        self.ld_global_nc_to(d, at);
        d
    }
    /// [`Self::ld_global_nc`] into `dst`, a register updated in a loop: the
    /// load's latency is hidden until `dst` is next read.
    pub fn ld_global_nc_to<T: Bits32>(&mut self, dst: Reg<T>, at: Global) {
        let (hint, policy) = at.hint();
        self.line(format_args!(
            "ld.global.nc{hint}.{} {dst}, {at}{policy}",
            T::SUFFIX
        ));
    }
    /// 16 bytes, read-only; `at` must be 16-byte aligned.
    pub fn ld_global_nc_v4<T: Bits32>(&mut self, at: Global) -> [Reg<T>; 4] {
        let d = [self.reg(), self.reg(), self.reg(), self.reg()];
        let (hint, policy) = at.hint();
        self.line(format_args!(
            "ld.global.nc{hint}.v4.{} {{{}, {}, {}, {}}}, {at}{policy}",
            T::SUFFIX,
            d[0],
            d[1],
            d[2],
            d[3]
        ));
        d
    }
    pub fn st_global<T: Bits32>(&mut self, at: Global, value: impl Into<Op<T>>) {
        let value = value.into();
        self.line(format_args!("st.global.{} {at}, {value}", T::SUFFIX));
    }
    /// Asynchronous 16-byte copy global -> shared (sm_80+), bypassing L1; both
    /// addresses 16-byte aligned. Completes with [`cp_async_wait`](Self::cp_async_wait).
    /// The L2 fetches whole 128-byte lines: on an H200 that took dense f16
    /// decode from 0.2935 to 0.2830 ms (256-byte lines: 0.3070; kivi unchanged).
    pub fn cp_async_16(&mut self, dst: Shared, src: Global) {
        let (hint, policy) = src.hint();
        self.line(format_args!(
            "cp.async.cg.shared.global{hint}.L2::128B {dst}, {src}, 16{policy}"
        ));
    }
    /// Closes the current group of `cp.async` copies (an empty group is fine).
    pub fn cp_async_commit(&mut self) {
        self.line(format_args!("cp.async.commit_group"));
    }
    /// Waits until at most `pending` of this thread's groups are in flight.
    pub fn cp_async_wait(&mut self, pending: u32) {
        self.line(format_args!("cp.async.wait_group {pending}"));
    }

    // ---- bulk copies and their mbarriers (sm_90) ----------------------------

    /// Readies the 8-byte-aligned mbarrier at `at` for `arrivals` arrivals
    /// per phase.
    pub fn mbarrier_init(&mut self, at: Shared, arrivals: u32) {
        self.line(format_args!(
            "mbarrier.init.shared::cta.b64 {at}, {arrivals}"
        ));
    }
    /// Makes this thread's mbarrier inits visible to the bulk-copy engine
    /// (a `bar.sync` then shows them to the other threads).
    pub fn fence_mbarrier_init(&mut self) {
        self.line(format_args!("fence.mbarrier_init.release.cluster"));
    }
    /// Orders this thread's (and, after a barrier, the CTA's) shared-memory
    /// accesses before the bulk copies it issues next.
    pub fn fence_proxy_async_shared(&mut self) {
        self.line(format_args!("fence.proxy.async.shared::cta"));
    }
    /// Arrives on the mbarrier at `at`, whose phase then also waits for
    /// `bytes` bytes of bulk copies.
    pub fn mbarrier_arrive_expect_tx(&mut self, at: Shared, bytes: impl Into<Op<U32>>) {
        let bytes = bytes.into();
        self.line(format_args!(
            "mbarrier.arrive.expect_tx.shared::cta.b64 _, {at}, {bytes}"
        ));
    }
    /// Bulk copy of `bytes` (a multiple of 16; both addresses 16-byte
    /// aligned) global -> shared by the tensor memory accelerator; completes
    /// its bytes on the mbarrier at `barrier`.
    pub fn cp_async_bulk(
        &mut self,
        dst: Shared,
        src: Global,
        bytes: impl Into<Op<U32>>,
        barrier: Shared,
    ) {
        let bytes = bytes.into();
        let (hint, policy) = src.hint();
        self.line(format_args!(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes{hint} {dst}, {src}, {bytes}, {barrier}{policy}"
        ));
    }
    /// Tensor copy of the box at `coords` (innermost first) of the 4-d tensor
    /// map at generic address `map` global -> shared (`dst` aligned as the
    /// map's swizzle needs), its lines under L2 policy `policy`; completes its
    /// bytes on the mbarrier at `barrier`.
    pub fn cp_async_bulk_tensor_4d(
        &mut self,
        dst: Shared,
        map: Reg<U64>,
        coords: [Reg<U32>; 4],
        barrier: Shared,
        policy: Reg<U64>,
    ) {
        let [c0, c1, c2, c3] = coords;
        self.line(format_args!(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint {dst}, [{map}, {{{c0}, {c1}, {c2}, {c3}}}], {barrier}, {policy}"
        ));
    }
    /// Waits until the phase of parity `parity` (0 or 1) of the mbarrier at
    /// `at` has completed.
    pub fn mbarrier_wait(&mut self, at: Shared, parity: Reg<U32>) {
        let top = self.label();
        self.place(top);
        let done: Reg<Pred> = self.reg();
        self.line(format_args!(
            "mbarrier.try_wait.parity.shared::cta.b64 {done}, {at}, {parity}"
        ));
        self.bra_if(done, false, top);
    }

    /// Address arithmetic: `base + index * scale` in the global space.
    pub fn global_index(&mut self, base: Reg<U64>, index: Reg<U32>, scale: u32) -> Reg<U64> {
        let offset = if scale == 1 {
            self.u32_to_u64(index)
        } else {
            self.mul_wide(index, scale)
        };
        self.add(base, offset)
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
