//! The score split over lanes: which dot products split, into which shape,
//! and what each shape is estimated to cost.

use super::*;

/// A key element's decoding (its shared-memory load and conversion) against
/// one fma: shared memory serves a quarter as many words a cycle as the SM
/// issues fmas, so splits over fewer heads (each key decoded more often) lose
/// (a 64-dim f32 key in 8-head groups: 4 heads a split 1.5× faster than 2).
pub(super) const SPLIT_DECODE_COST: u32 = 4;
/// Smallest tile [`Plan::sized`] tries for a cheaper split score.
pub(super) const SPLIT_MIN_TILE_ITEMS: u32 = 16;
/// A tile's fixed instructions per thread beside the split score's
/// (barriers, the tile maxima, the page's wait), for comparing tile sizes.
pub(super) const SPLIT_TILE_OVERHEAD: u32 = 64;

/// A split score's estimated instructions per thread and item, counting
/// the tile's fixed cost; infinite without a split (a tile that loses the
/// split is not compared).
pub(super) fn split_cost_per_item(plan: &Plan) -> f64 {
    match &plan.score_split {
        Some(split) => f64::from(split.cost + SPLIT_TILE_OVERHEAD) / f64::from(plan.tile_items),
        None => f64::INFINITY,
    }
}

/// Query elements per thread a split score keeps in registers.
pub(super) const SPLIT_QUERY_REGISTERS: u32 = 64;
/// Logits a split score's thread keeps per tile (units × heads).
pub(super) const SPLIT_LOGITS: u32 = 16;

/// The score split over lanes: `lanes` adjacent threads share
/// an item, each computing the dot product's terms of its slice of the
/// dimensions for `head_block` heads with that slice of the queries held in
/// registers for the whole stream (loaded once, not per item), then a
/// butterfly sums the lanes' partials and lane `j < head_block` owns head
/// `j`'s logit for the fused softmax. A thread's units share one head block
/// (so one query slice): lane group `g = tid / lanes` serves block
/// `g / per_block` and items `g % per_block + u · per_block`.
#[derive(Debug, Clone)]
pub struct ScoreSplit {
    pub lanes: u32,
    pub head_block: u32,
    /// Lane groups per head block, and units (items) per thread.
    pub per_block: u32,
    pub units: u32,
    pub part: super::super::lane_split::LaneSplit,
    /// Estimated instructions per thread and tile.
    pub cost: u32,
}

/// A split when the score is a dot product whose lanes' slices of shared
/// reads are all at constant indices (the query of a dense key) and fit
/// [`SPLIT_QUERY_REGISTERS`]; among the shapes that tile the items evenly,
/// the one with the fewest estimated instructions per thread and tile.
pub(super) fn score_split(
    module: &Module,
    threads: u32,
    group_max: u32,
    head_block: u32,
    tile_items: u32,
) -> Option<ScoreSplit> {
    let score = &module.key.score;
    let mut best: Option<ScoreSplit> = None;
    for hb in (1..=head_block).filter(|h| head_block.is_multiple_of(*h)) {
        if !group_max.is_multiple_of(hb) || !hb.is_power_of_two() {
            continue;
        }
        let blocks = group_max / hb;
        for lanes in [2u32, 4, 8, 16, 32] {
            if hb > lanes || !threads.is_multiple_of(lanes) {
                continue;
            }
            let groups = threads / lanes;
            if !groups.is_multiple_of(blocks) {
                continue;
            }
            let per_block = groups / blocks;
            if !tile_items.is_multiple_of(per_block) {
                continue;
            }
            let units = tile_items / per_block;
            // The lanes' logits spread evenly over the lanes.
            if units * hb > SPLIT_LOGITS || !(units * hb).is_multiple_of(lanes) {
                continue;
            }
            let Some(part) = super::super::lane_split::lane_split(score, lanes) else {
                continue;
            };
            if !part.constant_reads
                || hb * super::super::lane_split::preloaded_elements(&part.program.exprs)
                    > SPLIT_QUERY_REGISTERS
            {
                continue;
            }
            // Per unit: the part's key decoding once, its terms per head,
            // a butterfly per head; per owned logit a selection and the softmax.
            let terms = part.terms / lanes;
            let cost = units
                * (SPLIT_DECODE_COST * terms + terms * hb + 2 * hb * lanes.trailing_zeros())
                + units * hb / lanes * (lanes + 20);
            if best.as_ref().is_none_or(|s| cost < s.cost) {
                best = Some(ScoreSplit {
                    lanes,
                    head_block: hb,
                    per_block,
                    units,
                    part,
                    cost,
                });
            }
        }
    }
    best
}

