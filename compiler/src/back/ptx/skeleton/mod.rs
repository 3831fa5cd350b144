//! The flash-decoding kernel around one tier's programs (docs/ptx-backend.md).
//!
//! One CTA per (sequence, kv head, split) runs every query head of the kv
//! head's group: it loads the queries and runs the key prologue per head, then
//! streams its share of the tier's pages tile by tile — `cp.async` or, on
//! sm_90, bulk copies (completing on mbarriers) into one shared buffer while
//! the other is computed on — with, per tile, a score
//! phase (logits of every (item, head)), an online-softmax phase (one warp per
//! head) and an accumulate phase (threads own value channels for a block of
//! heads, so each value code is decoded once for all of them). At the end it
//! runs the value epilogue per head and writes unnormalized partials.

use std::collections::HashSet;

use super::abi::{tensor_map_slot, ParamType, TableBuffer, DECODE_PARAMS, TENSOR_MAP_BYTES};
use super::builder::{
    Axis, Cmp, Evict, Global, Kernel, Op, Param, Pred, Reg, Shared, Type, F32, U32, U64,
};
use super::expr::{self, ArrayAccess, Env, ItemSource, Preloaded, Replicas, TableAccess};
use super::mma::WARP_LANES;
use super::plan::ScoreSplit;
use super::plan::{Plan, Stream, BARRIER_BYTES, CHUNK};
use crate::ir::{Arena, Expr, Module, Stage};
use crate::layout::Side;
use crate::valid::{ModuleInfo, ValidModule};

mod expand;
mod gather;
mod mma;

/// The dynamic shared memory symbol of every kvcc module.
pub const SHARED_SYMBOL: &str = "kvcc_smem";

/// Most copy trips per thread emitted straight-line (a tile of 40 KiB over 128
/// threads is 20); larger copies (big staged tables) run as a loop.
const COPY_UNROLL: u32 = 32;

struct Params {
    pool: Param<U64>,
    page_offsets: Param<U64>,
    page_ids: Param<U64>,
    tables: Param<U64>,
    queries: Param<U64>,
    partials: Param<U64>,
    q_heads: Param<U32>,
    kv_heads: Param<U32>,
    splits: Param<U32>,
    slot_base: Param<U32>,
    slot_count: Param<U32>,
    softmax_scale: Param<F32>,
    tensor_maps: Param<U64>,
}

/// Declares the parameters in [`DECODE_PARAMS`] order, checking their types.
fn declare(k: &mut Kernel) -> Params {
    let mut next = DECODE_PARAMS.iter();
    let mut take = |ty: ParamType, decl: &str| {
        let p = next.next().expect("DECODE_PARAMS lists every parameter");
        assert_eq!((p.ty, p.ty.ptx()), (ty, decl), "parameter {}", p.name);
        p.name
    };
    let mut pointer = |k: &mut Kernel| k.param::<U64>(take(ParamType::Pointer, U64::DECL));
    let pool = pointer(k);
    let page_offsets = pointer(k);
    let page_ids = pointer(k);
    let tables = pointer(k);
    let queries = pointer(k);
    let partials = pointer(k);
    let mut int = |k: &mut Kernel| k.param::<U32>(take(ParamType::U32, U32::DECL));
    let q_heads = int(k);
    let kv_heads = int(k);
    let splits = int(k);
    let slot_base = int(k);
    let slot_count = int(k);
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

/// The decode kernel of one tier.
pub fn decode(module: &ValidModule, plan: &Plan, name: &str) -> String {
    let mut k = Kernel::new(name, plan.threads, SHARED_SYMBOL);
    let p = declare(&mut k);
    let s = Skeleton::setup(&mut k, module, plan, &p);
    s.run(&mut k);
    k.finish()
}

/// Registers the page loop uses. Values only the prologue or the end need
/// are recomputed there from the parameters (constant-bank reads), so they do
/// not occupy registers through the loop.
struct Skeleton<'a> {
    m: &'a Module,
    info: &'a ModuleInfo,
    plan: &'a Plan,
    p: &'a Params,
    tid: Reg<U32>,
    group: Reg<U32>,
    /// Score head blocks holding at least one of the group's heads.
    score_blocks: Reg<U32>,
    pool: Reg<U64>,
    page_ids: Reg<U64>,
    /// First entry of this split in `page_ids`, and its tile count.
    first: Reg<U32>,
    tiles: Reg<U32>,
    smem: Reg<U32>,
}

