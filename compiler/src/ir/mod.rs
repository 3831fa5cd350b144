//! The kvcc IR: one module per tier, consumed by every backend.
//!
//! A module holds four programs. The key codec gives a query **prologue** (a
//! [`Kernel`]: the transform and LUTs, per query head) and a per-item **score**
//! ([`Function`] returning ⟨q, k⟩). The value codec gives a per-item, per-channel
//! **accumulate** (a [`Function`] returning coordinate `channel` of the stored
//! value in the codec's space) and an **epilogue** (a [`Kernel`] mapping the
//! accumulator back to head space). Every size is a compile-time constant.
//!
//! Expressions live in arenas and refer to earlier expressions by [`Handle`], so a
//! function is SSA in arena order. [`crate::valid`] checks a module before any
//! backend may see it.

pub mod builder;
pub mod encode;

use std::fmt;
use std::marker::PhantomData;

use crate::layout::{Side, TierLayout};

/// Index of an item in an [`Arena`].
pub struct Handle<T> {
    index: u32,
    marker: PhantomData<fn() -> T>,
}

impl<T> Handle<T> {
    pub fn index(self) -> usize {
        self.index as usize
    }
    fn new(index: usize) -> Self {
        Handle {
            index: index as u32,
            marker: PhantomData,
        }
    }
}

impl<T> Clone for Handle<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Handle<T> {}
impl<T> PartialEq for Handle<T> {
    fn eq(&self, other: &Self) -> bool {
        self.index == other.index
    }
}
impl<T> Eq for Handle<T> {}
impl<T> std::hash::Hash for Handle<T> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.index.hash(state)
    }
}
impl<T> fmt::Debug for Handle<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.index)
    }
}

/// Append-only storage; handles are indices into it.
#[derive(Debug, Clone)]
pub struct Arena<T> {
    items: Vec<T>,
}

impl<T> Default for Arena<T> {
    fn default() -> Self {
        Arena { items: Vec::new() }
    }
}

impl<T> Arena<T> {
    pub fn append(&mut self, item: T) -> Handle<T> {
        self.items.push(item);
        Handle::new(self.items.len() - 1)
    }
    pub fn len(&self) -> usize {
        self.items.len()
    }
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
    pub fn iter(&self) -> impl Iterator<Item = (Handle<T>, &T)> {
        self.items
            .iter()
            .enumerate()
            .map(|(i, item)| (Handle::new(i), item))
    }
    pub fn try_get(&self, handle: Handle<T>) -> Option<&T> {
        self.items.get(handle.index())
    }
}

impl<T> std::ops::Index<Handle<T>> for Arena<T> {
    type Output = T;
    fn index(&self, handle: Handle<T>) -> &T {
        &self.items[handle.index()]
    }
}

/// Value types. Storage types (f16, bf16, int4, ...) exist only as bits in item
/// streams and are converted explicitly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scalar {
    U32,
    I32,
    F32,
    Bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Literal {
    U32(u32),
    I32(i32),
    F32(f32),
}

impl Literal {
    pub fn scalar(self) -> Scalar {
        match self {
            Literal::U32(_) => Scalar::U32,
            Literal::I32(_) => Scalar::I32,
            Literal::F32(_) => Scalar::F32,
        }
    }
}

