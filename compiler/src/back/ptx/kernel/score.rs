//! The score phase on the CUDA cores: the key program's logits of a tile's
//! items for the group's heads, per (item, head block) work unit, or with
//! the dot product split over adjacent lanes ([`ScoreSplit`]).

use super::super::builder::{Cmp, Kernel, Op, Pred, Reg, Shared, F32, U32};
use super::super::expr::{self, ArrayAccess, Env, ItemSource, Preloaded, Replicas, TableAccess};
use super::super::plan::{Plan, ScoreSplit};
use super::cta::{divide, Cta, Tile};
use crate::proc::shared_reads;

/// The score phase.
#[derive(Clone, Copy)]
pub(super) struct Score<'a> {
    pub(super) cta: &'a Cta<'a>,
}

impl Score<'_> {
    /// Per-thread state of the fused softmax: each thread owns the score units
    /// `tid + u·threads` (`u < score_units`), unit `idx` being item
    /// `idx % tile_items` of score head block `idx / tile_items`, for the
    /// whole stream. Computed once before the page loop.
    pub(super) fn setup(&self, k: &mut Kernel) -> FusedScore {
        let plan = self.cta.plan;
        if let Some(split) = &plan.score_split {
            return self.split_setup(k, split);
        }
        let hb = plan.score_head_block;
        k.comment(&format!(
            "fused softmax: {} score unit(s) of {hb} head(s) per thread",
            plan.score_units
        ));
        let bases = self
            .cta
            .array_bases(k, shared_reads(&self.cta.m.key.score.exprs));
        let logits = k.add(self.cta.smem, plan.logits);
        let tile_max = k.add(self.cta.smem, plan.tile_max);
        let row_bytes = 4 * plan.head_stride;
        let neg_inf = k.mov(f32::NEG_INFINITY);
        let zero = k.mov(0.0f32);
        let units = (0..plan.score_units)
            .map(|u| {
                let idx = match u {
                    0 => self.cta.tid,
                    _ => k.add(self.cta.tid, u * plan.threads),
                };
                let (block, item) = divide(k, idx, plan.tile_items);
                let block_ok = k.setp(Cmp::Lt, block, self.cta.score_blocks);
                let at_zero = k.setp(Cmp::Eq, item, 0u32);
                let first = k.and_pred(at_zero, block_ok);
                let arrays = self.block_arrays(k, &bases, Some(block), hb);
                let row = k.mad_lo(item, row_bytes, logits);
                let row = k.mad_lo(block, hb * 4, row);
                let max_at = k.mad_lo(block, hb * 4, tile_max);
                let state = match plan.score_head_blocks {
                    1 => self.cta.smem,
                    _ => k.mad_lo(block, hb * 4, self.cta.smem),
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

    /// [`Score::setup`] for a score split over lanes ([`ScoreSplit`]):
    /// each thread's units are items of one head block, and after the lanes'
    /// butterfly the `lanes` logits (units × heads) of each run of
    /// `lanes / head_block` units are spread over the lanes, lane
    /// `a · head_block + j` owning head `block · head_block + j` of the run's
    /// unit `a`: the thread's softmax slots are one-head units of that head. The thread's slice of the
    /// block's queries is loaded into registers here, once.
    pub(super) fn split_setup(&self, k: &mut Kernel, split: &ScoreSplit) -> FusedScore {
        let plan = self.cta.plan;
        let (lanes, hb) = (split.lanes, split.head_block);
        k.comment(&format!(
            "fused softmax, score split over {lanes} lanes: {} unit(s) of {hb} head(s) per thread, queries in registers",
            split.units
        ));
        let lane = k.and(self.cta.tid, lanes - 1);
        let g = k.shr(self.cta.tid, lanes.trailing_zeros());
        let (block, first_item) = divide(k, g, split.per_block);
        // Lane `a · hb + j` owns head j of the units `v · (lanes / hb) + a`.
        let owners = lanes / hb;
        let j = k.and(lane, hb - 1);
        let a = k.shr(lane, hb.trailing_zeros());
        let head = k.mad_lo(block, hb, j);
        let block_ok = k.setp(Cmp::Lt, head, self.cta.group);
        let program = &split.part.program;
        let reads = shared_reads(&program.exprs);
        let arrays: Vec<Option<ArrayAccess>> = (self.cta.m.arrays.iter())
            .map(|(a, _)| {
                reads.contains(&a).then(|| {
                    let a = a.index();
                    let base = self.cta.array_base(k, a);
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
        let logits = k.add(self.cta.smem, plan.logits);
        let tile_max = k.add(self.cta.smem, plan.tile_max);
        let row_bytes = 4 * plan.head_stride;
        let column = k.mad_lo(head, 4u32, logits);
        let max_at = k.mad_lo(head, 4u32, tile_max);
        let state = k.mad_lo(head, 4u32, self.cta.smem);
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

    /// The score program's arrays for the heads of `hb`-head block `block`
    /// (`None`: block 0), from their bases for head 0.
    pub(super) fn block_arrays(
        &self,
        k: &mut Kernel,
        bases: &[Option<Reg<U32>>],
        block: Option<Reg<U32>>,
        hb: u32,
    ) -> Vec<Option<ArrayAccess>> {
        let plan = self.cta.plan;
        (bases.iter().enumerate())
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
            .collect()
    }

    /// The split score's logits of a tile, one per unit (of the head the
    /// thread's lane owns; unscaled). Every unit is computed whether or not
    /// its item is in the tile (items past the tile's end read stale bytes of
    /// the buffer, and their logits are never used), so the units have no
    /// branches between them and their loads and chains interleave; the
    /// lanes of an item then sum their partials with a butterfly.
    pub(super) fn split_logits(
        &self,
        k: &mut Kernel,
        tile: &Tile,
        sp: &SplitScore,
        tables: &[Option<TableAccess>],
    ) -> Vec<Reg<F32>> {
        let plan = self.cta.plan;
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
                preloaded: Some(&sp.preloaded),
                ..Env::per_item(
                    Replicas::Heads(split.head_block),
                    &sp.arrays,
                    tables,
                    tile.header,
                    ItemSource { base: item, align },
                )
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

    /// Tables as the per-item programs see them: staged in shared memory.
    /// The score program on the key item at shared address `item`: one
    /// unscaled logit per head of the `hb`-head block.
    pub(super) fn item_scores(
        &self,
        k: &mut Kernel,
        item: Reg<U32>,
        arrays: &[Option<ArrayAccess>],
        tables: &[Option<TableAccess>],
        header: Reg<U32>,
        hb: u32,
    ) -> Vec<Reg<F32>> {
        let item = ItemSource {
            base: item,
            align: self.cta.plan.key.align(),
        };
        let env = Env::per_item(Replicas::Heads(hb), arrays, tables, header, item);
        let program = &self.cta.m.key.score;
        let values = expr::emit(k, &program.exprs, &env);
        let result = program.result.expect("validated functions return");
        (0..hb as usize)
            .map(|j| expr::materialize_f32(k, values.get(result, j).f32()))
            .collect()
    }

    /// Logits of every (item, head) of the tile, times the softmax scale.
    pub(super) fn tile(&self, k: &mut Kernel, tile: &Tile) {
        let plan = self.cta.plan;
        let hb = plan.score_head_block;
        k.comment(&format!(
            "score: work units (item, block of {hb} head(s)), items fastest"
        ));
        let tables = self.cta.staged_tables(k);
        let bases = self
            .cta
            .array_bases(k, shared_reads(&self.cta.m.key.score.exprs));
        let items_base = k.add(tile.buf, plan.key.buffer_offset);
        let logits = k.add(self.cta.smem, plan.logits);
        let work = if plan.score_head_blocks == 1 {
            tile.items
        } else {
            k.mul(tile.items, self.cta.score_blocks)
        };
        let row_bytes = 4 * plan.head_stride;
        let scale = k.ld_param(&self.cta.p.softmax_scale);
        self.cta
            .strided(k, self.cta.tid, Op::Reg(work), plan.threads, |k, idx| {
                let (block, i) = if plan.score_head_blocks == 1 {
                    (None, idx)
                } else {
                    let (b, i) = divide(k, idx, tile.items);
                    (Some(b), i)
                };
                let arrays = self.block_arrays(k, &bases, block, hb);
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
                    match self.cta.head_ok(k, block, hb, j) {
                        None => k.st_shared(at, logit),
                        Some(ok) => k.guarded(ok, true, |k| k.st_shared(at, logit)),
                    }
                }
            });
    }
}

/// The fused softmax's per-thread state ([`Score::setup`]).
pub(super) struct FusedScore {
    pub(super) units: Vec<ScoreUnit>,
    pub(super) logits: Logits,
}

impl FusedScore {
    /// Heads per unit: a split score's units are one-head units.
    pub(super) fn head_block(&self, plan: &Plan) -> u32 {
        match self.logits {
            Logits::Program => plan.score_head_block,
            Logits::Split(_) => 1,
        }
    }
}

/// Where the units' logits come from.
pub(super) enum Logits {
    /// The score program, per unit and head of its block.
    Program,
    /// The score split over lanes ([`ScoreSplit`]), one per unit.
    Split(SplitScore),
}

/// A split score's per-thread state ([`Score::split_setup`]).
pub(super) struct SplitScore {
    /// The part program's arrays at the lane's slice of its block.
    pub(super) arrays: Vec<Option<ArrayAccess>>,
    /// The lane's query slice, in registers for the whole stream.
    pub(super) preloaded: Preloaded,
    /// Bytes from an item to the lane's slice of it.
    pub(super) lane_offset: Reg<U32>,
    /// `lane == l` per lane `l` of an item (index 0 unused).
    pub(super) is_lane: Vec<Reg<Pred>>,
    /// The item of each unit the lanes compute together.
    pub(super) part_items: Vec<Reg<U32>>,
}

/// One score unit a thread owns for the whole stream.
pub(super) struct ScoreUnit {
    /// Score head block (`None`: there is one, and a valid unit is in it).
    pub(super) block: Option<Reg<U32>>,
    /// Item of the tile.
    pub(super) item: Reg<U32>,
    /// Whether the block holds one of the group's heads.
    pub(super) block_ok: Reg<Pred>,
    /// The block's unit at item 0: it publishes the heads' reference and decay.
    pub(super) first: Reg<Pred>,
    pub(super) arrays: Vec<Option<ArrayAccess>>,
    /// Address of the unit's weights (the block's first head) in the logits rows.
    pub(super) row: Reg<U32>,
    /// Address of the block's first tile-maximum slot.
    pub(super) max_at: Reg<U32>,
    /// `smem + 4 · first head of the block` (softmax state arrays at offsets).
    pub(super) state: Reg<U32>,
    /// Per head of the block: the softmax reference and this thread's partial sum.
    pub(super) refs: Vec<Reg<F32>>,
    pub(super) sums: Vec<Reg<F32>>,
}

impl ScoreUnit {
    /// A unit of one head (split scores): `head`'s logit of
    /// `item`, its weight at `row`, the head's tile maximum at `max_at` and
    /// softmax state at `state`.
    pub(super) fn one_head(
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
