//! What every phase of the decode kernel reads: the tier's module and plan,
//! the kernel's parameters, the registers set once at entry (thread index,
//! query group, shared-memory base), and the loops the phases share.

use std::collections::HashSet;

use super::super::abi::{ParamType, TableBuffer, DECODE_PARAMS};
use super::super::builder::{
    Axis, Cmp, Evict, Global, Kernel, Op, Param, Pred, Reg, Type, F32, U32, U64,
};
use super::super::expr::TableAccess;
use super::super::plan::Plan;
use crate::ir::{ArrayDecl, Handle, Module};
use crate::valid::ModuleInfo;

/// The kernel's parameters, in [`DECODE_PARAMS`] order.
pub(super) struct Params {
    /// The page pool, and per (sequence, kv head) row its range of entries
    /// in the page list `page_ids`.
    pub(super) pool: Param<U64>,
    pub(super) page_offsets: Param<U64>,
    pub(super) page_ids: Param<U64>,
    /// Per kv head, the tier's tables ([`TableBuffer`]).
    pub(super) tables: Param<U64>,
    pub(super) queries: Param<U64>,
    /// The split's partial records, slot `slot_base + split` of `slot_count`.
    pub(super) partials: Param<U64>,
    /// Query and kv heads per sequence: their ratio is the group.
    pub(super) q_heads: Param<U32>,
    pub(super) kv_heads: Param<U32>,
    /// Splits of each row's pages (the grid's x).
    pub(super) splits: Param<U32>,
    pub(super) slot_base: Param<U32>,
    pub(super) slot_count: Param<U32>,
    pub(super) softmax_scale: Param<F32>,
    /// The streams' tensor maps (sm_90 tensor copies).
    pub(super) tensor_maps: Param<U64>,
}

/// Declares the parameters in [`DECODE_PARAMS`] order, checking their types.
pub(super) fn declare(k: &mut Kernel) -> Params {
    let mut next = DECODE_PARAMS.iter();
    let mut take = |ty: ParamType, decl: &str| {
        let p = next.next().expect("DECODE_PARAMS lists every parameter");
        assert_eq!((p.ty, p.ty.ptx()), (ty, decl), "parameter {}", p.name);
        p.name
    };
    let [pool, page_offsets, page_ids, tables, queries, partials] =
        std::array::from_fn(|_| k.param::<U64>(take(ParamType::Pointer, U64::DECL)));
    let [q_heads, kv_heads, splits, slot_base, slot_count] =
        std::array::from_fn(|_| k.param::<U32>(take(ParamType::U32, U32::DECL)));
    let softmax_scale = k.param::<F32>(take(ParamType::F32, F32::DECL));
    let tensor_maps = k.param::<U64>(take(ParamType::Pointer, U64::DECL));
    Params {
        pool,
        page_offsets,
        page_ids,
        tables,
        queries,
        partials,
        q_heads,
        kv_heads,
        splits,
        slot_base,
        slot_count,
        softmax_scale,
        tensor_maps,
    }
}

/// The CTA's kernel-wide state. Values only the prologue or the end need
/// are recomputed there from the parameters (constant-bank reads), so they
/// do not occupy registers through the page loop.
#[derive(Clone, Copy)]
pub(super) struct Cta<'a> {
    pub(super) m: &'a Module,
    pub(super) info: &'a ModuleInfo,
    pub(super) plan: &'a Plan,
    pub(super) p: &'a Params,
    pub(super) tid: Reg<U32>,
    /// Query heads per kv head of this launch.
    pub(super) group: Reg<U32>,
    /// Score head blocks holding at least one of the group's heads.
    pub(super) score_blocks: Reg<U32>,
    pub(super) smem: Reg<U32>,
}

impl<'a> Cta<'a> {
    /// `sequence * q_heads + kv_head * group`: the row of the group's first query head.
    pub(super) fn q_row(&self, k: &mut Kernel) -> Reg<U32> {
        let sequence = k.ctaid(Axis::Z);
        let kv_head = k.ctaid(Axis::Y);
        let q_heads = k.ld_param(&self.p.q_heads);
        let head0 = k.mul(kv_head, self.group);
        k.mad_lo(sequence, q_heads, head0)
    }

    /// Global address of this kv head's tables.
    pub(super) fn tables(&self, k: &mut Kernel) -> Reg<U64> {
        let tables = k.ld_pointer(&self.p.tables);
        let kv_head = k.ctaid(Axis::Y);
        k.global_index(tables, kv_head, 4 * TableBuffer::of(self.m).stride)
    }

    /// `for i in start.. count step threads { body(i) }` (no barrier inside).
    pub(super) fn strided(
        &self,
        k: &mut Kernel,
        start: Reg<U32>,
        count: Op<U32>,
        step: u32,
        body: impl FnMut(&mut Kernel, Reg<U32>),
    ) {
        k.counted(start, count, step, body);
    }

    /// [`Cta::strided`] running `factor` iterations per trip while that many
    /// remain, then the rest one at a time. Iterations keep their order (so
    /// sums are those of [`Cta::strided`]); the unrolled iterations'
    /// shared loads are independent of each other's arithmetic, so ptxas can
    /// put them in flight together instead of paying one load latency per
    /// iteration of a runtime loop it does not unroll.
    pub(super) fn strided_unrolled(
        &self,
        k: &mut Kernel,
        start: Reg<U32>,
        count: Op<U32>,
        step: u32,
        factor: u32,
        mut body: impl FnMut(&mut Kernel, Reg<U32>),
    ) {
        let i = k.mov(start);
        if factor > 1 {
            let (top, end) = (k.label(), k.label());
            k.place(top);
            let last = k.add(i, (factor - 1) * step);
            let short = k.setp(Cmp::Ge, last, count);
            k.bra_if(short, true, end);
            for u in 0..factor {
                let item = match u {
                    0 => i,
                    _ => k.add(i, u * step),
                };
                body(k, item);
            }
            k.add_to(i, i, factor * step);
            k.bra(top);
            k.place(end);
        }
        self.strided(k, i, count, step, body);
    }

