//! The flash-decoding kernel of one tier, phase by phase (docs/ptx-backend.md,
//! Kernel design).
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
//!
//! Each phase is a type of its own that borrows the CTA's state ([`cta`]):
//! [`staging`] (copies, page lists, mbarriers), [`heads`] (queries, prologue,
//! epilogue), [`score`] and [`softmax`] (CUDA cores), [`accumulate`],
//! [`score_mma`], [`accumulate_mma`] and [`warp_tile`] (tensor cores, with
//! [`fragments`], [`gather`], [`expand`] and [`lookup`] for their operands) and
//! [`partials`]. This module sequences them.

use super::abi::SHARED_SYMBOL;
use super::builder::{Axis, Cmp, Kernel, Shared, U32};
use super::plan::Plan;
use crate::valid::ValidModule;

use accumulate::Accumulate;
use accumulate_mma::AccumulateMma;
use cta::{declare, kept, Cta, Params, Rescale, Tile, HEADER_SLOT0};
use expand::Expand;
use fragments::Fragments;
use heads::Heads;
use lookup::Lookups;
use partials::Partials;
use score::Score;
use score_mma::ScoreMma;
use softmax::Softmax;
use staging::{Pages, Part, Staging};
use warp_tile::WarpTile;

mod accumulate;
mod accumulate_mma;
mod cta;
mod expand;
mod fragments;
mod gather;
mod heads;
mod lookup;
mod page_fragments;
mod partials;
mod queries;
mod score;
mod score_mma;
mod softmax;
mod staging;
mod value_fragments;
mod warp_tile;

/// The decode kernel of one tier.
pub fn decode(module: &ValidModule, plan: &Plan, name: &str) -> String {
    let mut k = Kernel::new(name, plan.threads, SHARED_SYMBOL);
    let p = declare(&mut k);
    let (cta, pages) = setup(&mut k, module, plan, &p);
    let cta = &cta;
    let frag = Fragments { cta };
    let score = Score { cta };
    let score_mma = ScoreMma { cta, frag };
    let acc_mma = AccumulateMma { cta, frag };
    let decode = Decode {
        cta,
        staging: Staging { cta, pages },
        heads: Heads { cta },
        score,
        softmax: Softmax { cta, score },
        accumulate: Accumulate { cta },
        partials: Partials { cta },
        score_mma,
        acc_mma,
        warp_tile: WarpTile {
            cta,
            frag,
            score_mma,
            acc_mma,
        },
        expand: Expand { cta, frag },
        lookup: Lookups { cta },
    };
    decode.run(&mut k);
    k.finish()
}

/// The kernel's entry: the CTA's registers and its split's pages.
fn setup<'a>(
    k: &mut Kernel,
    module: &'a ValidModule,
    plan: &'a Plan,
    p: &'a Params,
) -> (Cta<'a>, Pages) {
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
    let cta = Cta {
        m,
        info: module.info(),
        plan,
        p,
        tid,
        group,
        score_blocks,
        smem,
    };
    let pages = Pages {
        pool,
        page_ids,
        first,
        tiles,
    };
    (cta, pages)
}

/// The phases of the kernel, which [`Decode::run`] sequences.
struct Decode<'a> {
    cta: &'a Cta<'a>,
    staging: Staging<'a>,
    heads: Heads<'a>,
    score: Score<'a>,
    softmax: Softmax<'a>,
    accumulate: Accumulate<'a>,
    partials: Partials<'a>,
    score_mma: ScoreMma<'a>,
    acc_mma: AccumulateMma<'a>,
    warp_tile: WarpTile<'a>,
    expand: Expand<'a>,
    lookup: Lookups<'a>,
}