impl<'a> Skeleton<'a> {
    fn setup(
        k: &mut Kernel,
        module: &'a ValidModule,
        plan: &'a Plan,
        p: &'a Params,
    ) -> Skeleton<'a> {
        let m = module.module();
        k.comment(&format!(
            "kvcc decode: format {} tier {}; {} threads, {} items/tile, {} B shared",
            m.format, m.tier, plan.threads, plan.tile_items, plan.shared_bytes
        ));
        let tid = k.tid_x();
        let split = k.ctaid(Axis::X);
        let kv_head = k.ctaid(Axis::Y);
        let sequence = k.ctaid(Axis::Z);
        let pool = k.ld_pointer(&p.pool);
        let offsets = k.ld_pointer(&p.page_offsets);
        let page_ids = k.ld_pointer(&p.page_ids);
        let q_heads = k.ld_param(&p.q_heads);
        let kv_heads = k.ld_param(&p.kv_heads);
        let splits = k.ld_param(&p.splits);
        let group = k.div_u32(q_heads, kv_heads);
        let score_blocks = if plan.score_head_blocks == 1 {
            k.mov(1u32)
        } else {
            let rounded = k.add(group, plan.score_head_block - 1);
            k.div_u32(rounded, plan.score_head_block)
        };
        k.comment("split s takes pages [s * share, (s + 1) * share) of its row");
        let row = k.mad_lo(sequence, kv_heads, kv_head);
        let row_at = k.global_index(offsets, row, 4);
        let row_at = kept(k, row_at);
        let begin = k.ld_global_nc::<U32>(row_at);
        let end = k.ld_global_nc::<U32>(row_at.plus(4));
        let pages = k.sub(end, begin);
        let rounded = k.add(pages, splits);
        let rounded = k.sub(rounded, 1u32);
        let share = k.div_u32(rounded, splits);
        let start = k.mul(split, share);
        let start = k.min(start, pages);
        let stop = k.add(start, share);
        let stop = k.min(stop, pages);
        let count = k.sub(stop, start);
        let first = k.add(begin, start);
        let tiles = k.mul(count, plan.tiles_per_page);
        let smem = k.shared_base();
        Skeleton {
            m,
            info: module.info(),
            plan,
            p,
            tid,
            group,
            score_blocks,
            pool,
            page_ids,
            first,
            tiles,
            smem,
        }
    }

    /// `sequence * q_heads + kv_head * group`: the row of the group's first query head.
    fn q_row(&self, k: &mut Kernel) -> Reg<U32> {
        let sequence = k.ctaid(Axis::Z);
        let kv_head = k.ctaid(Axis::Y);
        let q_heads = k.ld_param(&self.p.q_heads);
        let head0 = k.mul(kv_head, self.group);
        k.mad_lo(sequence, q_heads, head0)
    }

    /// Global address of this kv head's tables.
    fn tables(&self, k: &mut Kernel) -> Reg<U64> {
        let tables = k.ld_pointer(&self.p.tables);
        let kv_head = k.ctaid(Axis::Y);
        k.global_index(tables, kv_head, 4 * TableBuffer::of(self.m).stride)
    }

    fn run(&self, k: &mut Kernel) {
        let plan = self.plan;
        // Before the page count is known: its barrier waits out the page
        // offsets' load latency instead of adding to it.
        self.init_barriers(k);
        let empty = k.label();
        let none = k.setp(Cmp::Eq, self.tiles, 0u32);
        k.bra_if(none, true, empty);

        let bulk = plan.barriers.is_some();
        k.comment("stage the tables score/accumulate read into shared memory");
        let buffer = TableBuffer::of(self.m);
        let tables = self.tables(k);
        for (t, at) in plan.tables.iter().enumerate() {
            if let Some(at) = *at {
                let chunks = (buffer.lens[t] * 4).div_ceil(CHUNK);
                let src = Global::at(tables).plus(4 * i64::from(buffer.offsets[t]));
                let dst = Shared::at(self.smem).plus(at.into());
                self.copy(k, Op::Imm(chunks), chunks, dst, src);
            }
        }
        // The tables' own group, unless the first tile's copies join it.
        if bulk || !plan.prefetch {
            k.cp_async_commit();
        }
        if plan.prefetch {
            k.comment("the first tiles load while the prologue runs");
            self.issue_first_tiles(k);
        }
        self.init_state(k);
        self.load_queries(k);
        k.bar_sync();
        k.comment("key prologue, every head of the group");
        self.stages(k, &self.m.key.prologue.stages, false);
        if !plan.prefetch {
            self.issue_first_tiles(k);
        }
        self.stream(k);
        if plan.dependent_launch {
            k.comment("the merge may launch: it waits for this grid's partials");
            k.launch_dependents();
        }
        k.comment("value epilogue, every head of the group");
        self.stages(k, &self.m.value.epilogue.stages, true);
        self.write_partials(k, true);
        k.ret();
        k.place(empty);
        k.comment("no pages: an empty partial (m = -inf, l = 0, out = 0)");
        self.write_partials(k, false);
        k.ret();
    }

    /// `for i in start.. count step threads { body(i) }` (no barrier inside).
    fn strided(
        &self,
        k: &mut Kernel,
        start: Reg<U32>,
        count: Op<U32>,
        step: u32,
        mut body: impl FnMut(&mut Kernel, Reg<U32>),
    ) {
        let i = k.mov(start);
        let (top, end) = (k.label(), k.label());
        k.place(top);
        let done = k.setp(Cmp::Ge, i, count);
        k.bra_if(done, true, end);
        body(k, i);
        k.add_to(i, i, step);
        k.bra(top);
        k.place(end);
    }

    /// [`Self::strided`] running `factor` iterations per trip while that many
    /// remain, then the rest one at a time. Iterations keep their order (so
    /// sums round as before); what changes is that the unrolled iterations'
    /// shared loads are independent of each other's arithmetic, so ptxas can
    /// put them in flight together instead of paying one load latency per
    /// iteration of a runtime loop it does not unroll.
    fn strided_unrolled(
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

    /// `cp.async` of `chunks` (at most `most`) 16-byte chunks from `src` to
    /// `dst`, chunk `q` by thread `q % threads`. Each thread computes its two
    /// addresses once; its `j`-th chunk is then at a constant offset, so a
    /// copy is one instruction (plus a bounds test where `chunks` may stop
    /// short). Recomputing 64-bit addresses per chunk in a loop cost ~20
    /// instructions per 16 bytes: a fifth of the dense kernel's instructions.
    fn copy(&self, k: &mut Kernel, chunks: Op<U32>, most: u32, dst: Shared, src: Global) {
        let threads = self.plan.threads;
        let to = k.mad_lo(self.tid, CHUNK, dst.base);
        let from = k.global_index(src.base, self.tid, CHUNK);
        let trips = most.div_ceil(threads);
        if trips > COPY_UNROLL {
            // Large staged tables: a loop advancing both addresses.
            let q = k.mov(self.tid);
            let (top, end) = (k.label(), k.label());
            k.place(top);
            let done = k.setp(Cmp::Ge, q, chunks);
            k.bra_if(done, true, end);
            k.cp_async_16(
                Shared::at(to).plus(dst.offset),
                Global::at(from).plus(src.offset),
            );
            k.add_to(q, q, threads);
            k.add_to(to, to, threads * CHUNK);
            k.add_to(from, from, u64::from(threads * CHUNK));
            k.bra(top);
            k.place(end);
            return;
        }
        for j in 0..trips {
            let skip = i64::from(j * threads * CHUNK);
            let (to, from) = (
                Shared::at(to).plus(dst.offset + skip),
                Global::at(from).plus(src.offset + skip),
            );
            self.copy_trip(k, j, chunks, to, from);
        }
    }

    /// Trip `j` of a straight-line copy: this thread's chunk `tid + j * threads`,
    /// tested against `chunks` unless it is known to be in range.
    fn copy_trip(&self, k: &mut Kernel, j: u32, chunks: Op<U32>, to: Shared, from: Global) {
        let threads = self.plan.threads;
        match chunks {
            Op::Imm(n) if (j + 1) * threads <= n => k.cp_async_16(to, from),
            _ => {
                let q = k.add(self.tid, j * threads);
                let ok = k.setp(Cmp::Lt, q, chunks);
                k.guarded(ok, true, |k| k.cp_async_16(to, from));
            }
        }
    }

    /// Shared address of array `a` for query head 0.
    fn array_base(&self, k: &mut Kernel, a: usize) -> Reg<U32> {
        k.add(self.smem, self.plan.arrays[a])
    }

    /// Per array: its base for query head 0 when `reads` holds it.
    fn array_bases(&self, k: &mut Kernel, reads: HashSet<usize>) -> Vec<Option<Reg<U32>>> {
        (0..self.m.arrays.len())
            .map(|a| reads.contains(&a).then(|| self.array_base(k, a)))
            .collect()
    }

    fn init_state(&self, k: &mut Kernel) {
        let plan = self.plan;
        let neg_inf = k.mov(f32::NEG_INFINITY);
        let zero = k.mov(0.0f32);
        self.per_word(k, plan.group_max, |k, at| {
            k.st_shared(Shared::at(at).plus(plan.max.into()), neg_inf);
            k.st_shared(Shared::at(at).plus(plan.sum.into()), zero);
        });
        if plan.fused_softmax {
            self.per_word(k, plan.head_stride, |k, at| {
                k.st_shared(Shared::at(at).plus(plan.tile_max.into()), ORDER_KEY_NEG_INF);
            });
        }
        // Tensor-core accumulates store their totals after the stream
        // (`Skeleton::mma_store`); the others add into the zeroed array.
        if plan.mma.is_none() {
            let acc = self.m.value.accumulator.index();
            let words = plan.group_max * plan.array_stride[acc] / 4;
            self.per_word(k, words, |k, at| {
                k.st_shared(Shared::at(at).plus(plan.arrays[acc].into()), zero);
            });
        }
    }

    /// `body(smem + 4·i)` for `i < count`, strided over the CTA's threads.
    fn per_word(&self, k: &mut Kernel, count: u32, mut body: impl FnMut(&mut Kernel, Reg<U32>)) {
        self.strided(k, self.tid, Op::Imm(count), self.plan.threads, |k, i| {
            let at = k.mad_lo(i, 4u32, self.smem);
            body(k, at);
        });
    }

    /// Queries of the group's heads into their `query` arrays, 16 bytes a
    /// load. When thread 0 has just issued the first tile's bulk copies, it
    /// waited on a global load for the page id: the other warps load the
    /// queries, so that the CTA's barrier waits on one load latency, not two
    /// (each thread's loads in flight together).
    fn load_queries(&self, k: &mut Kernel) {
        let plan = self.plan;
        let issued = plan.prefetch && plan.barriers.is_some() && plan.warps > 1;
        let loaded = k.label();
        let (start, step) = match issued {
            true => {
                let first_warp = k.setp(Cmp::Lt, self.tid, WARP_LANES);
                k.bra_if(first_warp, true, loaded);
                (k.sub(self.tid, WARP_LANES), plan.threads - WARP_LANES)
            }
            false => (self.tid, plan.threads),
        };
        let head_dim = self.m.head_dim;
        let vectors = head_dim / 4;
        let query = self.m.query.index();
        let stride = self.plan.array_stride[query];
        let base = self.array_base(k, query);
        let queries = k.ld_pointer(&self.p.queries);
        let q_row = self.q_row(k);
        let total = k.mul(self.group, vectors);
        let factor = match issued {
            true => (plan.group_max * vectors)
                .div_ceil(step)
                .min(QUERY_LOADS_IN_FLIGHT),
            false => 1,
        };
        self.strided_unrolled(k, start, Op::Reg(total), step, factor, |k, idx| {
            let (h, v) = divide(k, idx, vectors);
            let row = k.add(q_row, h);
            let four_v = k.shl(v, 2u32);
            let element = k.mad_lo(row, head_dim, four_v);
            let src = k.global_index(queries, element, 4);
            let src = kept(k, src);
            let values = k.ld_global_nc_v4::<F32>(src);
            let head = k.mad_lo(h, stride, base);
            let dst = k.mad_lo(v, CHUNK, head);
            k.st_shared_v4(Shared::at(dst), values);
        });
        k.place(loaded);
    }

    /// Runs kernel stages for every head of the group: iterations
    /// (head, iteration) strided over the CTA, a barrier after each stage.
    fn stages(&self, k: &mut Kernel, stages: &[Stage], epilogue: bool) {
        if stages.is_empty() {
            return;
        }
        let base = self.tables(k);
        let tables: Vec<Option<TableAccess>> = TableBuffer::of(self.m)
            .offsets
            .iter()
            .map(|&at| {
                let ptr = k.add(base, u64::from(4 * at));
                Some(TableAccess::Global(ptr))
            })
            .collect();
        for stage in stages {
            let used = stage_arrays(stage);
            let bases: Vec<Option<(Reg<U32>, u32)>> = (0..self.m.arrays.len())
                .map(|a| {
                    used.contains(&a)
                        .then(|| (self.array_base(k, a), self.plan.array_stride[a]))
                })
                .collect();
            let iterations = stage.iterations;
            let total = k.mul(self.group, iterations);
            self.strided(k, self.tid, Op::Reg(total), self.plan.threads, |k, idx| {
                let (h, iteration) = divide(k, idx, iterations);
                let arrays: Vec<Option<ArrayAccess>> = bases
                    .iter()
                    .map(|b| {
                        b.map(|(base, stride)| ArrayAccess {
                            base: k.mad_lo(h, stride, base),
                            replica_stride: stride,
                        })
                    })
                    .collect();
                let denominator = epilogue.then(|| {
                    let at = k.mad_lo(h, 4u32, self.smem);
                    k.ld_shared::<F32>(Shared::at(at).plus(self.plan.sum.into()))
                });
                let env = Env {
                    replicas: Replicas::One,
                    arrays: &arrays,
                    tables: &tables,
                    header: None,
                    item: None,
                    iteration: Some(iteration),
                    denominator,
                    preloaded: None,
                };
                let values = expr::emit(k, &stage.exprs, &env);
                for store in &stage.stores {
                    let access = arrays[store.array.index()].expect("stored arrays are used");
                    let index = values.get(store.index, 0);
                    let value = values.get(store.value, 0);
                    expr::store(k, access, index, value);
                }
            });
            k.bar_sync();
        }
    }

    /// Tiles `0 .. stages - 1`, one `cp.async` group each (the first also
    /// holds the staged tables; groups past the split's tiles are empty, so
    /// the stream's wait counts stay uniform); with bulk copies, each on its
    /// buffer's mbarriers instead.
    ///
    /// Pipelined ([`Plan::pipelined`]): group `s` holds tile `s`'s header and
    /// keys and tile `s − 1`'s values, which are read one tile later.
    fn issue_first_tiles(&self, k: &mut Kernel) {
        let pipelined = self.plan.pipelined;
        let whole = if pipelined { Part::Keys } else { Part::Whole };
        let bulk = self.plan.barriers.is_some();
        let zero = k.mov(0u32);
        self.issue_tile(k, zero, whole);
        if !bulk {
            k.cp_async_commit();
        }
        for s in 1..self.plan.stages - 1 {
            let t = k.mov(s);
            let past = k.setp(Cmp::Ge, t, self.tiles);
            let skip = k.label();
            k.bra_if(past, true, skip);
            self.issue_tile(k, t, whole);
            k.place(skip);
            if pipelined {
                // Tile s − 1's values: it may exist when tile s does not.
                let before = k.mov(s - 1);
                let past = k.setp(Cmp::Ge, before, self.tiles);
                let skip = k.label();
                k.bra_if(past, true, skip);
                self.issue_tile(k, before, Part::Values);
                k.place(skip);
            }
            if !bulk {
                k.cp_async_commit();
            }
        }
    }

    /// The buffer slot of tile `t`: `t % stages`.
    fn slot(&self, k: &mut Kernel, t: Reg<U32>) -> Reg<U32> {
        let stages = self.plan.stages;
        if stages.is_power_of_two() {
            k.and(t, stages - 1)
        } else {
            k.rem_u32(t, stages)
        }
    }

    /// Shared address of tile buffer `t % stages`.
    fn buffer(&self, k: &mut Kernel, t: Reg<U32>) -> Reg<U32> {
        let slot = self.slot(k, t);
        let base = k.add(self.smem, self.plan.buffers);
        k.mad_lo(slot, self.plan.buffer_bytes, base)
    }

    /// Bulk copies: thread 0 readies every buffer's mbarriers (one arrival
    /// per phase: its own, with the bytes to expect), and the CTA's barrier
    /// shows them to every thread before any use (racecheck flags the first
    /// arrival otherwise, though the same thread made both).
    fn init_barriers(&self, k: &mut Kernel) {
        let plan = self.plan;
        let Some(barriers) = plan.barriers else {
            return;
        };
        let skip = k.label();
        let other = k.setp(Cmp::Ne, self.tid, 0u32);
        k.bra_if(other, true, skip);
        for i in 0..2 * plan.stages {
            let at = Shared::at(self.smem).plus(i64::from(barriers + BARRIER_BYTES * i));
            k.mbarrier_init(at, 1);
        }
        k.fence_mbarrier_init();
        k.place(skip);
        k.bar_sync();
    }

    /// The mbarrier completing tile `t`'s keys (and header; unpipelined, its
    /// values too), or, with `values`, a pipelined tile's values.
    fn barrier(&self, k: &mut Kernel, t: Reg<U32>, values: bool) -> Shared {
        let plan = self.plan;
        let barriers = plan.barriers.expect("bulk copies");
        let slot = self.slot(k, t);
        let at = k.mad_lo(slot, BARRIER_BYTES, self.smem);
        let side = if values { plan.stages } else { 0 };
        Shared::at(at).plus(i64::from(barriers + BARRIER_BYTES * side))
    }

    /// Waits for the bulk copies of tile `t` (its values, with `values`):
    /// the buffer's barrier completes one phase per tile, so tile `t`'s is
    /// phase `t / stages`.
    fn wait_tile(&self, k: &mut Kernel, t: Reg<U32>, values: bool) {
        let stages = self.plan.stages;
        let round = if stages.is_power_of_two() {
            k.shr(t, stages.trailing_zeros())
        } else {
            k.div_u32(t, stages)
        };
        let parity = k.and(round, 1u32);
        let at = self.barrier(k, t, values);
        k.mbarrier_wait(at, parity);
    }

    /// First item of tile `t` within its page (`None`: tiles are whole pages)
    /// and the tile's item count.
    fn tile_span(&self, k: &mut Kernel, t: Reg<U32>) -> (Option<Reg<U32>>, Op<U32>) {
        let plan = self.plan;
        if plan.tiles_per_page == 1 {
            return (None, Op::Imm(plan.items_per_page));
        }
        let chunk = k.rem_u32(t, plan.tiles_per_page);
        let first = k.mul(chunk, plan.tile_items);
        if plan.items_per_page.is_multiple_of(plan.tile_items) {
            // Every tile is whole: the copies need no bounds tests.
            return (Some(first), Op::Imm(plan.tile_items));
        }
        let left = k.sub(plan.items_per_page, first);
        let len = k.min(left, plan.tile_items);
        (Some(first), Op::Reg(len))
    }

    /// The address of tile `t`'s entry in the split's page list.
    fn page_entry(&self, k: &mut Kernel, t: Reg<U32>) -> Global {
        let page_index = if self.plan.tiles_per_page == 1 {
            t
        } else {
            k.div_u32(t, self.plan.tiles_per_page)
        };
        let entry = k.add(self.first, page_index);
        let at = k.global_index(self.page_ids, entry, 4);
        kept(k, at)
    }

    /// Issues the copies of `part` of tile `t` into its buffer.
    fn issue_tile(&self, k: &mut Kernel, t: Reg<U32>, part: Part) {
        let at = self.page_entry(k, t);
        let page_id = k.ld_global_nc::<U32>(at);
        self.issue_tile_of(k, t, page_id, part);
    }

    /// [`Self::issue_tile`] with the id of the tile's page already loaded.
    fn issue_tile_of(&self, k: &mut Kernel, t: Reg<U32>, page_id: Reg<U32>, part: Part) {
        let plan = self.plan;
        if plan.barriers.is_some() {
            self.bulk_tile(k, t, page_id, part);
            return;
        }
        let page = k.global_index(self.pool, page_id, plan.page_bytes);
        let buf = self.buffer(k, t);
        let (first, len) = self.tile_span(k, t);
        if part != Part::Values {
            let header = plan.header_bytes / CHUNK;
            self.copy(
                k,
                Op::Imm(header),
                header,
                Shared::at(buf),
                Global::at(page),
            );
        }
        for &side in part.sides() {
            self.copy_stream(k, plan.stream(side), page, buf, first, len);
        }
    }

    /// [`Self::issue_tile_of`] by bulk copies: thread 0 copies the header
    /// and each stream of `part` as one run each (a swizzled stream as one
    /// box of its tensor map: always a whole tile, items past the page
    /// zeroed), runs that continue one another as one, all completing on the
    /// part's mbarrier, which it tells the total bytes to expect.
    fn bulk_tile(&self, k: &mut Kernel, t: Reg<U32>, page_id: Reg<U32>, part: Part) {
        let plan = self.plan;
        let skip = k.label();
        let other = k.setp(Cmp::Ne, self.tid, 0u32);
        k.bra_if(other, true, skip);
        let page = k.global_index(self.pool, page_id, plan.page_bytes);
        let buf = self.buffer(k, t);
        let (first, len) = self.tile_span(k, t);
        // Pages are read once per step: evicted first, they leave L2 to
        // the page lists and queries every step reads again.
        let streamed = k.l2_policy(Evict::First);
        let mut copies = Vec::new();
        if part != Part::Values && plan.header_bytes > 0 {
            let header = Op::Imm(plan.header_bytes);
            let src = Global::at(page).cached(streamed);
            copies.push((Shared::at(buf), BulkSource::Run(src), header));
        }
        for &side in part.sides() {
            let s = plan.stream(side);
            let dst = Shared::at(buf).plus(s.buffer_offset.into());
            if s.swizzled {
                let maps = k.ld_param(&self.p.tensor_maps);
                let map = k.add(maps, u64::from(TENSOR_MAP_BYTES * tensor_map_slot(side)));
                let zero = k.mov(0u32);
                let coords = [zero, zero, first.unwrap_or(zero), page_id];
                let bytes = Op::Imm(plan.tile_items * s.stride);
                copies.push((dst, BulkSource::Box(map, coords), bytes));
                continue;
            }
            let (src, chunks) = self.stream_span(k, s, page, first, len);
            let bytes = match chunks {
                Op::Imm(n) => Op::Imm(n * CHUNK),
                Op::Reg(n) => Op::Reg(k.shl(n, CHUNK.trailing_zeros())),
            };
            copies.push((dst, BulkSource::Run(src.cached(streamed)), bytes));
        }
        let copies = merge_runs(copies);
        let total = copies
            .iter()
            .fold(Op::Imm(0), |sum, &(_, _, bytes)| match (sum, bytes) {
                (Op::Imm(a), Op::Imm(b)) => Op::Imm(a + b),
                (a, b) => Op::Reg(k.add(a, b)),
            });
        let barrier = self.barrier(k, t, part == Part::Values);
        // The buffer's last readers (past the barrier that ended their tile)
        // used the generic proxy; the copies write through the async one.
        k.fence_proxy_async_shared();
        k.mbarrier_arrive_expect_tx(barrier, total);
        for (dst, src, bytes) in copies {
            match src {
                BulkSource::Run(src) => k.cp_async_bulk(dst, src, bytes, barrier),
                BulkSource::Box(map, coords) => {
                    k.cp_async_bulk_tensor_4d(dst, map, coords, barrier, streamed)
                }
            }
        }
        k.place(skip);
    }

    /// Where the tile's items of stream `s` start in the page, and their
    /// 16-byte chunks (the plan starts every tile's stream on a chunk).
    fn stream_span(
        &self,
        k: &mut Kernel,
        s: &Stream,
        page: Reg<U64>,
        first: Option<Reg<U32>>,
        len: Op<U32>,
    ) -> (Global, Op<U32>) {
        let src = match first {
            None => Global::at(page),
            Some(first) => {
                let skip = k.mul(first, s.stride);
                Global::at(k.global_index(page, skip, 1))
            }
        }
        .plus(s.page_offset.into());
        let chunks = match len {
            Op::Imm(n) => Op::Imm((n * s.stride).div_ceil(CHUNK)),
            Op::Reg(n) => {
                let bytes = k.mad_lo(n, s.stride, CHUNK - 1);
                Op::Reg(k.shr(bytes, CHUNK.trailing_zeros()))
            }
        };
        (src, chunks)
    }

    fn copy_stream(
        &self,
        k: &mut Kernel,
        s: &Stream,
        page: Reg<U64>,
        buf: Reg<U32>,
        first: Option<Reg<U32>>,
        len: Op<U32>,
    ) {
        let dst = Shared::at(buf).plus(s.buffer_offset.into());
        if !s.padded() {
            let (src, chunks) = self.stream_span(k, s, page, first, len);
            let most = (self.plan.tile_items * s.stride).div_ceil(CHUNK);
            self.copy(k, chunks, most, dst, src);
            return;
        }
        // Padded rows: item by item, 16 bytes at a time.
        let threads = self.plan.threads;
        let per_item = s.stride / CHUNK;
        let chunks = match len {
            Op::Imm(n) => Op::Imm(n * per_item),
            Op::Reg(n) => Op::Reg(k.mul(n, per_item)),
        };
        let trips = (self.plan.tile_items * per_item).div_ceil(threads);
        // Global and shared address of 16-byte part `part` of the tile's item `item`.
        let chunk_at = |k: &mut Kernel, item: Reg<U32>, part: Reg<U32>| {
            let part_bytes = k.shl(part, CHUNK.trailing_zeros());
            let row = match first {
                None => item,
                Some(first) => k.add(item, first),
            };
            let from = k.mad_lo(row, s.stride, part_bytes);
            let from = k.global_index(page, from, 1);
            let to = k.mad_lo(item, s.shared_stride, part_bytes);
            (from, k.add(to, dst.base))
        };
        if (threads.is_multiple_of(per_item) || per_item.is_multiple_of(threads))
            && trips <= COPY_UNROLL
        {
            // Chunk q = tid + j * threads is (item0 + di, part0 + dp) with
            // (di, dp) = divmod(j * threads, per_item) and no carry between
            // the two (one of threads, per_item divides the other): every trip
            // is at constant offsets from the thread's first chunk, as in
            // `copy`.
            let (item0, part0) = divide(k, self.tid, per_item);
            let (from, to) = chunk_at(k, item0, part0);
            for j in 0..trips {
                let (di, dp) = (j * threads / per_item, j * threads % per_item);
                let (to, from) = (
                    Shared::at(to).plus(dst.offset + i64::from(di * s.shared_stride + dp * CHUNK)),
                    Global::at(from).plus(i64::from(s.page_offset + di * s.stride + dp * CHUNK)),
                );
                self.copy_trip(k, j, chunks, to, from);
            }
            return;
        }
        self.strided(k, self.tid, chunks, threads, |k, q| {
            let (item, part) = divide(k, q, per_item);
            let (from, to) = chunk_at(k, item, part);
            k.cp_async_16(
                Shared::at(to).plus(dst.offset),
                Global::at(from).plus(s.page_offset.into()),
            );
        });
    }

    /// The page loop: double-buffered tiles, score, softmax, accumulate.
    ///
    /// Tile `t + 1` is issued right after the barrier that makes tile `t`
    /// visible: every thread has then finished tile `t - 1`, whose buffer the
    /// copy overwrites, so no barrier closes a tile. The page id of tile
    /// `t + 1` was read from the page list one tile earlier (sixth round: the
    /// dependent global load no longer stalls the CTA right after the barrier;
    /// the index is clamped to the last tile, so the read stays in the list).
    fn stream(&self, k: &mut Kernel) {
        let plan = self.plan;
        k.comment("stream the split's tiles, the next one loading during this one");
        let fused = plan.fused_softmax.then(|| self.score_setup(k));
        let registers = plan
            .register_accumulators
            .then(|| self.accumulate_setup(k, None, None));
        let values = plan.mma.as_ref().map(|m| self.mma_values_setup(k, m));
        let warp_score =
            (plan.mma.as_ref()).and_then(|m| Some(self.mma_score_setup(k, m, m.score.as_ref()?)));
        let expand = (plan.mma.as_ref()).and_then(|m| self.mma_expand_setup(k, m));
        // Pipelined, tile t's values accumulate during tile t + 1, next to its
        // score: no dependency between the two, so one's latencies hide the other's.
        let pending = (plan.mma.as_ref())
            .filter(|_| plan.pipelined)
            .map(|m| self.mma_pending_setup(k, m));
        let t = k.mov(0u32);
        let last = k.sub(self.tiles, 1u32);
        let lead = plan.stages - 1;
        let ahead = k.min(last, lead);
        let at = self.page_entry(k, ahead);
        k.comment(&format!(
            "{} tile buffers: tile t + {lead} loads during tile t; its page id was read a tile earlier",
            plan.stages
        ));
        let next_page = k.ld_global_nc::<U32>(at);
        // Pipelined: the page of tile t + lead − 1, whose values load with
        // tile t + lead's keys.
        let value_page = pending.is_some().then(|| {
            let behind = k.min(last, lead - 1);
            let at = self.page_entry(k, behind);
            k.ld_global_nc::<U32>(at)
        });
        if plan.barriers.is_some() {
            k.comment("the staged tables are in");
            k.cp_async_wait(0);
        }
        let top = k.label();
        k.place(top);
        k.comment("tile t is in, and every thread is done with tile t - 1");
        match plan.barriers {
            None => k.cp_async_wait(plan.stages - 2),
            Some(_) => {
                self.wait_tile(k, t, false);
                if pending.is_some() {
                    // And the values of tile t - 1, the pending tile.
                    let skip = k.label();
                    let first = k.setp(Cmp::Eq, t, 0u32);
                    k.bra_if(first, true, skip);
                    let before = k.sub(t, 1u32);
                    self.wait_tile(k, before, true);
                    k.place(skip);
                }
            }
        }
        k.bar_sync();
        let next = k.add(t, lead);
        if let Some(value_page) = value_page {
            // With one tile ahead that is tile t itself, which exists.
            let behind = k.add(t, lead - 1);
            let skip = (lead > 1).then(|| {
                let exists = k.setp(Cmp::Lt, behind, self.tiles);
                let skip = k.label();
                k.bra_if(exists, false, skip);
                skip
            });
            self.issue_tile_of(k, behind, value_page, Part::Values);
            if let Some(skip) = skip {
                k.place(skip);
            }
        }
        let more = k.setp(Cmp::Lt, next, self.tiles);
        let issued = k.label();
        k.bra_if(more, false, issued);
        match value_page {
            Some(value_page) => {
                self.issue_tile_of(k, next, next_page, Part::Keys);
                k.assign(value_page, next_page);
            }
            None => self.issue_tile_of(k, next, next_page, Part::Whole),
        }
        let after = k.add(t, lead + 1);
        let after = k.min(after, last);
        let at = self.page_entry(k, after);
        k.ld_global_nc_to(next_page, at);
        k.place(issued);
        if plan.barriers.is_none() {
            k.cp_async_commit();
        }
        let buf = self.buffer(k, t);
        let (first, len) = self.tile_span(k, t);
        let stored = k.ld_shared::<U32>(Shared::at(buf).plus(4));
        let items = match first {
            // Pages hold at most items_per_page (checked on the host).
            None => k.min(stored, plan.items_per_page),
            Some(first) => {
                let left = k.sub(stored, first);
                let before = k.setp(Cmp::Lt, stored, first);
                let left = k.selp(0u32, left, before);
                k.min(left, len)
            }
        };
        let done = k.label();
        // Pipelined, an empty tile runs masked instead: the pending tile's
        // values still accumulate.
        if pending.is_none() {
            let nothing = k.setp(Cmp::Eq, items, 0u32);
            k.bra_if(nothing, true, done);
        }
        let header = k.add(buf, 16u32);
        let tile = Tile {
            buf,
            header,
            items,
            first,
        };
        if let Some(expand) = &expand {
            let value_tile = match &pending {
                Some(pending) => pending.span(),
                None => (tile.buf, tile.items),
            };
            self.mma_expand(k, expand, [(tile.buf, tile.items), value_tile]);
        }
        if let (Some(score), Some(values)) = (&warp_score, &values) {
            self.mma_tile(k, &tile, pending.as_ref(), score, values);
        } else {
            let rescale = match &fused {
                Some(fused) => Rescale::When(self.score_fused(k, &tile, fused)),
                None => {
                    self.score(k, &tile);
                    k.bar_sync();
                    self.softmax(k, items);
                    k.bar_sync();
                    Rescale::Always
                }
            };
            match (&values, &registers) {
                (Some(values), _) => self.mma_accumulate(k, &tile, values, rescale),
                (None, Some(acc)) => self.accumulate_items(k, &tile, acc, Some(rescale)),
                (None, None) => self.accumulate(k, &tile, rescale),
            }
        }
        k.place(done);
        k.add_to(t, t, 1u32);
        let again = k.setp(Cmp::Lt, t, self.tiles);
        k.bra_if(again, true, top);
        if let (Some(score), Some(values), Some(pending)) = (&warp_score, &values, &pending) {
            k.comment("the last tile's values: every copy is in");
            match plan.barriers {
                None => k.cp_async_wait(0),
                // The loop ran (an empty split returns before it): t = tiles.
                Some(_) => {
                    let last = k.sub(t, 1u32);
                    self.wait_tile(k, last, true);
                }
            }
            k.bar_sync();
            if let Some(expand) = &expand {
                let no_keys = k.mov(0u32);
                self.mma_expand(k, expand, [(pending.span().0, no_keys), pending.span()]);
            }
            self.mma_drain(k, pending, score, values, None);
        }
        k.comment("every thread is done with the last tile");
        k.bar_sync();
        if let Some(acc) = &registers {
            self.accumulate_store(k, acc, None);
        }
        if let Some(values) = &values {
            if let Some(score) = &warp_score {
                self.mma_warp_finish(k, score, values);
            }
            self.mma_store(k, values);
        }
        match &fused {
            Some(fused) => self.score_finish(k, fused),
            None if registers.is_some() => k.bar_sync(),
            None => {}
        }
    }

    /// Per-thread state of the fused softmax: each thread owns the score units
    /// `tid + u·threads` (`u < score_units`), unit `idx` being item
    /// `idx % tile_items` of score head block `idx / tile_items`, for the
    /// whole stream. Computed once before the page loop.
    fn score_setup(&self, k: &mut Kernel) -> FusedScore {
        let plan = self.plan;
        if let Some(split) = &plan.score_split {
            return self.split_setup(k, split);
        }
        let hb = plan.score_head_block;
        k.comment(&format!(
            "fused softmax: {} score unit(s) of {hb} head(s) per thread",
            plan.score_units
        ));
        let bases = self.array_bases(k, shared_reads(&self.m.key.score.exprs));
        let logits = k.add(self.smem, plan.logits);
        let tile_max = k.add(self.smem, plan.tile_max);
        let row_bytes = 4 * plan.head_stride;
        let neg_inf = k.mov(f32::NEG_INFINITY);
        let zero = k.mov(0.0f32);
        let units = (0..plan.score_units)
            .map(|u| {
                let idx = match u {
                    0 => self.tid,
                    _ => k.add(self.tid, u * plan.threads),
                };
                let (block, item) = divide(k, idx, plan.tile_items);
                let block_ok = k.setp(Cmp::Lt, block, self.score_blocks);
                let at_zero = k.setp(Cmp::Eq, item, 0u32);
                let first = k.and_pred(at_zero, block_ok);
                let arrays = bases
                    .iter()
                    .enumerate()
                    .map(|(a, base)| {
                        base.map(|base| {
                            let stride = plan.array_stride[a];
                            ArrayAccess {
                                base: k.mad_lo(block, hb * stride, base),
                                replica_stride: stride,
                            }
                        })
                    })
                    .collect();
                let row = k.mad_lo(item, row_bytes, logits);
                let row = k.mad_lo(block, hb * 4, row);
                let max_at = k.mad_lo(block, hb * 4, tile_max);
                let state = match plan.score_head_blocks {
                    1 => self.smem,
                    _ => k.mad_lo(block, hb * 4, self.smem),
                };
                ScoreUnit {
                    // With one score block, a valid unit's block is 0.
                    block: (plan.score_head_blocks > 1).then_some(block),
                    item,
                    block_ok,
                    first,
                    arrays,
                    row,
                    max_at,
                    state,
                    refs: (0..hb).map(|_| k.mov(neg_inf)).collect(),
                    sums: (0..hb).map(|_| k.mov(zero)).collect(),
                }
            })
            .collect();
        FusedScore {
            units,
            logits: Logits::Program,
        }
    }

    /// [`Self::score_setup`] for a score split over lanes ([`ScoreSplit`]):
    /// each thread's units are items of one head block, and after the lanes'
    /// butterfly the `lanes` logits (units × heads) of each run of
    /// `lanes / head_block` units are spread over the lanes, lane
    /// `a · head_block + j` owning head `block · head_block + j` of the run's
    /// unit `a`: the thread's softmax slots are one-head units of that head. The thread's slice of the
    /// block's queries is loaded into registers here, once.
    fn split_setup(&self, k: &mut Kernel, split: &ScoreSplit) -> FusedScore {
        let plan = self.plan;
        let (lanes, hb) = (split.lanes, split.head_block);
        k.comment(&format!(
            "fused softmax, score split over {lanes} lanes: {} unit(s) of {hb} head(s) per thread, queries in registers",
            split.units
        ));
        let lane = k.and(self.tid, lanes - 1);
        let g = k.shr(self.tid, lanes.trailing_zeros());
        let (block, first_item) = divide(k, g, split.per_block);
        // Lane `a · hb + j` owns head j of the units `v · (lanes / hb) + a`.
        let owners = lanes / hb;
        let j = k.and(lane, hb - 1);
        let a = k.shr(lane, hb.trailing_zeros());
        let head = k.mad_lo(block, hb, j);
        let block_ok = k.setp(Cmp::Lt, head, self.group);
        let program = &split.part.program;
        let reads = shared_reads(&program.exprs);
        let arrays: Vec<Option<ArrayAccess>> = (0..self.m.arrays.len())
            .map(|a| {
                reads.contains(&a).then(|| {
                    let base = self.array_base(k, a);
                    let stride = plan.array_stride[a];
                    let base = k.mad_lo(block, hb * stride, base);
                    ArrayAccess {
                        base: k.mad_lo(lane, 4 * split.part.index_step, base),
                        replica_stride: stride,
                    }
                })
            })
            .collect();
        let env = Env {
            replicas: Replicas::Heads(hb),
            arrays: &arrays,
            tables: &[],
            header: None,
            item: None,
            iteration: None,
            denominator: None,
            preloaded: None,
        };
        let preloaded = expr::preload(k, &program.exprs, &env);
        let lane_offset = k.mul(lane, split.part.item_step);
        let is_lane = (0..lanes).map(|l| k.setp(Cmp::Eq, lane, l)).collect();
        let logits = k.add(self.smem, plan.logits);
        let tile_max = k.add(self.smem, plan.tile_max);
        let row_bytes = 4 * plan.head_stride;
        let column = k.mad_lo(head, 4u32, logits);
        let max_at = k.mad_lo(head, 4u32, tile_max);
        let state = k.mad_lo(head, 4u32, self.smem);
        let part_items = (0..split.units)
            .map(|u| match u {
                0 => first_item,
                _ => k.add(first_item, u * split.per_block),
            })
            .collect();
        let own_item = k.mad_lo(a, split.per_block, first_item);
        let units = (0..split.units * hb / lanes)
            .map(|v| {
                let item = match v {
                    0 => own_item,
                    _ => k.add(own_item, v * owners * split.per_block),
                };
                let row = k.mad_lo(item, row_bytes, column);
                ScoreUnit::one_head(k, head, item, block_ok, [row, max_at, state])
            })
            .collect();
        FusedScore {
            units,
            logits: Logits::Split(SplitScore {
                arrays,
                preloaded,
                lane_offset,
                is_lane,
                part_items,
            }),
        }
    }

    /// The split score's logits of a tile, one per unit (of the head the
    /// thread's lane owns; unscaled). Every unit is computed whether or not
    /// its item is in the tile (items past the tile's end read stale bytes of
    /// the buffer, and their logits are never used), so the units have no
    /// branches between them and their loads and chains interleave; the
    /// lanes of an item then sum their partials with a butterfly.
    fn split_logits(
        &self,
        k: &mut Kernel,
        tile: &Tile,
        sp: &SplitScore,
        tables: &[Option<TableAccess>],
    ) -> Vec<Reg<F32>> {
        let plan = self.plan;
        let split = plan.score_split.as_ref().expect("split plan");
        let hb = split.head_block as usize;
        let program = &split.part.program;
        let result = program.result.expect("lane split has a result");
        let items_base = k.add(tile.buf, plan.key.buffer_offset);
        let lane_items = k.add(items_base, sp.lane_offset);
        let step_align = match split.part.item_step {
            0 => 16,
            step => 1 << step.trailing_zeros().min(4),
        };
        let align = plan.key.align().min(step_align);
        let mut parts: Vec<Vec<Reg<F32>>> = Vec::new();
        for &part_item in &sp.part_items {
            let item = k.mad_lo(part_item, plan.key.shared_stride, lane_items);
            let env = Env {
                replicas: Replicas::Heads(split.head_block),
                arrays: &sp.arrays,
                tables,
                header: Some(tile.header),
                item: Some(ItemSource { base: item, align }),
                iteration: None,
                denominator: None,
                preloaded: Some(&sp.preloaded),
            };
            let values = expr::emit(k, &program.exprs, &env);
            parts.push(
                (0..hb)
                    .map(|j| expr::materialize_f32(k, values.get(result, j).f32()))
                    .collect(),
            );
        }
        let mut mask = split.lanes / 2;
        while mask > 0 {
            for part in parts.iter_mut() {
                for p in part.iter_mut() {
                    let other = k.shfl_bfly(*p, mask);
                    *p = k.add(*p, other);
                }
            }
            mask /= 2;
        }
        // Slot v of lane `a · hb + j`: head j of unit `v · (lanes / hb) + a`.
        parts
            .chunks(split.lanes as usize / hb)
            .map(|units| {
                let mut own = units[0][0];
                for (l, &is) in sp.is_lane.iter().enumerate().skip(1) {
                    own = k.selp(units[l / hb][l % hb], own, is);
                }
                own
            })
            .collect()
    }

    /// Score and softmax of a tile without a separate softmax phase. Each
    /// thread computes its units' logits `s` and, against its copy of the
    /// head's reference `m` (the same in every thread), writes the weights
    /// `exp(s − m)`. One `bar.red.or` both ends the phase and tells every
    /// thread whether some logit exceeded its reference by more than
    /// [`RESCALE_SLACK`]; only then (the first tile, and when the scores
    /// grow) the tile's maximum is reduced in shared memory, the reference
    /// moves to max(m, tile max), sums and weights are redone against it and
    /// the accumulate rescales by the decay. Otherwise the weights stay below
    /// e^slack = 256 and nothing is rescaled: the math is that of the
    /// interpreter's softmax with a different (valid) reference, since the
    /// partial's (out, m, l) are all relative to the same `m`.
    /// Returns whether the tile rescaled (the same in every thread).
    fn score_fused(&self, k: &mut Kernel, tile: &Tile, fused: &FusedScore) -> Reg<Pred> {
        let plan = self.plan;
        // A split score's units are one-head units of the lane's head.
        let hb = fused.head_block(plan);
        k.comment("score and softmax weights, against the running reference");
        let tables = self.staged_tables(k);
        let unit_logits = match &fused.logits {
            Logits::Program => None,
            Logits::Split(sp) => Some(self.split_logits(k, tile, sp, &tables)),
        };
        let items_base = k.add(tile.buf, plan.key.buffer_offset);
        let scale = k.ld_param(&self.p.softmax_scale);
        let zero = k.mov(0.0f32);
        let flag = k.mov(0u32);
        let mut logits = Vec::new();
        let mut weights = Vec::new();
        let mut valid = Vec::new();
        for (u, unit) in fused.units.iter().enumerate() {
            let s: Vec<Reg<F32>> = (0..hb).map(|_| k.mov(zero)).collect();
            let w: Vec<Reg<F32>> = (0..hb).map(|_| k.mov(zero)).collect();
            let in_tile = k.setp(Cmp::Lt, unit.item, tile.items);
            let ok = k.and_pred(in_tile, unit.block_ok);
            let skip = k.label();
            k.bra_if(ok, false, skip);
            if let Some(unit_logits) = &unit_logits {
                k.mul_to(s[0], unit_logits[u], scale);
            } else {
                let item = k.mad_lo(unit.item, plan.key.shared_stride, items_base);
                let scores = self.item_scores(k, item, &unit.arrays, &tables, tile.header, hb);
                for (j, logit) in scores.into_iter().enumerate() {
                    k.mul_to(s[j], logit, scale);
                }
            }
            for j in 0..hb {
                let (s, w, m) = (s[j as usize], w[j as usize], unit.refs[j as usize]);
                let weight = k.exp_diff(s, m);
                k.assign(w, weight);
                let at = Shared::at(unit.row).plus(i64::from(4 * j));
                let limit = k.add(m, RESCALE_SLACK);
                let over = k.setp(Cmp::Gt, s, limit);
                match self.head_ok(k, unit.block, hb, j) {
                    None => {
                        k.st_shared(at, w);
                        k.guarded(over, true, |k| k.assign(flag, 1u32));
                    }
                    Some(head) => {
                        k.guarded(head, true, |k| k.st_shared(at, w));
                        let over = k.and_pred(over, head);
                        k.guarded(over, true, |k| k.assign(flag, 1u32));
                    }
                }
            }
            k.place(skip);
            logits.push(s);
            weights.push(w);
            valid.push(ok);
        }
        let need = k.setp(Cmp::Ne, flag, 0u32);
        let rescale = k.bar_red_or(need);
        let settled = k.label();
        k.bra_if(rescale, false, settled);
        k.comment("rare: move the reference to max(m, tile max), redo the weights");
        for (u, unit) in fused.units.iter().enumerate() {
            for j in 0..hb {
                let ok = match self.head_ok(k, unit.block, hb, j) {
                    None => valid[u],
                    Some(head) => k.and_pred(head, valid[u]),
                };
                let key = order_key(k, logits[u][j as usize]);
                let at = Shared::at(unit.max_at).plus(i64::from(4 * j));
                k.guarded(ok, true, |k| k.red_shared_max(at, key));
            }
        }
        k.bar_sync();
        let mut owners = Vec::new();
        for (u, unit) in fused.units.iter().enumerate() {
            for j in 0..hb {
                let ju = j as usize;
                let at = Shared::at(unit.max_at).plus(i64::from(4 * j));
                // Units past the group's blocks have no slot to read.
                let key = k.mov(ORDER_KEY_NEG_INF);
                k.guarded(unit.block_ok, true, |k| {
                    let stored = k.ld_shared::<U32>(at);
                    k.assign(key, stored);
                });
                let tile_max = from_order_key(k, key);
                let old = unit.refs[ju];
                let new = k.max(old, tile_max);
                let same = k.setp(Cmp::Eq, new, old);
                let decay = k.exp_diff(old, new);
                // Also keeps exp(-inf + inf) out of heads with no logits yet.
                let decay = k.selp(1.0f32, decay, same);
                k.mul_to(unit.sums[ju], unit.sums[ju], decay);
                k.assign(old, new);
                let weight = k.exp_diff(logits[u][ju], new);
                let weight = k.selp(weight, 0.0f32, valid[u]);
                k.assign(weights[u][ju], weight);
                let head = self.head_ok(k, unit.block, hb, j);
                let store = match head {
                    None => valid[u],
                    Some(head) => k.and_pred(head, valid[u]),
                };
                let w_at = Shared::at(unit.row).plus(i64::from(4 * j));
                k.guarded(store, true, |k| k.st_shared(w_at, weight));
                // One thread per head (its unit at item 0) publishes the new
                // reference and the accumulators' decay.
                let owner = match head {
                    None => unit.first,
                    Some(head) => k.and_pred(head, unit.first),
                };
                let state = Shared::at(unit.state).plus(i64::from(4 * j));
                k.guarded(owner, true, |k| {
                    k.st_shared(state.plus(plan.max.into()), new);
                    k.st_shared(state.plus(plan.decay.into()), decay);
                });
                owners.push((owner, at));
            }
        }
        k.bar_sync();
        k.comment("every thread has read the tile maxima: reset them");
        for (owner, at) in owners {
            k.guarded(owner, true, |k| k.st_shared(at, ORDER_KEY_NEG_INF));
        }
        k.place(settled);
        for (unit, w) in fused.units.iter().zip(&weights) {
            for (&sum, &w) in unit.sums.iter().zip(w) {
                k.add_to(sum, sum, w);
            }
        }
        rescale
    }

    /// After the page loop (all threads past its last barrier): each head's
    /// sum l from the threads' partial sums, through the logits rows, one
    /// warp per head.
    fn score_finish(&self, k: &mut Kernel, fused: &FusedScore) {
        let plan = self.plan;
        let hb = fused.head_block(plan);
        k.comment("the softmax sums: partial sums by (item, head), then one warp per head");
        for unit in &fused.units {
            for j in 0..hb {
                let at = Shared::at(unit.row).plus(i64::from(4 * j));
                let sum = unit.sums[j as usize];
                let store = match self.head_ok(k, unit.block, hb, j) {
                    None => unit.block_ok,
                    Some(head) => k.and_pred(head, unit.block_ok),
                };
                k.guarded(store, true, |k| k.st_shared(at, sum));
            }
        }
        k.bar_sync();
        let row_bytes = 4 * plan.head_stride;
        self.per_head_warps(k, |k, h, lane, column| {
            let total = k.mov(0.0f32);
            self.strided(k, lane, Op::Imm(plan.tile_items), 32, |k, i| {
                let at = k.mad_lo(i, row_bytes, column);
                let s = k.ld_shared::<F32>(Shared::at(at));
                k.add_to(total, total, s);
            });
            self.warp_reduce(k, total, |k, a, b| k.add(a, b));
            let leader = k.setp(Cmp::Eq, lane, 0u32);
            let state = k.mad_lo(h, 4u32, self.smem);
            k.guarded(leader, true, |k| {
                k.st_shared(Shared::at(state).plus(plan.sum.into()), total)
            });
        });
        k.bar_sync();
    }

    /// `body(head, lane, column)` for every head of the group, warp `w`
    /// taking heads `w, w + warps, …`; `column` is the head's logits column.
    fn per_head_warps(
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

    /// Tables as the per-item programs see them: staged in shared memory.
    /// The score program on the key item at shared address `item`: one
    /// unscaled logit per head of the `hb`-head block.
    fn item_scores(
        &self,
        k: &mut Kernel,
        item: Reg<U32>,
        arrays: &[Option<ArrayAccess>],
        tables: &[Option<TableAccess>],
        header: Reg<U32>,
        hb: u32,
    ) -> Vec<Reg<F32>> {
        let env = Env {
            replicas: Replicas::Heads(hb),
            arrays,
            tables,
            header: Some(header),
            item: Some(ItemSource {
                base: item,
                align: self.plan.key.align(),
            }),
            iteration: None,
            denominator: None,
            preloaded: None,
        };
        let values = expr::emit(k, &self.m.key.score.exprs, &env);
        let result = self.m.key.score.result.expect("validated functions return");
        (0..hb as usize)
            .map(|j| expr::materialize_f32(k, values.get(result, j).f32()))
            .collect()
    }

    fn staged_tables(&self, k: &mut Kernel) -> Vec<Option<TableAccess>> {
        self.plan
            .tables
            .iter()
            .map(|at| at.map(|at| TableAccess::Shared(k.add(self.smem, at))))
            .collect()
    }

    /// Logits of every (item, head) of the tile, times the softmax scale.
    fn score(&self, k: &mut Kernel, tile: &Tile) {
        let plan = self.plan;
        let hb = plan.score_head_block;
        k.comment(&format!(
            "score: work units (item, block of {hb} head(s)), items fastest"
        ));
        let tables = self.staged_tables(k);
        let bases = self.array_bases(k, shared_reads(&self.m.key.score.exprs));
        let items_base = k.add(tile.buf, plan.key.buffer_offset);
        let logits = k.add(self.smem, plan.logits);
        let work = if plan.score_head_blocks == 1 {
            tile.items
        } else {
            k.mul(tile.items, self.score_blocks)
        };
        let row_bytes = 4 * plan.head_stride;
        let scale = k.ld_param(&self.p.softmax_scale);
        self.strided(k, self.tid, Op::Reg(work), plan.threads, |k, idx| {
            let (block, i) = if plan.score_head_blocks == 1 {
                (None, idx)
            } else {
                let (b, i) = divide(k, idx, tile.items);
                (Some(b), i)
            };
            let arrays: Vec<Option<ArrayAccess>> = bases
                .iter()
                .enumerate()
                .map(|(a, base)| {
                    base.map(|base| {
                        let stride = plan.array_stride[a];
                        ArrayAccess {
                            base: match block {
                                None => base,
                                Some(b) => k.mad_lo(b, hb * stride, base),
                            },
                            replica_stride: stride,
                        }
                    })
                })
                .collect();
            let item = k.mad_lo(i, plan.key.shared_stride, items_base);
            let scores = self.item_scores(k, item, &arrays, &tables, tile.header, hb);
            let row = k.mad_lo(i, row_bytes, logits);
            let row = match block {
                None => row,
                Some(b) => k.mad_lo(b, hb * 4, row),
            };
            for (j, logit) in (0..hb).zip(scores) {
                let logit = k.mul(logit, scale);
                let at = Shared::at(row).plus(i64::from(4 * j));
                match self.head_ok(k, block, hb, j) {
                    None => k.st_shared(at, logit),
                    Some(ok) => k.guarded(ok, true, |k| k.st_shared(at, logit)),
                }
            }
        });
    }

    /// Whether head `block * size + j` is one of the group's (`None`: always).
    fn head_ok(
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

    /// Online softmax of the tile, one warp per head: new max, weights
    /// exp(s - m) in place of the logits, rescale factor and running sum.
    fn softmax(&self, k: &mut Kernel, items: Reg<U32>) {
        let plan = self.plan;
        k.comment("softmax: one warp per head");
        let row_bytes = 4 * plan.head_stride;
        self.per_head_warps(k, |k, h, lane, column| {
            let neg_inf = k.mov(f32::NEG_INFINITY);
            let best = k.mov(neg_inf);
            self.strided(k, lane, Op::Reg(items), 32, |k, i| {
                let at = k.mad_lo(i, row_bytes, column);
                let s = k.ld_shared::<F32>(Shared::at(at));
                let larger = k.max(best, s);
                k.assign(best, larger);
            });
            self.warp_reduce(k, best, |k, a, b| k.max(a, b));
            let state = k.mad_lo(h, 4u32, self.smem);
            let old = k.ld_shared::<F32>(Shared::at(state).plus(plan.max.into()));
            let new = k.max(old, best);
            let decay = k.exp_diff(old, new);
            let total = k.mov(0.0f32);
            self.strided(k, lane, Op::Reg(items), 32, |k, i| {
                let at = k.mad_lo(i, row_bytes, column);
                let s = k.ld_shared::<F32>(Shared::at(at));
                let w = k.exp_diff(s, new);
                k.st_shared(Shared::at(at), w);
                k.add_to(total, total, w);
            });
            self.warp_reduce(k, total, |k, a, b| k.add(a, b));
            let sum = k.ld_shared::<F32>(Shared::at(state).plus(plan.sum.into()));
            let sum = k.fma(sum, decay, total);
            let leader = k.setp(Cmp::Eq, lane, 0u32);
            // Every lane read the old max and sum above; lane 0 overwrites them.
            // Without the warp barrier that is a read-write race (lanes are
            // scheduled independently; the shuffles in between do not order
            // shared-memory accesses for other lanes).
            k.bar_warp_sync();
            k.guarded(leader, true, |k| {
                k.st_shared(Shared::at(state).plus(plan.max.into()), new);
                k.st_shared(Shared::at(state).plus(plan.sum.into()), sum);
                k.st_shared(Shared::at(state).plus(plan.decay.into()), decay);
            });
        });
    }

    /// Butterfly reduction over the warp: every lane ends with the result in `v`.
    fn warp_reduce(
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

    /// `acc[h][c] = acc[h][c] * decay[h] + Σ_i p[h][i] · v_i[c]` for the tile,
    /// with the accumulators in shared memory between tiles (several rounds
    /// of channels or head blocks).
    fn accumulate(&self, k: &mut Kernel, tile: &Tile, rescale: Rescale) {
        let plan = self.plan;
        let a = plan.accumulate;
        let rounds = plan.head_blocks * a.channel_rounds;
        let r = k.mov(0u32);
        let (top, end) = (k.label(), k.label());
        k.place(top);
        let (block, round) = match (plan.head_blocks > 1, a.channel_rounds > 1) {
            (false, false) => (None, None),
            (true, false) => (Some(r), None),
            (false, true) => (None, Some(r)),
            (true, true) => {
                let (b, cr) = divide(k, r, a.channel_rounds);
                (Some(b), Some(cr))
            }
        };
        if let Some(b) = block {
            // Rounds go block by block: past the group's last head, stop.
            let first_head = k.mul(b, plan.head_block);
            let past = k.setp(Cmp::Ge, first_head, self.group);
            k.bra_if(past, true, end);
        }
        let acc = self.accumulate_setup(k, block, round);
        // This round's accumulators, rescaled by the tile's decay.
        let one = k.mov(1.0f32);
        let decays: Vec<Reg<F32>> = (0..plan.head_block)
            .map(|j| {
                let decay = k.ld_shared(Shared::at(acc.decay_block).plus(i64::from(4 * j)));
                match rescale {
                    Rescale::Always => decay,
                    Rescale::When(p) => k.selp(decay, one, p),
                }
            })
            .collect();
        let acc_stride = plan.array_stride[self.m.value.accumulator.index()];
        for (at, row) in &acc.acc {
            for (j, (&sum, &decay)) in row.iter().zip(&decays).enumerate() {
                let at = Shared::at(*at).plus(i64::from(j as u32 * acc_stride));
                match acc.leader {
                    None => {
                        let old = k.ld_shared::<F32>(at);
                        k.mul_to(sum, old, decay);
                    }
                    // Only the leader reads (and later writes) the
                    // accumulator: a read by the other item lanes would
                    // race with the leader's write at the end of the tile.
                    Some(leader) => k.guarded(leader, true, |k| {
                        let old = k.ld_shared::<F32>(at);
                        k.mul_to(sum, old, decay);
                    }),
                }
            }
        }
        self.accumulate_items(k, tile, &acc, None);
        self.accumulate_store(k, &acc, block);
        if rounds > 1 {
            k.add_to(r, r, 1u32);
            let again = k.setp(Cmp::Lt, r, rounds);
            k.bra_if(again, true, top);
        }
        k.place(end);
    }

    /// A thread's channels of one accumulate round and their accumulator
    /// registers (zero): of round `round` of head block `block` (`None`: the
    /// only one).
    fn accumulate_setup(
        &self,
        k: &mut Kernel,
        block: Option<Reg<U32>>,
        round: Option<Reg<U32>>,
    ) -> AccThread {
        let plan = self.plan;
        let a = plan.accumulate;
        let hb = plan.head_block;
        k.comment(&format!(
            "accumulate: {} x {} adjacent channel(s) x {} head(s) per thread, {} item lane(s){}",
            a.channels,
            a.pack,
            hb,
            a.item_lanes,
            if plan.register_accumulators {
                ", accumulators in registers across tiles"
            } else {
                ""
            }
        ));
        let (slot, lane, leader) = if a.item_lanes == 1 {
            (self.tid, None, None)
        } else {
            let slot = k.shr(self.tid, a.item_lanes.trailing_zeros());
            let lane = k.and(self.tid, a.item_lanes - 1);
            let leader = k.setp(Cmp::Eq, lane, 0u32);
            (slot, Some(lane), Some(leader))
        };
        let acc_index = self.m.value.accumulator.index();
        let acc0 = self.array_base(k, acc_index);
        let acc_stride = plan.array_stride[acc_index];
        let decay0 = k.add(self.smem, plan.decay);
        let logits0 = k.add(self.smem, plan.logits);
        let units = plan.dims / a.pack;
        let span = a.channels * a.slots;
        let may_overrun = span * a.channel_rounds > units;
        let first_unit = match round {
            None => slot,
            Some(cr) => k.mad_lo(cr, span, slot),
        };
        // Replica `pack·c + e` is channel `pack·unit_c + e`: the program's
        // emitter relies on that order to share work within a unit.
        let mut channels = Vec::new();
        let mut valid = Vec::new();
        for c in 0..a.channels {
            let unit = match c {
                0 => first_unit,
                _ => k.add(first_unit, c * a.slots),
            };
            let (unit, ok) = if may_overrun {
                // Clamping the unit (not each channel) keeps the pack adjacent.
                let ok = k.setp(Cmp::Lt, unit, units);
                (k.min(unit, units - 1), Some(ok))
            } else {
                (unit, None)
            };
            let first = match a.pack {
                1 => unit,
                pack => k.mul(unit, pack),
            };
            for e in 0..a.pack {
                valid.push(ok);
                channels.push(match e {
                    0 => first,
                    _ => k.add(first, e),
                });
            }
        }
        let scaled = |k: &mut Kernel, base: Reg<U32>, bytes: u32| match block {
            None => base,
            Some(b) => k.mad_lo(b, bytes, base),
        };
        let acc_block = scaled(k, acc0, hb * acc_stride);
        let decay_block = scaled(k, decay0, hb * 4);
        let logits_block = scaled(k, logits0, hb * 4);
        let zero = k.mov(0.0f32);
        let acc = channels
            .iter()
            .map(|&channel| {
                let at = k.mad_lo(channel, 4u32, acc_block);
                (at, (0..hb).map(|_| k.mov(zero)).collect())
            })
            .collect();
        AccThread {
            lane,
            leader,
            channels,
            valid,
            acc,
            decay_block,
            logits_block,
        }
    }

    /// The tile's items into the accumulator registers; first, with
    /// `rescale`, the registers times the tile's decay.
    fn accumulate_items(
        &self,
        k: &mut Kernel,
        tile: &Tile,
        acc: &AccThread,
        rescale: Option<Rescale>,
    ) {
        let plan = self.plan;
        let a = plan.accumulate;
        let hb = plan.head_block;
        let rescale_registers = |k: &mut Kernel| {
            for j in 0..hb {
                let decay: Reg<F32> =
                    k.ld_shared(Shared::at(acc.decay_block).plus(i64::from(4 * j)));
                for (_, row) in &acc.acc {
                    k.mul_to(row[j as usize], row[j as usize], decay);
                }
            }
        };
        match rescale {
            None => {}
            Some(Rescale::Always) => rescale_registers(k),
            Some(Rescale::When(p)) => {
                let kept = k.label();
                k.bra_if(p, false, kept);
                rescale_registers(k);
                k.place(kept);
            }
        }
        let tables = self.staged_tables(k);
        let items_base = k.add(tile.buf, plan.value.buffer_offset);
        let row_bytes = 4 * plan.head_stride;
        let start = acc.lane.unwrap_or_else(|| k.mov(0u32));
        let items = Op::Reg(tile.items);
        self.strided_unrolled(k, start, items, a.item_lanes, a.item_unroll, |k, i| {
            let item = k.mad_lo(i, plan.value.shared_stride, items_base);
            let env = Env {
                replicas: Replicas::Channels {
                    channels: &acc.channels,
                    pack: a.pack,
                    ranges: &self.info.accumulate.ranges,
                },
                arrays: &[],
                tables: &tables,
                header: Some(tile.header),
                item: Some(ItemSource {
                    base: item,
                    align: plan.value.align(),
                }),
                iteration: None,
                denominator: None,
                preloaded: None,
            };
            let values = expr::emit(k, &self.m.value.accumulate.exprs, &env);
            let result = self
                .m
                .value
                .accumulate
                .result
                .expect("validated functions return");
            let weights_at = Shared::at(k.mad_lo(i, row_bytes, acc.logits_block));
            // A block of a multiple of 4 heads starts 16-byte aligned.
            let weights: Vec<Reg<F32>> = if hb.is_multiple_of(4) {
                (0..hb / 4)
                    .flat_map(|q| k.ld_shared_v4(weights_at.plus(i64::from(16 * q))))
                    .collect()
            } else {
                (0..hb)
                    .map(|j| k.ld_shared(weights_at.plus(i64::from(4 * j))))
                    .collect()
            };
            for (c, (_, row)) in acc.acc.iter().enumerate() {
                let v = expr::materialize_f32(k, values.get(result, c).f32());
                for (&sum, &w) in row.iter().zip(&weights) {
                    k.fma_to(sum, w, v, sum);
                }
            }
        });
    }

    /// Combines the item lanes' sums and stores the accumulators (leader lane,
    /// channels and heads that exist).
    fn accumulate_store(&self, k: &mut Kernel, acc: &AccThread, block: Option<Reg<U32>>) {
        let plan = self.plan;
        let a = plan.accumulate;
        let acc_stride = plan.array_stride[self.m.value.accumulator.index()];
        for (c, (at, row)) in acc.acc.iter().enumerate() {
            for (j, &sum) in row.iter().enumerate() {
                let mut mask = a.item_lanes / 2;
                while mask > 0 {
                    let other = k.shfl_bfly(sum, mask);
                    k.add_to(sum, sum, other);
                    mask /= 2;
                }
                let conditions = [
                    acc.leader,
                    acc.valid[c],
                    self.head_ok(k, block, plan.head_block, j as u32),
                ];
                let at = Shared::at(*at).plus(i64::from(j as u32 * acc_stride));
                match all(k, &conditions) {
                    None => k.st_shared(at, sum),
                    Some(p) => k.guarded(p, true, |k| k.st_shared(at, sum)),
                }
            }
        }
    }

    /// The group's partial records: the epilogue output, m and l (or, for a
    /// split without pages, zeros, -inf and 0).
    fn write_partials(&self, k: &mut Kernel, filled: bool) {
        let plan = self.plan;
        let head_dim = self.m.head_dim;
        let layout = super::abi::PartialLayout::new(head_dim);
        let record_bytes = 4 * layout.record;
        let output = self.m.value.output.index();
        let out_stride = plan.array_stride[output];
        let out0 = filled.then(|| self.array_base(k, output));
        let zero = k.mov(0.0f32);
        let partials = k.ld_pointer(&self.p.partials);
        let q_row = self.q_row(k);
        let slot_count = k.ld_param(&self.p.slot_count);
        let slot_base = k.ld_param(&self.p.slot_base);
        let split = k.ctaid(Axis::X);
        let slot = k.add(slot_base, split);
        let record = |k: &mut Kernel, h: Reg<U32>| {
            let row = k.add(q_row, h);
            let index = k.mad_lo(row, slot_count, slot);
            k.global_index(partials, index, record_bytes)
        };
        let total = k.mul(self.group, head_dim);
        self.strided(k, self.tid, Op::Reg(total), plan.threads, |k, idx| {
            let (h, d) = divide(k, idx, head_dim);
            let value = match out0 {
                Some(base) => {
                    let head = k.mad_lo(h, out_stride, base);
                    let at = k.mad_lo(d, 4u32, head);
                    k.ld_shared::<F32>(Shared::at(at))
                }
                None => zero,
            };
            let rec = record(k, h);
            let at = k.global_index(rec, d, 4);
            k.st_global(Global::at(at), value);
        });
        let neg_inf = k.mov(f32::NEG_INFINITY);
        self.strided(k, self.tid, Op::Reg(self.group), plan.threads, |k, h| {
            let (m, l) = if filled {
                let state = k.mad_lo(h, 4u32, self.smem);
                (
                    k.ld_shared::<F32>(Shared::at(state).plus(plan.max.into())),
                    k.ld_shared::<F32>(Shared::at(state).plus(plan.sum.into())),
                )
            } else {
                (neg_inf, zero)
            };
            let rec = Global::at(record(k, h));
            k.st_global(rec.plus(4 * i64::from(layout.max_offset())), m);
            k.st_global(rec.plus(4 * i64::from(layout.sum_offset())), l);
        });
    }
}

/// `at` under an L2 policy that keeps its lines longest: the page lists and
/// queries, which every decode step (every layer, in serving) reads again,
/// where the pages stream through L2 once (docs/ptx-backend.md, round 24).
fn kept(k: &mut Kernel, at: Reg<U64>) -> Global {
    let keep = k.l2_policy(Evict::Last);
    Global::at(at).cached(keep)
}

/// One tile in shared memory.
struct Tile {
    buf: Reg<U32>,
    /// Address of the header's scale slot 0.
    header: Reg<U32>,
    /// Valid items of the tile.
    items: Reg<U32>,
    /// The tile's first item in its page (`None`: tiles are whole pages).
    first: Option<Reg<U32>>,
}

/// Most query loads a thread keeps in flight before storing them.
const QUERY_LOADS_IN_FLIGHT: u32 = 4;

/// A bulk copy: destination, source, bytes.
type BulkCopy = (Shared, BulkSource, Op<U32>);

/// Runs whose bytes continue the previous run's in both spaces, under the
/// same L2 policy, join it: each copy is a chain of dependent uniform
/// instructions on the issuing thread's path.
fn merge_runs(copies: Vec<BulkCopy>) -> Vec<BulkCopy> {
    let mut merged: Vec<BulkCopy> = Vec::with_capacity(copies.len());
    for copy in copies {
        if let (
            Some((dst, BulkSource::Run(src), Op::Imm(bytes))),
            (to, BulkSource::Run(from), Op::Imm(more)),
        ) = (merged.last_mut(), copy)
        {
            let end = i64::from(*bytes);
            if dst.base == to.base
                && dst.offset + end == to.offset
                && src.base == from.base
                && src.offset + end == from.offset
                && src.policy == from.policy
            {
                *bytes += more;
                continue;
            }
        }
        merged.push(copy);
    }
    merged
}

/// What of a tile a copy brings: the header goes with the keys.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Whole,
    Keys,
    Values,
}

/// Where a bulk copy reads: a run of bytes, or a box of a tensor map
/// (its generic address and the box's coordinates, innermost first).
#[derive(Clone, Copy)]
enum BulkSource {
    Run(Global),
    Box(Reg<U64>, [Reg<U32>; 4]),
}

impl Part {
    fn sides(self) -> &'static [Side] {
        match self {
            Part::Whole => &[Side::Key, Side::Value],
            Part::Keys => &[Side::Key],
            Part::Values => &[Side::Value],
        }
    }
}

/// How the accumulators take the tile's decay.
#[derive(Clone, Copy)]
enum Rescale {
    /// The softmax phase wrote every head's decay.
    Always,
    /// Only when the predicate holds (the fused softmax moved its reference).
    When(Reg<Pred>),
}

/// How far (in log2 units) a logit may exceed the softmax reference before
/// the reference moves: weights stay below 2^8.
const RESCALE_SLACK_BITS: f32 = 8.0;
/// [`RESCALE_SLACK_BITS`] in natural-log units.
const RESCALE_SLACK: f32 = RESCALE_SLACK_BITS * std::f32::consts::LN_2;

/// [`order_key`] of −∞.
const ORDER_KEY_NEG_INF: u32 = !0xFF80_0000;

/// The fused softmax's per-thread state ([`Skeleton::score_setup`]).
struct FusedScore {
    units: Vec<ScoreUnit>,
    logits: Logits,
}

impl FusedScore {
    /// Heads per unit: a split score's units are one-head units.
    fn head_block(&self, plan: &Plan) -> u32 {
        match self.logits {
            Logits::Program => plan.score_head_block,
            Logits::Split(_) => 1,
        }
    }
}

/// Where the units' logits come from.
enum Logits {
    /// The score program, per unit and head of its block.
    Program,
    /// The score split over lanes ([`ScoreSplit`]), one per unit.
    Split(SplitScore),
}

/// A split score's per-thread state ([`Skeleton::split_setup`]).
struct SplitScore {
    /// The part program's arrays at the lane's slice of its block.
    arrays: Vec<Option<ArrayAccess>>,
    /// The lane's query slice, in registers for the whole stream.
    preloaded: Preloaded,
    /// Bytes from an item to the lane's slice of it.
    lane_offset: Reg<U32>,
    /// `lane == l` per lane `l` of an item (index 0 unused).
    is_lane: Vec<Reg<Pred>>,
    /// The item of each unit the lanes compute together.
    part_items: Vec<Reg<U32>>,
}

/// One score unit a thread owns for the whole stream.
struct ScoreUnit {
    /// Score head block (`None`: there is one, and a valid unit is in it).
    block: Option<Reg<U32>>,
    /// Item of the tile.
    item: Reg<U32>,
    /// Whether the block holds one of the group's heads.
    block_ok: Reg<Pred>,
    /// The block's unit at item 0: it publishes the heads' reference and decay.
    first: Reg<Pred>,
    arrays: Vec<Option<ArrayAccess>>,
    /// Address of the unit's weights (the block's first head) in the logits rows.
    row: Reg<U32>,
    /// Address of the block's first tile-maximum slot.
    max_at: Reg<U32>,
    /// `smem + 4 · first head of the block` (softmax state arrays at offsets).
    state: Reg<U32>,
    /// Per head of the block: the softmax reference and this thread's partial sum.
    refs: Vec<Reg<F32>>,
    sums: Vec<Reg<F32>>,
}

impl ScoreUnit {
    /// A unit of one head (split scores): `head`'s logit of
    /// `item`, its weight at `row`, the head's tile maximum at `max_at` and
    /// softmax state at `state`.
    fn one_head(
        k: &mut Kernel,
        head: Reg<U32>,
        item: Reg<U32>,
        block_ok: Reg<Pred>,
        [row, max_at, state]: [Reg<U32>; 3],
    ) -> ScoreUnit {
        let at_zero = k.setp(Cmp::Eq, item, 0u32);
        let first = k.and_pred(at_zero, block_ok);
        ScoreUnit {
            block: Some(head),
            item,
            block_ok,
            first,
            arrays: Vec::new(),
            row,
            max_at,
            state,
            refs: vec![k.mov(f32::NEG_INFINITY)],
            sums: vec![k.mov(0.0f32)],
        }
    }
}

/// A thread's share of one accumulate round ([`Skeleton::accumulate_setup`]).
struct AccThread {
    lane: Option<Reg<U32>>,
    leader: Option<Reg<Pred>>,
    channels: Vec<Reg<U32>>,
    valid: Vec<Option<Reg<Pred>>>,
    /// Per channel: its accumulator's address (the block's first head) and
    /// one register per head of the block.
    acc: Vec<(Reg<U32>, Vec<Reg<F32>>)>,
    decay_block: Reg<U32>,
    logits_block: Reg<U32>,
}

/// An f32's bits as a u32 whose unsigned order is the floats' order (NaN
/// aside): sign set → all bits flipped, else the sign bit set.
fn order_key(k: &mut Kernel, x: Reg<F32>) -> Reg<U32> {
    let bits = k.bitcast::<F32, U32>(x);
    let negative = k.setp(Cmp::Ge, bits, 0x8000_0000u32);
    let flipped = k.xor(bits, 0xFFFF_FFFFu32);
    let signed = k.or(bits, 0x8000_0000u32);
    k.selp(flipped, signed, negative)
}

/// The inverse of [`order_key`].
fn from_order_key(k: &mut Kernel, key: Reg<U32>) -> Reg<F32> {
    let positive = k.setp(Cmp::Ge, key, 0x8000_0000u32);
    let cleared = k.xor(key, 0x8000_0000u32);
    let flipped = k.xor(key, 0xFFFF_FFFFu32);
    let bits = k.selp(cleared, flipped, positive);
    k.bitcast::<U32, F32>(bits)
}

/// Shared arrays a program reads.
fn shared_reads(exprs: &Arena<Expr>) -> HashSet<usize> {
    exprs
        .iter()
        .filter_map(|(_, e)| match *e {
            Expr::Shared { array, .. } => Some(array.index()),
            _ => None,
        })
        .collect()
}

/// Arrays a stage reads or writes.
fn stage_arrays(stage: &Stage) -> HashSet<usize> {
    let mut used = shared_reads(&stage.exprs);
    used.extend(stage.stores.iter().map(|s| s.array.index()));
    used
}

/// `(idx / n, idx % n)` as quotient and `idx - quotient * n`.
fn divide(k: &mut Kernel, idx: Reg<U32>, n: impl Into<Op<U32>> + Copy) -> (Reg<U32>, Reg<U32>) {
    let q = k.div_u32(idx, n);
    let whole = k.mul(q, n);
    (q, k.sub(idx, whole))
}

/// The conjunction of the present conditions (`None`: no condition).
fn all(k: &mut Kernel, conditions: &[Option<Reg<Pred>>]) -> Option<Reg<Pred>> {
    conditions
        .iter()
        .flatten()
        .copied()
        .reduce(|a, b| k.and_pred(a, b))
}
