//! Staging: the copies that bring a tile's header, keys and values (and the
//! staged tables) from global into shared memory. `cp.async` 16 bytes per
//! thread, or on sm_90 bulk copies and tensor copies issued by one thread
//! and completing on the buffer's mbarriers; the split's page list says
//! which page each tile comes from.

use super::super::abi::{tensor_map_slot, TableBuffer, TENSOR_MAP_BYTES};
use super::super::builder::{Cmp, Evict, Global, Kernel, Op, Reg, Shared, U32, U64};
use super::super::plan::BARRIER_BYTES;
use super::super::streams::{Stream, CHUNK};
use super::cta::{divide, kept, Cta};
use crate::layout::Side;

/// The split's pages: the pool, its page list, the split's first entry in
/// it and its tile count.
#[derive(Clone, Copy)]
pub(super) struct Pages {
    pub(super) pool: Reg<U64>,
    pub(super) page_ids: Reg<U64>,
    pub(super) first: Reg<U32>,
    pub(super) tiles: Reg<U32>,
}

/// The copy phase of the page loop.
#[derive(Clone, Copy)]
pub(super) struct Staging<'a> {
    pub(super) cta: &'a Cta<'a>,
    pub(super) pages: Pages,
}

impl Staging<'_> {
    /// Copies the tables score and accumulate read into shared memory.
    pub(super) fn stage_tables(&self, k: &mut Kernel) {
        let plan = self.cta.plan;
        k.comment("stage the tables score/accumulate read into shared memory");
        let buffer = TableBuffer::of(self.cta.m);
        let tables = self.cta.tables(k);
        for (t, at) in plan.tables.iter().enumerate() {
            if let Some(at) = *at {
                let chunks = (buffer.lens[t] * 4).div_ceil(CHUNK);
                let src = Global::at(tables).plus(4 * i64::from(buffer.offsets[t]));
                let dst = Shared::at(self.cta.smem).plus(at.into());
                self.copy(k, Op::Imm(chunks), chunks, dst, src);
            }
        }
    }

    /// `cp.async` of `chunks` (at most `most`) 16-byte chunks from `src` to
    /// `dst`, chunk `q` by thread `q % threads`. Each thread computes its two
    /// addresses once; its `j`-th chunk is then at a constant offset, so a
    /// copy is one instruction (plus a bounds test where `chunks` may stop
    /// short). Recomputing 64-bit addresses per chunk in a loop cost ~20
    /// instructions per 16 bytes: a fifth of the dense kernel's instructions.
    pub(super) fn copy(
        &self,
        k: &mut Kernel,
        chunks: Op<U32>,
        most: u32,
        dst: Shared,
        src: Global,
    ) {
        let threads = self.cta.plan.threads;
        let to = k.mad_lo(self.cta.tid, CHUNK, dst.base);
        let from = k.global_index(src.base, self.cta.tid, CHUNK);
        let trips = most.div_ceil(threads);
        if trips > COPY_UNROLL {
            // Large staged tables: a loop advancing both addresses.
            let q = k.mov(self.cta.tid);
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
    pub(super) fn copy_trip(
        &self,
        k: &mut Kernel,
        j: u32,
        chunks: Op<U32>,
        to: Shared,
        from: Global,
    ) {
        let threads = self.cta.plan.threads;
        match chunks {
            Op::Imm(n) if (j + 1) * threads <= n => k.cp_async_16(to, from),
            _ => {
                let q = k.add(self.cta.tid, j * threads);
                let ok = k.setp(Cmp::Lt, q, chunks);
                k.guarded(ok, true, |k| k.cp_async_16(to, from));
            }
        }
    }

    /// Tiles `0 .. stages - 1`, one `cp.async` group each (the first also
    /// holds the staged tables; groups past the split's tiles are empty, so
    /// the stream's wait counts stay uniform); with bulk copies, each on its
    /// buffer's mbarriers instead.
    ///
    /// Pipelined ([`crate::back::ptx::plan::Plan::pipelined`]): group `s` holds tile `s`'s header and
    /// keys and tile `s − 1`'s values, which are read one tile later.
    pub(super) fn issue_first_tiles(&self, k: &mut Kernel) {
        let pipelined = self.cta.plan.pipelined;
        let whole = if pipelined { Part::Keys } else { Part::Whole };
        let bulk = self.cta.plan.barriers.is_some();
        let zero = k.mov(0u32);
        self.issue_tile(k, zero, whole);
        if !bulk {
            k.cp_async_commit();
        }
        for s in 1..self.cta.plan.stages - 1 {
            let t = k.mov(s);
            let past = k.setp(Cmp::Ge, t, self.pages.tiles);
            let skip = k.label();
            k.bra_if(past, true, skip);
            self.issue_tile(k, t, whole);
            k.place(skip);
            if pipelined {
                // Tile s − 1's values: it may exist when tile s does not.
                let before = k.mov(s - 1);
                let past = k.setp(Cmp::Ge, before, self.pages.tiles);
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
    pub(super) fn slot(&self, k: &mut Kernel, t: Reg<U32>) -> Reg<U32> {
        let stages = self.cta.plan.stages;
        if stages.is_power_of_two() {
            k.and(t, stages - 1)
        } else {
            k.rem_u32(t, stages)
        }
    }

    /// Shared address of tile buffer `t % stages`.
    pub(super) fn buffer(&self, k: &mut Kernel, t: Reg<U32>) -> Reg<U32> {
        let slot = self.slot(k, t);
        let base = k.add(self.cta.smem, self.cta.plan.buffers);
        k.mad_lo(slot, self.cta.plan.buffer_bytes, base)
    }

    /// Bulk copies: thread 0 readies every buffer's mbarriers (one arrival
    /// per phase: its own, with the bytes to expect), and the CTA's barrier
    /// shows them to every thread before any use (racecheck flags the first
    /// arrival otherwise, though the same thread made both).
    pub(super) fn init_barriers(&self, k: &mut Kernel) {
        let plan = self.cta.plan;
        let Some(barriers) = plan.barriers else {
            return;
        };
        let skip = k.label();
        let other = k.setp(Cmp::Ne, self.cta.tid, 0u32);
        k.bra_if(other, true, skip);
        for i in 0..2 * plan.stages {
            let at = Shared::at(self.cta.smem).plus(i64::from(barriers + BARRIER_BYTES * i));
            k.mbarrier_init(at, 1);
        }
        k.fence_mbarrier_init();
        k.place(skip);
        k.bar_sync();
    }

    /// The mbarrier completing tile `t`'s keys (and header; unpipelined, its
    /// values too), or, with `values`, a pipelined tile's values.
    pub(super) fn barrier(&self, k: &mut Kernel, t: Reg<U32>, values: bool) -> Shared {
        let plan = self.cta.plan;
        let barriers = plan.barriers.expect("bulk copies");
        let slot = self.slot(k, t);
        let at = k.mad_lo(slot, BARRIER_BYTES, self.cta.smem);
        let side = if values { plan.stages } else { 0 };
        Shared::at(at).plus(i64::from(barriers + BARRIER_BYTES * side))
    }

    /// Waits for the bulk copies of tile `t` (its values, with `values`):
    /// the buffer's barrier completes one phase per tile, so tile `t`'s is
    /// phase `t / stages`.
    pub(super) fn wait_tile(&self, k: &mut Kernel, t: Reg<U32>, values: bool) {
        let stages = self.cta.plan.stages;
        let lap = if stages.is_power_of_two() {
            k.shr(t, stages.trailing_zeros())
        } else {
            k.div_u32(t, stages)
        };
        let parity = k.and(lap, 1u32);
        let at = self.barrier(k, t, values);
        k.mbarrier_wait(at, parity);
    }

    /// First item of tile `t` within its page (`None`: tiles are whole pages)
    /// and the tile's item count.
    pub(super) fn tile_span(&self, k: &mut Kernel, t: Reg<U32>) -> (Option<Reg<U32>>, Op<U32>) {
        let plan = self.cta.plan;
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
    pub(super) fn page_entry(&self, k: &mut Kernel, t: Reg<U32>) -> Global {
        let page_index = if self.cta.plan.tiles_per_page == 1 {
            t
        } else {
            k.div_u32(t, self.cta.plan.tiles_per_page)
        };
        let entry = k.add(self.pages.first, page_index);
        let at = k.global_index(self.pages.page_ids, entry, 4);
        kept(k, at)
    }

    /// Issues the copies of `part` of tile `t` into its buffer.
    pub(super) fn issue_tile(&self, k: &mut Kernel, t: Reg<U32>, part: Part) {
        let at = self.page_entry(k, t);
        let page_id = k.ld_global_nc::<U32>(at);
        self.issue_tile_of(k, t, page_id, part);
    }

    /// [`Staging::issue_tile`] with the id of the tile's page already loaded.
    pub(super) fn issue_tile_of(&self, k: &mut Kernel, t: Reg<U32>, page_id: Reg<U32>, part: Part) {
        let plan = self.cta.plan;
        if plan.barriers.is_some() {
            self.bulk_tile(k, t, page_id, part);
            return;
        }
        let page = k.global_index(self.pages.pool, page_id, plan.page_bytes);
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

    /// [`Staging::issue_tile_of`] by bulk copies: thread 0 copies the header
    /// and each stream of `part` as one run each (a swizzled stream as one
    /// box of its tensor map: always a whole tile, items past the page
    /// zeroed), runs that continue one another as one, all completing on the
    /// part's mbarrier, which it tells the total bytes to expect.
    pub(super) fn bulk_tile(&self, k: &mut Kernel, t: Reg<U32>, page_id: Reg<U32>, part: Part) {
        let plan = self.cta.plan;
        let skip = k.label();
        let other = k.setp(Cmp::Ne, self.cta.tid, 0u32);
        k.bra_if(other, true, skip);
        let page = k.global_index(self.pages.pool, page_id, plan.page_bytes);
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
                let maps = k.ld_param(&self.cta.p.tensor_maps);
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
    pub(super) fn stream_span(
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

    pub(super) fn copy_stream(
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
            let most = (self.cta.plan.tile_items * s.stride).div_ceil(CHUNK);
            self.copy(k, chunks, most, dst, src);
            return;
        }
        // Padded rows: item by item, 16 bytes at a time.
        let threads = self.cta.plan.threads;
        let per_item = s.stride / CHUNK;
        let chunks = match len {
            Op::Imm(n) => Op::Imm(n * per_item),
            Op::Reg(n) => Op::Reg(k.mul(n, per_item)),
        };
        let trips = (self.cta.plan.tile_items * per_item).div_ceil(threads);
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
            let (item0, part0) = divide(k, self.cta.tid, per_item);
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
        self.cta.strided(k, self.cta.tid, chunks, threads, |k, q| {
            let (item, part) = divide(k, q, per_item);
            let (from, to) = chunk_at(k, item, part);
            k.cp_async_16(
                Shared::at(to).plus(dst.offset),
                Global::at(from).plus(s.page_offset.into()),
            );
        });
    }
}

/// Most copy trips per thread emitted straight-line (a tile of 40 KiB over 128
/// threads is 20); larger copies (big staged tables) run as a loop.
pub(super) const COPY_UNROLL: u32 = 32;

/// A bulk copy: destination, source, bytes.
pub(super) type BulkCopy = (Shared, BulkSource, Op<U32>);

/// Runs whose bytes continue the previous run's in both spaces, under the
/// same L2 policy, join it: each copy is a chain of dependent uniform
/// instructions on the issuing thread's path.
pub(super) fn merge_runs(copies: Vec<BulkCopy>) -> Vec<BulkCopy> {
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
pub(super) enum Part {
    Whole,
    Keys,
    Values,
}

impl Part {
    pub(super) fn sides(self) -> &'static [Side] {
        match self {
            Part::Whole => &[Side::Key, Side::Value],
            Part::Keys => &[Side::Key],
            Part::Values => &[Side::Value],
        }
    }
}

/// Where a bulk copy reads: a run of bytes, or a box of a tensor map
/// (its generic address and the box's coordinates, innermost first).
#[derive(Clone, Copy)]
pub(super) enum BulkSource {
    Run(Global),
    Box(Reg<U64>, [Reg<U32>; 4]),
}
