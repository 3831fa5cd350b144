//! The accumulate phase on the CUDA cores: threads own value channels for a
//! block of heads and add each item's decoded value times its softmax
//! weights, so each value code is decoded once for all of the block's heads.

use super::super::builder::{Cmp, Kernel, Op, Pred, Reg, Shared, F32, U32};
use super::super::expr::{self, Env, ItemSource, Replicas};
use super::cta::{all, divide, Cta, Rescale, Tile};

/// The accumulate phase.
#[derive(Clone, Copy)]
pub(super) struct Accumulate<'a> {
    pub(super) cta: &'a Cta<'a>,
}

impl Accumulate<'_> {
    /// `acc[h][c] = acc[h][c] * decay[h] + Σ_i p[h][i] · v_i[c]` for the tile,
    /// with the accumulators in shared memory between tiles (several passes
    /// of channels or head blocks).
    pub(super) fn tile(&self, k: &mut Kernel, tile: &Tile, rescale: Rescale) {
        let plan = self.cta.plan;
        let a = plan.accumulate;
        let passes = plan.head_blocks * a.channel_passes;
        let r = k.mov(0u32);
        let (top, end) = (k.label(), k.label());
        k.place(top);
        let (block, pass) = match (plan.head_blocks > 1, a.channel_passes > 1) {
            (false, false) => (None, None),
            (true, false) => (Some(r), None),
            (false, true) => (None, Some(r)),
            (true, true) => {
                let (b, cr) = divide(k, r, a.channel_passes);
                (Some(b), Some(cr))
            }
        };
        if let Some(b) = block {
            // Passes go block by block: past the group's last head, stop.
            let first_head = k.mul(b, plan.head_block);
            let past = k.setp(Cmp::Ge, first_head, self.cta.group);
            k.bra_if(past, true, end);
        }
        let acc = self.setup(k, block, pass);
        // This pass's accumulators, rescaled by the tile's decay.
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
        let acc_stride = plan.array_stride[self.cta.m.value.accumulator.index()];
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
        self.items(k, tile, &acc, None);
        self.store(k, &acc, block);
        if passes > 1 {
            k.add_to(r, r, 1u32);
            let again = k.setp(Cmp::Lt, r, passes);
            k.bra_if(again, true, top);
        }
        k.place(end);
    }

    /// A thread's channels of one accumulate pass and their accumulator
    /// registers (zero): of pass `pass` of head block `block` (`None`: the
    /// only one).
    pub(super) fn setup(
        &self,
        k: &mut Kernel,
        block: Option<Reg<U32>>,
        pass: Option<Reg<U32>>,
    ) -> AccThread {
        let plan = self.cta.plan;
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
            (self.cta.tid, None, None)
        } else {
            let slot = k.shr(self.cta.tid, a.item_lanes.trailing_zeros());
            let lane = k.and(self.cta.tid, a.item_lanes - 1);
            let leader = k.setp(Cmp::Eq, lane, 0u32);
            (slot, Some(lane), Some(leader))
        };
        let acc_index = self.cta.m.value.accumulator.index();
        let acc0 = self.cta.array_base(k, acc_index);
        let acc_stride = plan.array_stride[acc_index];
        let decay0 = k.add(self.cta.smem, plan.decay);
        let logits0 = k.add(self.cta.smem, plan.logits);
        let units = plan.dims / a.pack;
        let span = a.channels * a.slots;
        let may_overrun = span * a.channel_passes > units;
        let first_unit = match pass {
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
    pub(super) fn items(
        &self,
        k: &mut Kernel,
        tile: &Tile,
        acc: &AccThread,
        rescale: Option<Rescale>,
    ) {
        let plan = self.cta.plan;
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
        let tables = self.cta.staged_tables(k);
        let items_base = k.add(tile.buf, plan.value.buffer_offset);
        let row_bytes = 4 * plan.head_stride;
        let start = acc.lane.unwrap_or_else(|| k.mov(0u32));
        let items = Op::Reg(tile.items);
        self.cta
            .strided_unrolled(k, start, items, a.item_lanes, a.item_unroll, |k, i| {
                let item = k.mad_lo(i, plan.value.shared_stride, items_base);
                let replicas = Replicas::Channels {
                    channels: &acc.channels,
                    pack: a.pack,
                    ranges: &self.cta.info.accumulate.ranges,
                };
                let item = ItemSource {
                    base: item,
                    align: plan.value.align(),
                };
                let env = Env::per_item(replicas, &[], &tables, tile.header, item);
                let program = &self.cta.m.value.accumulate;
                let values = expr::emit(k, &program.exprs, &env);
                let result = program.result.expect("validated functions return");
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
    pub(super) fn store(&self, k: &mut Kernel, acc: &AccThread, block: Option<Reg<U32>>) {
        let plan = self.cta.plan;
        let a = plan.accumulate;
        let acc_stride = plan.array_stride[self.cta.m.value.accumulator.index()];
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
                    self.cta.head_ok(k, block, plan.head_block, j as u32),
                ];
                let at = Shared::at(*at).plus(i64::from(j as u32 * acc_stride));
                match all(k, &conditions) {
                    None => k.st_shared(at, sum),
                    Some(p) => k.guarded(p, true, |k| k.st_shared(at, sum)),
                }
            }
        }
    }
}

/// A thread's share of one accumulate pass ([`Accumulate::setup`]).
pub(super) struct AccThread {
    pub(super) lane: Option<Reg<U32>>,
    pub(super) leader: Option<Reg<Pred>>,
    pub(super) channels: Vec<Reg<U32>>,
    pub(super) valid: Vec<Option<Reg<Pred>>>,
    /// Per channel: its accumulator's address (the block's first head) and
    /// one register per head of the block.
    pub(super) acc: Vec<(Reg<U32>, Vec<Reg<F32>>)>,
    pub(super) decay_block: Reg<U32>,
    pub(super) logits_block: Reg<U32>,
}