/// Whether quads of channels beat pairs for an accumulate program: every
/// item field whose offset depends on the channel gives a quad one naturally
/// aligned load of 32 or 64 bits (f16 or 8-bit fields; the item's alignment
/// permitting), and no division, remainder or right shift of a channel value
/// (mosaic's `channel / 2`: uniform over a pair, not over a quad, so its whole
/// bitmap chain would run per channel). Measured on an H200 (32K context):
/// quads 3-7% faster on dense f16, spherical and subspace; pairs kept on kivi
/// int8 (130-byte items: no aligned word, +7% with quads), kivi int4 (4-bit
/// fields, one halfword per quad, +0.6%) and mosaic (+19%).
pub(super) fn quads_pay(exprs: &crate::ir::Arena<Expr>, align: u32) -> bool {
    use crate::ir::BinaryOp;
    let varies = channel_dependent(exprs);
    exprs.iter().all(|(_, expr)| {
        let operand_varies = operands(expr).iter().any(|h| varies[h.index()]);
        match *expr {
            Expr::Binary {
                op: BinaryOp::Divide | BinaryOp::Modulo | BinaryOp::ShiftRight,
                ..
            } => !operand_varies,
            Expr::ItemBits { width, .. } if operand_varies => {
                let quad = 4 * u32::from(width);
                (32..=64).contains(&quad) && align >= quad / 8
            }
            _ => true,
        }
    })
}

/// Whether octets of channels (where quads pay) are one 128-bit load: every
/// channel-dependent item field is an f16 (or 16-bit) field and items are
/// 16-byte aligned. Half the weight loads per channel of a quad and one
/// `ld.shared.v4` for 8 values.
pub(super) fn octets_pay(exprs: &crate::ir::Arena<Expr>, align: u32) -> bool {
    let varies = channel_dependent(exprs);
    exprs.iter().all(|(_, expr)| match *expr {
        Expr::ItemBits { width, bit_offset } if varies[bit_offset.index()] => {
            width == 16 && align >= 16
        }
        _ => true,
    })
}

/// Per expression: whether its value depends on the channel.
pub(super) fn channel_dependent(exprs: &crate::ir::Arena<Expr>) -> Vec<bool> {
    depends_on(exprs, |e| {
        matches!(e, Expr::Input(crate::ir::Input::Channel))
    })
}

/// Octets: see [`octets_pay`]; the partition falls back to quads where the
/// head block leaves no room for 8 × its accumulators.
pub(super) const OCTET: u32 = 8;

/// Adjacent channels per accumulate unit (at most; fewer where the channels
/// do not split evenly or the head block leaves no room for that many times
/// the accumulators). Quads: with the accumulators in registers across tiles
/// the item lanes' final shuffles are once per CTA, and a quad halves the
/// weight loads per channel of a pair.
pub(super) const PACK: u32 = 4;

/// Splits `dims` channels × `head_block` heads over `threads` (see [`Accumulate`]).
pub(super) fn partition(
    threads: u32,
    dims: u32,
    head_block: u32,
    pack: u32,
    max_accumulators: u32,
) -> Accumulate {
    // The largest power of two up to `pack` that divides the channels and
    // leaves room for the accumulators.
    let pack = (0..=pack.trailing_zeros())
        .rev()
        .map(|z| 1 << z)
        .find(|&p| dims.is_multiple_of(p) && p * head_block <= max_accumulators)
        .unwrap_or(1);
    let units = dims / pack;
    if units >= threads {
        let channels = units
            .div_ceil(threads)
            .min((max_accumulators / (head_block * pack)).max(1));
        Accumulate {
            item_lanes: 1,
            slots: threads,
            pack,
            channels,
            channel_passes: units.div_ceil(threads * channels),
            item_unroll: (LOADS_IN_FLIGHT / channels).max(1),
        }
    } else {
        let lanes = (threads / units).min(32);
        let item_lanes = 1 << (31 - lanes.leading_zeros());
        let slots = threads / item_lanes;
        Accumulate {
            item_lanes,
            slots,
            pack,
            channels: 1,
            channel_passes: units.div_ceil(slots),
            item_unroll: LOADS_IN_FLIGHT,
        }
    }
}

pub(super) fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

pub(super) fn lcm(a: u32, b: u32) -> u32 {
    a / gcd(a, b) * b
}