/// Values a program receives from the kernel skeleton.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// Accumulate only: the output coordinate being decoded, `0..dims` (u32).
    Channel,
    /// Kernel stages only: the iteration index, `0..iterations` (u32).
    Iteration,
    /// Epilogue only: the softmax denominator Σ exp(s - m) of the partial (f32).
    Denominator,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnaryOp {
    /// f32 or i32 negation.
    Negate,
    /// u32 -> u32 count of set bits.
    Popcount,
    /// Low 16 bits of a u32 as IEEE binary16 -> f32.
    HalfToFloat,
    /// Low 16 bits of a u32 as bfloat16 -> f32.
    BfloatToFloat,
    /// u32 bits reinterpreted as f32.
    BitsToFloat,
    /// Low 8 bits of a u32 as an fp8 number -> f32, exactly
    /// ([`crate::spec::Fp8::decode`]: e4m3 without infinities, NaN kept).
    Fp8ToFloat(crate::spec::Fp8),
    /// u32 or i32 -> nearest f32.
    ToFloat,
    /// Low `n` bits of a u32 as a two's-complement integer -> i32.
    SignExtend(u8),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Subtract,
    Multiply,
    /// u32 quotient (divisor proven non-zero) or f32 division.
    Divide,
    /// u32 remainder (divisor proven non-zero).
    Modulo,
    Min,
    And,
    Or,
    /// u32 shifts; the amount is proven < 32.
    ShiftLeft,
    ShiftRight,
    /// Comparisons give Bool.
    Less,
    Equal,
    NotEqual,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Expr {
    Literal(Literal),
    Input(Input),
    /// `width` (1..=32) bits of the current item of this program's codec stream,
    /// starting at `bit_offset` (u32), LSB-first little-endian, zero-extended.
    ItemBits {
        bit_offset: Handle<Expr>,
        width: u8,
    },
    /// f32 scale slot `slot` (u32) of the current page's header.
    HeaderScale {
        slot: Handle<Expr>,
    },
    /// f32 element of a per-(layer, kv head) table.
    Table {
        table: Handle<TableDecl>,
        index: Handle<Expr>,
    },
    /// f32 element of a per-query-head shared array.
    Shared {
        array: Handle<ArrayDecl>,
        index: Handle<Expr>,
    },
    Unary {
        op: UnaryOp,
        arg: Handle<Expr>,
    },
    Binary {
        op: BinaryOp,
        left: Handle<Expr>,
        right: Handle<Expr>,
    },
    /// f32 a * b + c.
    Fma {
        a: Handle<Expr>,
        b: Handle<Expr>,
        c: Handle<Expr>,
    },
    Select {
        condition: Handle<Expr>,
        accept: Handle<Expr>,
        reject: Handle<Expr>,
    },
}

/// Straight-line SSA program producing one f32.
#[derive(Debug, Clone, Default)]
pub struct Function {
    pub exprs: Arena<Expr>,
    pub result: Option<Handle<Expr>>,
}

/// `array[index] = value` (f32), at the end of a stage iteration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Store {
    pub array: Handle<ArrayDecl>,
    pub index: Handle<Expr>,
    pub value: Handle<Expr>,
}

/// A parallel loop: iterations are independent (no iteration reads an array the
/// stage writes), so a backend may run them in any order or across threads. A
/// barrier separates consecutive stages.
#[derive(Debug, Clone, Default)]
pub struct Stage {
    pub iterations: u32,
    pub exprs: Arena<Expr>,
    pub stores: Vec<Store>,
}

#[derive(Debug, Clone, Default)]
pub struct Kernel {
    pub stages: Vec<Stage>,
}

/// A per-(layer, kv head) f32 table (codebook, basis, ...), `len` elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableDecl {
    pub name: String,
    pub len: u32,
}

/// A per-query-head f32 array in shared memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayDecl {
    pub name: String,
    pub len: u32,
}

/// Key side: prologue over the query, score per item.
#[derive(Debug, Clone)]
pub struct KeyProgram {
    /// Runs once per query head; reads `Module::query`, writes arrays `score` reads.
    pub prologue: Kernel,
    /// Per item: ⟨q, k⟩ (not yet multiplied by the softmax scale).
    pub score: Function,
}

/// Value side: accumulate per item and channel, epilogue per partial.
#[derive(Debug, Clone)]
pub struct ValueProgram {
    /// Coordinates the accumulator holds (PCA rank or head_dim).
    pub dims: u32,
    /// Per item and `Input::Channel` c: coordinate c of the stored value.
    pub accumulate: Function,
    /// Reads `accumulator` (Σ p_i v'_i, unnormalized) and `Input::Denominator`,
    /// writes `output` (head_dim values, still unnormalized).
    pub epilogue: Kernel,
    pub accumulator: Handle<ArrayDecl>,
    pub output: Handle<ArrayDecl>,
}

/// The IR of one tier.
#[derive(Debug, Clone)]
pub struct Module {
    pub format: String,
    pub tier: String,
    pub head_dim: u32,
    /// Bit and byte positions the programs were lowered against.
    pub layout: TierLayout,
    pub tables: Arena<TableDecl>,
    pub arrays: Arena<ArrayDecl>,
    /// The query (head_dim values), written by the skeleton before the prologue.
    pub query: Handle<ArrayDecl>,
    pub key: KeyProgram,
    pub value: ValueProgram,
}

impl Module {
    /// Payload bits per item of the stream a side's programs read.
    pub fn stream_bits(&self, side: Side) -> u32 {
        self.layout.codec(side).bits
    }
}
