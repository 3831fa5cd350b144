//! The online softmax on the CUDA cores: as a phase of its own (one warp per
//! head over the tile's logits) or fused into the score (each thread keeps
//! its units' reference and partial sums, and only a tile that moves the
//! reference pays for a reduction).

use super::super::builder::{Cmp, Kernel, Op, Pred, Reg, Shared, F32, U32};
use super::cta::{Cta, Tile};
use super::score::{FusedScore, Logits, Score};

/// The softmax phase, and the score it may be fused into.
#[derive(Clone, Copy)]
pub(super) struct Softmax<'a> {
    pub(super) cta: &'a Cta<'a>,
    pub(super) score: Score<'a>,
}

impl Softmax<'_> {
    /// Online softmax of the tile, one warp per head: new max, weights
    /// exp(s - m) in place of the logits, rescale factor and running sum.
    pub(super) fn tile(&self, k: &mut Kernel, items: Reg<U32>) {
        let plan = self.cta.plan;
        k.comment("softmax: one warp per head");
        let row_bytes = 4 * plan.head_stride;
        self.cta.per_head_warps(k, |k, h, lane, column| {
            let neg_inf = k.mov(f32::NEG_INFINITY);
            let best = k.mov(neg_inf);
            self.cta.strided(k, lane, Op::Reg(items), 32, |k, i| {
                let at = k.mad_lo(i, row_bytes, column);
                let s = k.ld_shared::<F32>(Shared::at(at));
                let larger = k.max(best, s);
                k.assign(best, larger);
            });
            self.cta.warp_reduce(k, best, |k, a, b| k.max(a, b));
            let state = k.mad_lo(h, 4u32, self.cta.smem);
            let old = k.ld_shared::<F32>(Shared::at(state).plus(plan.max.into()));
            let new = k.max(old, best);
            let decay = k.exp_diff(old, new);
            let total = k.mov(0.0f32);
            self.cta.strided(k, lane, Op::Reg(items), 32, |k, i| {
                let at = k.mad_lo(i, row_bytes, column);
                let s = k.ld_shared::<F32>(Shared::at(at));
                let w = k.exp_diff(s, new);
                k.st_shared(Shared::at(at), w);
                k.add_to(total, total, w);
            });
            self.cta.warp_reduce(k, total, |k, a, b| k.add(a, b));
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
    pub(super) fn fused(&self, k: &mut Kernel, tile: &Tile, fused: &FusedScore) -> Reg<Pred> {
        let plan = self.cta.plan;
        // A split score's units are one-head units of the lane's head.
        let hb = fused.head_block(plan);
        k.comment("score and softmax weights, against the running reference");
        let tables = self.cta.staged_tables(k);
        let unit_logits = match &fused.logits {
            Logits::Program => None,
            Logits::Split(sp) => Some(self.score.split_logits(k, tile, sp, &tables)),
        };
        let items_base = k.add(tile.buf, plan.key.buffer_offset);
        let scale = k.ld_param(&self.cta.p.softmax_scale);
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
                let scores =
                    self.score
                        .item_scores(k, item, &unit.arrays, &tables, tile.header, hb);
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
                match self.cta.head_ok(k, unit.block, hb, j) {
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
                let ok = match self.cta.head_ok(k, unit.block, hb, j) {
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
                let head = self.cta.head_ok(k, unit.block, hb, j);
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
    pub(super) fn finish(&self, k: &mut Kernel, fused: &FusedScore) {
        let plan = self.cta.plan;
        let hb = fused.head_block(plan);
        k.comment("the softmax sums: partial sums by (item, head), then one warp per head");
        for unit in &fused.units {
            for j in 0..hb {
                let at = Shared::at(unit.row).plus(i64::from(4 * j));
                let sum = unit.sums[j as usize];
                let store = match self.cta.head_ok(k, unit.block, hb, j) {
                    None => unit.block_ok,
                    Some(head) => k.and_pred(head, unit.block_ok),
                };
                k.guarded(store, true, |k| k.st_shared(at, sum));
            }
        }
        k.bar_sync();
        let row_bytes = 4 * plan.head_stride;
        self.cta.per_head_warps(k, |k, h, lane, column| {
            let total = k.mov(0.0f32);
            self.cta
                .strided(k, lane, Op::Imm(plan.tile_items), 32, |k, i| {
                    let at = k.mad_lo(i, row_bytes, column);
                    let s = k.ld_shared::<F32>(Shared::at(at));
                    k.add_to(total, total, s);
                });
            self.cta.warp_reduce(k, total, |k, a, b| k.add(a, b));
            let leader = k.setp(Cmp::Eq, lane, 0u32);
            let state = k.mad_lo(h, 4u32, self.cta.smem);
            k.guarded(leader, true, |k| {
                k.st_shared(Shared::at(state).plus(plan.sum.into()), total)
            });
        });
        k.bar_sync();
    }
}

/// How far (in log2 units) a logit may exceed the softmax reference before
/// the reference moves: weights stay below 2^8.
pub(super) const RESCALE_SLACK_BITS: f32 = 8.0;

/// [`RESCALE_SLACK_BITS`] in natural-log units.
pub(super) const RESCALE_SLACK: f32 = RESCALE_SLACK_BITS * std::f32::consts::LN_2;

/// [`order_key`] of −∞.
pub(super) const ORDER_KEY_NEG_INF: u32 = !0xFF80_0000;

/// An f32's bits as a u32 whose unsigned order is the floats' order (NaN
/// aside): sign set → all bits flipped, else the sign bit set.
pub(super) fn order_key(k: &mut Kernel, x: Reg<F32>) -> Reg<U32> {
    let bits = k.bitcast::<F32, U32>(x);
    let negative = k.setp(Cmp::Ge, bits, 0x8000_0000u32);
    let flipped = k.xor(bits, 0xFFFF_FFFFu32);
    let signed = k.or(bits, 0x8000_0000u32);
    k.selp(flipped, signed, negative)
}

/// The inverse of [`order_key`].
pub(super) fn from_order_key(k: &mut Kernel, key: Reg<U32>) -> Reg<F32> {
    let positive = k.setp(Cmp::Ge, key, 0x8000_0000u32);
    let cleared = k.xor(key, 0x8000_0000u32);
    let flipped = k.xor(key, 0xFFFF_FFFFu32);
    let bits = k.selp(cleared, flipped, positive);
    k.bitcast::<U32, F32>(bits)
}