    /// Shared address of array `a` for query head 0.
    pub(super) fn array_base(&self, k: &mut Kernel, a: usize) -> Reg<U32> {
        k.add(self.smem, self.plan.arrays[a])
    }

    /// Per array: its base for query head 0 when `reads` holds it.
    pub(super) fn array_bases(
        &self,
        k: &mut Kernel,
        reads: HashSet<Handle<ArrayDecl>>,
    ) -> Vec<Option<Reg<U32>>> {
        (self.m.arrays.iter())
            .map(|(a, _)| reads.contains(&a).then(|| self.array_base(k, a.index())))
            .collect()
    }

    /// `body(smem + 4·i)` for `i < count`, strided over the CTA's threads.
    pub(super) fn per_word(
        &self,
        k: &mut Kernel,
        count: u32,
        mut body: impl FnMut(&mut Kernel, Reg<U32>),
    ) {
        self.strided(k, self.tid, Op::Imm(count), self.plan.threads, |k, i| {
            let at = k.mad_lo(i, 4u32, self.smem);
            body(k, at);
        });
    }

    pub(super) fn staged_tables(&self, k: &mut Kernel) -> Vec<Option<TableAccess>> {
        self.plan
            .tables
            .iter()
            .map(|at| at.map(|at| TableAccess::Shared(k.add(self.smem, at))))
            .collect()
    }

    /// Whether head `block * size + j` is one of the group's (`None`: always).
    pub(super) fn head_ok(
        &self,
        k: &mut Kernel,
        block: Option<Reg<U32>>,
        size: u32,
        j: u32,
    ) -> Option<Reg<Pred>> {
        match block {
            None if j == 0 => None,
            None => Some(k.setp(Cmp::Lt, j, self.group)),
            Some(b) => {
                let head = k.mad_lo(b, size, j);
                Some(k.setp(Cmp::Lt, head, self.group))
            }
        }
    }

    /// `body(head, lane, column)` for every head of the group, warp `w`
    /// taking heads `w, w + warps, …`; `column` is the head's logits column.
    pub(super) fn per_head_warps(
        &self,
        k: &mut Kernel,
        mut body: impl FnMut(&mut Kernel, Reg<U32>, Reg<U32>, Reg<U32>),
    ) {
        let warp = k.shr(self.tid, 5u32);
        let lane = k.and(self.tid, 31u32);
        let logits = k.add(self.smem, self.plan.logits);
        let h = k.mov(warp);
        let (top, end) = (k.label(), k.label());
        k.place(top);
        let done = k.setp(Cmp::Ge, h, self.group);
        k.bra_if(done, true, end);
        let column = k.mad_lo(h, 4u32, logits);
        body(k, h, lane, column);
        k.add_to(h, h, self.plan.warps);
        k.bra(top);
        k.place(end);
    }

    /// Butterfly reduction over the warp: every lane ends with the result in `v`.
    pub(super) fn warp_reduce(
        &self,
        k: &mut Kernel,
        v: Reg<F32>,
        op: impl Fn(&mut Kernel, Reg<F32>, Reg<F32>) -> Reg<F32>,
    ) {
        for mask in [16, 8, 4, 2, 1] {
            let other = k.shfl_bfly(v, mask);
            let r = op(k, v, other);
            k.assign(v, r);
        }
    }
}

/// `at` under an L2 policy that keeps its lines longest: the page lists and
/// queries, which every decode step (every layer, in serving) reads again,
/// where the pages stream through L2 once (docs/ptx-backend.md, Memory).
pub(super) fn kept(k: &mut Kernel, at: Reg<U64>) -> Global {
    let keep = k.l2_policy(Evict::Last);
    Global::at(at).cached(keep)
}

/// Bytes from a tile buffer to its header's scale slot 0 (past the page's
/// bookkeeping words).
pub(super) const HEADER_SLOT0: u32 = 16;

/// One tile in shared memory.
pub(super) struct Tile {
    pub(super) buf: Reg<U32>,
    /// Address of the header's scale slot 0.
    pub(super) header: Reg<U32>,
    /// Valid items of the tile.
    pub(super) items: Reg<U32>,
    /// The tile's first item in its page (`None`: tiles are whole pages).
    pub(super) first: Option<Reg<U32>>,
}

/// How the accumulators take the tile's decay.
#[derive(Clone, Copy)]
pub(super) enum Rescale {
    /// The softmax phase wrote every head's decay.
    Always,
    /// Only when the predicate holds (the fused softmax moved its reference).
    When(Reg<Pred>),
}

/// `(idx / n, idx % n)` as quotient and `idx - quotient * n`.
pub(super) fn divide(
    k: &mut Kernel,
    idx: Reg<U32>,
    n: impl Into<Op<U32>> + Copy,
) -> (Reg<U32>, Reg<U32>) {
    let q = k.div_u32(idx, n);
    let whole = k.mul(q, n);
    (q, k.sub(idx, whole))
}

/// The conjunction of the present conditions (`None`: no condition).
pub(super) fn all(k: &mut Kernel, conditions: &[Option<Reg<Pred>>]) -> Option<Reg<Pred>> {
    conditions
        .iter()
        .flatten()
        .copied()
        .reduce(|a, b| k.and_pred(a, b))
}