impl Decode<'_> {
    fn run(&self, k: &mut Kernel) {
        let plan = self.cta.plan;
        // Before the page count is known: its barrier waits out the page
        // offsets' load latency instead of adding to it.
        self.staging.init_barriers(k);
        let empty = k.label();
        let none = k.setp(Cmp::Eq, self.staging.pages.tiles, 0u32);
        k.bra_if(none, true, empty);

        let bulk = plan.barriers.is_some();
        self.staging.stage_tables(k);
        if let Some(m) = &plan.mma {
            self.lookup.stage_books(k, m);
        }
        // The tables' own group, unless the first tile's copies join it.
        if bulk || !plan.prefetch {
            k.cp_async_commit();
        }
        if plan.prefetch {
            k.comment("the first tiles load while the prologue runs");
            self.staging.issue_first_tiles(k);
        }
        self.heads.init_state(k);
        self.heads.load_queries(k);
        k.bar_sync();
        k.comment("key prologue, every head of the group");
        self.heads.stages(k, &self.cta.m.key.prologue.stages, false);
        if !plan.prefetch {
            self.staging.issue_first_tiles(k);
        }
        self.stream(k);
        if plan.dependent_launch {
            k.comment("the merge may launch: it waits for this grid's partials");
            k.launch_dependents();
        }
        k.comment("value epilogue, every head of the group");
        self.heads
            .stages(k, &self.cta.m.value.epilogue.stages, true);
        self.partials.write(k, true);
        k.ret();
        k.place(empty);
        k.comment("no pages: an empty partial (m = -inf, l = 0, out = 0)");
        self.partials.write(k, false);
        k.ret();
    }

    /// The page loop: double-buffered tiles, score, softmax, accumulate.
    ///
    /// Tile `t + 1` is issued right after the barrier that makes tile `t`
    /// visible: every thread has then finished tile `t - 1`, whose buffer the
    /// copy overwrites, so no barrier closes a tile. The page id of tile
    /// `t + 1` is read from the page list one tile earlier, so that dependent
    /// global load does not stall the CTA right after the barrier (the index
    /// is clamped to the last tile, so the read stays in the list).
    fn stream(&self, k: &mut Kernel) {
        let plan = self.cta.plan;
        k.comment("stream the split's tiles, the next one loading during this one");
        let fused = plan.fused_softmax.then(|| self.score.setup(k));
        let registers = plan
            .register_accumulators
            .then(|| self.accumulate.setup(k, None, None));
        let values = plan.mma.as_ref().map(|m| self.acc_mma.setup(k, m));
        let warp_score =
            (plan.mma.as_ref()).and_then(|m| Some(self.score_mma.setup(k, m, m.score.as_ref()?)));
        let expand = (plan.mma.as_ref()).and_then(|m| self.expand.setup(k, m));
        // Pipelined, tile t's values accumulate during tile t + 1, next to its
        // score: no dependency between the two, so one's latencies hide the other's.
        let pending = (plan.mma.as_ref())
            .filter(|_| plan.pipelined)
            .map(|m| self.warp_tile.pending(k, m));
        let t = k.mov(0u32);
        let last = k.sub(self.staging.pages.tiles, 1u32);
        let lead = plan.stages - 1;
        let ahead = k.min(last, lead);
        let at = self.staging.page_entry(k, ahead);
        k.comment(&format!(
            "{} tile buffers: tile t + {lead} loads during tile t; its page id was read a tile earlier",
            plan.stages
        ));
        let next_page = k.ld_global_nc::<U32>(at);
        // Pipelined: the page of tile t + lead − 1, whose values load with
        // tile t + lead's keys.
        let value_page = pending.is_some().then(|| {
            let behind = k.min(last, lead - 1);
            let at = self.staging.page_entry(k, behind);
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
                self.staging.wait_tile(k, t, false);
                if pending.is_some() {
                    // And the values of tile t - 1, the pending tile.
                    let skip = k.label();
                    let first = k.setp(Cmp::Eq, t, 0u32);
                    k.bra_if(first, true, skip);
                    let before = k.sub(t, 1u32);
                    self.staging.wait_tile(k, before, true);
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
                let exists = k.setp(Cmp::Lt, behind, self.staging.pages.tiles);
                let skip = k.label();
                k.bra_if(exists, false, skip);
                skip
            });
            self.staging
                .issue_tile_of(k, behind, value_page, Part::Values);
            if let Some(skip) = skip {
                k.place(skip);
            }
        }
        let more = k.setp(Cmp::Lt, next, self.staging.pages.tiles);
        let issued = k.label();
        k.bra_if(more, false, issued);
        match value_page {
            Some(value_page) => {
                self.staging.issue_tile_of(k, next, next_page, Part::Keys);
                k.assign(value_page, next_page);
            }
            None => self.staging.issue_tile_of(k, next, next_page, Part::Whole),
        }
        let after = k.add(t, lead + 1);
        let after = k.min(after, last);
        let at = self.staging.page_entry(k, after);
        k.ld_global_nc_to(next_page, at);
        k.place(issued);
        if plan.barriers.is_none() {
            k.cp_async_commit();
        }
        let buf = self.staging.buffer(k, t);
        let (first, len) = self.staging.tile_span(k, t);
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
        let header = k.add(buf, HEADER_SLOT0);
        let tile = Tile {
            buf,
            header,
            items,
            first,
        };
        let value_tile = match &pending {
            Some(pending) => pending.span(),
            None => (tile.buf, tile.items),
        };
        if let Some(expand) = &expand {
            self.expand
                .tile(k, expand, [(tile.buf, tile.items), value_tile]);
        }
        if let (Some(score), Some(values)) = (&warp_score, &values) {
            self.warp_tile
                .tile(k, &tile, pending.as_ref(), score, values);
        } else {
            let rescale = match &fused {
                Some(fused) => Rescale::When(self.softmax.fused(k, &tile, fused)),
                None => {
                    self.score.tile(k, &tile);
                    k.bar_sync();
                    self.softmax.tile(k, items);
                    k.bar_sync();
                    Rescale::Always
                }
            };
            match (&values, &registers) {
                (Some(values), _) => self.acc_mma.tile(k, &tile, values, rescale),
                (None, Some(acc)) => self.accumulate.items(k, &tile, acc, Some(rescale)),
                (None, None) => self.accumulate.tile(k, &tile, rescale),
            }
        }
        k.place(done);
        k.add_to(t, t, 1u32);
        let again = k.setp(Cmp::Lt, t, self.staging.pages.tiles);
        k.bra_if(again, true, top);
        if let (Some(score), Some(values), Some(pending)) = (&warp_score, &values, &pending) {
            k.comment("the last tile's values: every copy is in");
            match plan.barriers {
                None => k.cp_async_wait(0),
                // The loop ran (an empty split returns before it): t = tiles.
                Some(_) => {
                    let last = k.sub(t, 1u32);
                    self.staging.wait_tile(k, last, true);
                }
            }
            k.bar_sync();
            if let Some(expand) = &expand {
                let no_keys = k.mov(0u32);
                self.expand
                    .tile(k, expand, [(pending.span().0, no_keys), pending.span()]);
            }
            self.warp_tile.drain(k, pending, score, values, None);
        }
        k.comment("every thread is done with the last tile");
        k.bar_sync();
        if let Some(acc) = &registers {
            self.accumulate.store(k, acc, None);
        }
        if let Some(values) = &values {
            if let Some(score) = &warp_score {
                self.warp_tile.finish(k, score, values);
            }
            self.acc_mma.store(k, values);
        }
        match &fused {
            Some(fused) => self.softmax.finish(k, fused),
            None if registers.is_some() => k.bar_sync(),
            None => {}
        }
    }
}
