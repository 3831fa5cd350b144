//! The static plan of one tier's decode kernel: tile geometry, how the
//! accumulate work is split over threads, and where everything lives in shared
//! memory. The kernel emits code from it and the ABI reports it, so the two
//! can never disagree about sizes.

use std::collections::HashSet;

use super::abi::{
    tensor_map_slot, DecodeKernel, PartialLayout, TableBuffer, TensorMap, SWIZZLE_LINE,
};
use super::streams::{shared_stride, Stream, CHUNK};
use super::tensor_cores::{MmaPlan, MmaScore, TILE_HEADS, WARP_LANES};
use super::{Error, Options, Schedule};
use crate::ir::{ArrayDecl, Expr, Handle, Module, Stage};
use crate::layout::{round_up, Side, TierLayout};
use crate::proc::{depends_on, operands, reads_tables, shared_reads};

mod score_split;

pub use score_split::*;

/// Extra bytes after each tile buffer: an unaligned item reader may load the
/// 32-bit word after the last item's last byte.
const SLACK: u32 = 16;

/// How the accumulate phase splits (items × channels × heads) over threads.
#[derive(Debug, Clone, Copy)]
pub struct Accumulate {
    /// Threads sharing one channel, each taking every `item_lanes`-th item; their
    /// sums are combined with warp shuffles (a power of two, at most 32).
    pub item_lanes: u32,
    /// Channel slots: `threads / item_lanes`.
    pub slots: u32,
    /// Adjacent channels evaluated together (`pack·unit ..` of one channel
    /// unit): the accumulate program's values that are the same for the pack
    /// (a shared scale, a mask word, a codeword index) are computed once and
    /// fields at adjacent offsets come from one load; the weights loaded per
    /// item serve all of them.
    pub pack: u32,
    /// Channel units (of `pack` channels) per thread per pass (static
    /// register arrays).
    pub channels: u32,
    /// Passes over channels per head block.
    pub channel_passes: u32,
    /// Items per trip of the item loop (see `Cta::strided_unrolled` in `kernel/cta.rs`):
    /// enough that about [`LOADS_IN_FLIGHT`] channels' value loads are
    /// independent per trip, never more copies of the program than that.
    pub item_unroll: u32,
}

/// Independent per-item value loads the accumulate loop aims to have in flight
/// per thread: with one, each item waits a full shared-memory latency (~30
/// cycles) for a handful of fmas.
const LOADS_IN_FLIGHT: u32 = 4;

#[derive(Debug, Clone)]
pub struct Plan {
    /// The merge may launch once every CTA has left the stream
    /// ([`super::Target::dependent_launches`]).
    pub dependent_launch: bool,
    pub threads: u32,
    pub warps: u32,
    /// Query heads the shared memory is sized for (`page.max_query_group`).
    pub group_max: u32,
    /// Query heads per score / accumulate work unit (register arrays).
    pub head_block: u32,
    pub head_blocks: u32,
    /// Query heads per score work unit: the largest divisor of `head_block`
    /// that still leaves no thread idle when a tile's (item, block) units are
    /// spread over the CTA. Each unit runs the score program's per-head chain
    /// serially, and the phase ends at a barrier, so fewer heads per unit on
    /// otherwise idle threads shorten the phase; the key is decoded once per
    /// unit, i.e. again for each block, by those otherwise idle threads.
    pub score_head_block: u32,
    pub score_head_blocks: u32,
    pub items_per_page: u32,
    pub page_bytes: u32,
    /// Items per tile, and tiles per page.
    pub tile_items: u32,
    pub tiles_per_page: u32,
    pub header_bytes: u32,
    pub key: Stream,
    pub value: Stream,
    pub buffer_bytes: u32,
    pub dims: u32,
    pub accumulate: Accumulate,
    /// Shared offsets of the tables score/accumulate read (`None`: read from
    /// global memory, by the prologue or epilogue only).
    pub tables: Vec<Option<u32>>,
    /// Shared offset of each array's copy for query head 0, and the byte stride
    /// between heads' copies. Unused arrays get offset 0 and are never touched.
    pub arrays: Vec<u32>,
    pub array_stride: Vec<u32>,
    /// Per-head softmax state: running max, running sum, last rescale factor.
    pub max: u32,
    pub sum: u32,
    pub decay: u32,
    /// Per score head slot (`head_stride` of them): the tile's largest logit
    /// as an order-preserving u32 key (`red.shared.max`), read only by tiles
    /// that move the softmax reference (see [`Plan::fused_softmax`]).
    pub tile_max: u32,
    /// Score units (item, score head block) per thread when each thread owns
    /// a static set of them: `ceil(tile_items · score_head_blocks / threads)`.
    pub score_units: u32,
    /// Whether the softmax is folded into the score phase (the score threads
    /// keep their logits, softmax reference and partial sums in registers):
    /// when `score_units · score_head_block` registers per kind stay few. Not
    /// with a tensor-core score: each warp then keeps its own softmax state
    /// for its tokens (`kernel/warp_tile.rs`).
    pub fused_softmax: bool,
    /// The score's dot product split over adjacent lanes, each keeping its
    /// slice of the block's queries in registers (see [`ScoreSplit`]).
    pub score_split: Option<ScoreSplit>,
    /// Whether the accumulators stay in registers across tiles (one pass of
    /// channels per head block, one head block).
    pub register_accumulators: bool,
    /// The accumulate (and, when the key qualifies, the score, with the
    /// softmax fused) on the tensor cores; the accumulate partition is then
    /// unused, and so is the split score with a tensor-core score.
    pub mma: Option<MmaPlan>,
    /// The tile buffers.
    pub buffers: u32,
    /// With bulk copies ([`super::Schedule::bulk_copies`]): the shared offset
    /// of the buffers' mbarriers, 8 bytes each: per stage one completing the
    /// tile's header and keys (and, unpipelined, its values), then per stage
    /// one completing a pipelined tile's values.
    pub barriers: Option<u32>,
    /// Tile buffers: tiles `t + 1 .. t + stages - 1` load while tile `t` is computed.
    pub stages: u32,
    /// Tile `t`'s values are accumulated during tile `t + 1` (only with a
    /// tensor-core score: [`super::Schedule::pipeline`]).
    pub pipelined: bool,
    /// The tile's logits (softmax weights after the softmax phase): item `i`,
    /// head `h` at float `i * head_stride + h`, so the accumulate phase loads
    /// a head block's weights as vectors. A tensor-core score keeps them in
    /// registers (a softmax per warp); the area then holds each warp's
    /// softmax state after the stream: warp `w`, head `h`'s reference at
    /// float `w * head_stride + h`, its sum `warps * head_stride` floats on.
    pub logits: u32,
    /// Floats per item row of the logits: the head blocks' heads, rounded up to 4.
    pub head_stride: u32,
    /// Whether the first tile's copy is issued before the prologue runs (its
    /// arrays then live apart from the tile buffers).
    pub prefetch: bool,
    /// With tensor-core accumulates: each warp's output sums after the stream
    /// ([`MmaPlan::lane_sums`] per lane, lane-major), added over the warps
    /// into the accumulators. In the dead tile buffers when they hold them
    /// (the epilogue's arrays there are written only after the sums are
    /// added; the softmax states and sums past the buffers are read beside
    /// them), else past everything.
    pub warp_sums: u32,
    /// Page-scaled keys on the tensor cores
    /// ([`super::tensor_cores::MmaScore::padded_page_queries`]): their padded
    /// query rows and each warp's padded copy of a page's header rows.
    pub page_queries: Option<PageQueries>,
    /// Page-scaled keys on the tensor cores in CTAs of several warps: where
    /// the warps meet to prepare each page's query together.
    pub page_fragments: Option<PageFragments>,
    pub shared_bytes: u32,
}

/// Whether tiles load by bulk copies ([`super::Schedule::bulk_copies`]):
/// unless turned off, wherever the target has them ([`Plan::new`] takes
/// the default back where they would leave rows conflicting).
fn bulk_copies(options: &Options) -> bool {
    options.schedule.bulk_copies != Some(false) && options.target.bulk_copies()
}

/// Alignment of swizzled rows: the swizzle's period (8 lines).
const SWIZZLE_ALIGN: u32 = 1024;
/// Most items of one tensor-copy box (a box dimension is at most 256).
const MAX_BOX_ITEMS: u32 = 256;

/// Bytes of one mbarrier.
pub const BARRIER_BYTES: u32 = 8;

/// Which arrays a set of programs reads and writes.
fn arrays_of_stages(stages: &[Stage], into: &mut HashSet<Handle<ArrayDecl>>) {
    for stage in stages {
        into.extend(stage.stores.iter().map(|s| s.array));
        into.extend(shared_reads(&stage.exprs));
    }
}

/// Tables the per-item programs read: staged in shared memory once per CTA.
pub fn staged_tables(module: &Module) -> HashSet<usize> {
    [&module.key.score.exprs, &module.value.accumulate.exprs]
        .into_iter()
        .flat_map(|exprs| exprs.iter())
        .filter_map(|(_, e)| match *e {
            Expr::Table { table, .. } => Some(table.index()),
            _ => None,
        })
        .collect()
}

/// A bump allocator of 16-byte-aligned shared regions.
struct Bump(u32);

impl Bump {
    fn take(&mut self, bytes: u32) -> u32 {
        let at = self.0;
        self.0 = round_up(self.0 + bytes, CHUNK);
        at
    }
}

/// Where a page's query preparation reads its operands from, in rows of
/// padded chunks ([`super::tensor_cores::MmaScore::padded_chunk_bytes`]):
/// the query of each head of the group, copied once per CTA, and per warp
/// the page's header scales (and zero points), copied by the warp at each
/// page's first tile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageQueries {
    pub query: u32,
    pub headers: u32,
}

/// A page's query preparation split over the CTA's warps
/// (`kernel/page_fragments.rs`): each warp's largest magnitude and
/// `Σ query · zero` of each head ([`PAGE_STATS_BYTES`] per column tile,
/// warp and head of the tile), in the logits rows (dead during the
/// stream); and every fragment register of the page's query, lane-major
/// (`[column tile][B tile][register][lane]`), in the warps' padded header
/// rows when they fit (dead once the warps meet), else apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageFragments {
    pub stats: u32,
    pub registers: u32,
}

/// Bytes of one warp's statistics of one head ([`PageFragments`]).
pub const PAGE_STATS_BYTES: u32 = 8;

/// Bytes of one head's copy of an array (16-byte aligned, for vector access).
fn array_bytes(len: u32) -> u32 {
    round_up(4 * len, CHUNK)
}

impl Plan {
    /// The plan for `group_max` query heads per kv head. With automatic tiles,
    /// the tile shrinks until the kernel fits the target's shared memory.
    pub fn new(module: &Module, group_max: u32, options: &Options) -> Result<Plan, Error> {
        if options.schedule.bulk_copies.is_some() {
            return Plan::sized(module, group_max, options);
        }
        // By default bulk copies, unless both streams' rows would be padded
        // and stay unswizzled: then every read of the unpadded tile meets bank
        // conflicts (H200, 32K, dense f16 unswizzled: 0.2764 ms with padded
        // rows, 0.2933 with bulk copies), while every tier with one such
        // stream or none is faster with bulk copies at its tuned shape (KIVI
        // int4 0.0903 ms against 0.1010).
        let conflicted = |plan: &Plan| {
            let padded = |stride: u32| shared_stride(stride) != stride;
            padded(plan.key.stride)
                && padded(plan.value.stride)
                && !(plan.key.swizzled && plan.value.swizzled)
        };
        match Plan::sized(module, group_max, options) {
            Ok(plan) if plan.barriers.is_none() || !conflicted(&plan) => Ok(plan),
            _ => {
                let copies = Options {
                    schedule: Schedule {
                        bulk_copies: Some(false),
                        ..options.schedule
                    },
                    ..*options
                };
                Plan::sized(module, group_max, &copies)
            }
        }
    }

    /// [`Plan::new`] with the copy path `options` ask for.
    fn sized(module: &Module, group_max: u32, options: &Options) -> Result<Plan, Error> {
        let layout = &module.layout;
        let bulk = bulk_copies(options);
        let key = Stream::new(layout.key_stream_offset, layout.key.stride, bulk);
        let value = Stream::new(layout.value_stream_offset, layout.value.stride, bulk);
        let mut budget = options.schedule.tile_bytes;
        let plan = loop {
            let tile = tile_items(&key, &value, layout, options.schedule.tile_items, budget);
            match Plan::with_tile(module, group_max, options, tile) {
                Err(Error::SharedMemory { .. })
                    if options.schedule.tile_items.is_none()
                        && tile_items(&key, &value, layout, None, budget / 2) < tile =>
                {
                    budget /= 2
                }
                result => break result?,
            }
        };
        if options.schedule.tile_items.is_some() || plan.score_split.is_none() {
            return Ok(plan);
        }
        // A split score keeps at most SPLIT_LOGITS logits a thread, so past
        // some tile size it splits over fewer heads and decodes each key
        // more often: smaller tiles of the page can cost less per item.
        let mut best = plan;
        let mut wanted = best.tile_items / 2;
        while wanted >= SPLIT_MIN_TILE_ITEMS {
            let tile = tile_items(&key, &value, layout, Some(wanted), budget);
            let Ok(smaller) = Plan::with_tile(module, group_max, options, tile) else {
                break;
            };
            if split_cost_per_item(&smaller) < split_cost_per_item(&best) {
                best = smaller;
            }
            wanted /= 2;
        }
        Ok(best)
    }

    fn with_tile(
        module: &Module,
        group_max: u32,
        options: &Options,
        tile_items: u32,
    ) -> Result<Plan, Error> {
        match Plan::with_books(module, group_max, options, tile_items, true) {
            Err(Error::SharedMemory { .. }) => {
                Plan::with_books(module, group_max, options, tile_items, false)
            }
            result => result,
        }
    }

    /// [`Plan::with_tile`], looked-up books copied across the banks
    /// ([`super::tensor_cores::Lookup::bank_copies`]) when `bank_copies`, else held once.
    fn with_books(
        module: &Module,
        group_max: u32,
        options: &Options,
        tile_items: u32,
        bank_copies: bool,
    ) -> Result<Plan, Error> {
        let layout = &module.layout;
        let threads = 32 * options.schedule.warps;
        let head_block = options.schedule.head_block.min(group_max);
        let head_blocks = group_max.div_ceil(head_block);
        let score_head_block = (1..=head_block)
            .filter(|h| head_block.is_multiple_of(*h))
            .find(|&h| tile_items * group_max.div_ceil(h) <= threads)
            .unwrap_or(head_block);
        let score_head_blocks = group_max.div_ceil(score_head_block);
        let bulk = bulk_copies(options);
        let mut key = Stream::new(layout.key_stream_offset, layout.key.stride, bulk);
        let mut value = Stream::new(layout.value_stream_offset, layout.value.stride, bulk);
        let items_per_page = layout.items_per_page;
        key.buffer_offset = layout.header_bytes;
        value.buffer_offset = key.buffer_offset + key.capacity(tile_items);
        let mut buffer_bytes = value.buffer_offset + value.capacity(tile_items) + SLACK;

        let dims = module.value.dims;
        // Table reads (VQ codebook rows) take quads where a quad's channels
        // read one 16-byte row (one load and one code for four channels);
        // otherwise they stay one per channel, as a pair would spread each
        // load instruction over twice the rows (1 % slower on shard).
        let exprs = &module.value.accumulate.exprs;
        let pack = match (reads_tables(exprs), quads_pay(exprs, value.align())) {
            (true, _) if super::expr::table_rows_per_pack(exprs, PACK) => PACK,
            (true, _) => 1,
            (false, true) if octets_pay(exprs, value.align()) => OCTET,
            (false, true) => PACK,
            (false, false) => 2,
        };
        let accumulate = partition(
            threads,
            dims,
            head_block,
            pack,
            options.schedule.max_accumulators,
        );

        let fp8 = options.target.fp8_conversions();
        let mut mma = options
            .schedule
            .tensor_cores
            .then(|| super::tensor_cores::plan(module, group_max, tile_items, &key, &value, fp8))
            .flatten();
        // Swizzled tensor copies where the tensor cores' 16-byte fragment
        // loads are the only reads of both streams (they swizzle their
        // addresses). A lone swizzled stream measured slower: Spherical mid
        // (f16 values, codebook keys) 0.1531 -> 0.1622 ms at 32K on an H200,
        // the address arithmetic costing more than the bank conflicts.
        let swizzled = mma.as_ref().is_some_and(|m| {
            let tensor_rows = |s: &Stream| {
                bulk && s.stride.is_multiple_of(SWIZZLE_LINE) && tile_items <= MAX_BOX_ITEMS
            };
            // Bitmap and codebook sides (gathered or staged rows) are read otherwise.
            let keys = tensor_rows(&key)
                && m.key_rows.as_stored()
                && (m.score.as_ref()).is_some_and(|s| s.key.is_half() && s.spread_chunks());
            let values = tensor_rows(&value)
                && m.value_rows.as_stored()
                && m.channel.element.is_half()
                && m.value_aligned
                && m.channel.scale.is_none();
            keys && values
        });
        if swizzled {
            // The swizzle follows address bits 4-9: the rows start on
            // 1024-byte boundaries of tile buffers that do too.
            key.swizzled = true;
            value.swizzled = true;
            key.buffer_offset = round_up(layout.header_bytes, SWIZZLE_ALIGN);
            let after_keys = key.buffer_offset + key.capacity(tile_items);
            value.buffer_offset = round_up(after_keys, SWIZZLE_ALIGN);
            buffer_bytes = round_up(
                value.buffer_offset + value.capacity(tile_items) + SLACK,
                SWIZZLE_ALIGN,
            );
            mma = super::tensor_cores::plan(module, group_max, tile_items, &key, &value, fp8);
        }
        // Shared memory: staged tables and the arrays score/accumulate keep for
        // the whole stream first; then the stream's region, which the epilogue's
        // arrays overlap; the prologue's arrays after it when they fit, so the
        // first tile can load while the prologue runs.
        let mut bump = Bump(0);
        let barriers = bulk.then(|| bump.take(2 * BARRIER_BYTES * options.schedule.stages));
        let staged = staged_tables(module);
        // A looked-up codebook is read as f16 (its own copy), not as the table.
        let lookup = mma.as_mut().and_then(|m| m.value_rows.lookup.as_mut());
        let looked_up = lookup.as_ref().map(|l| l.table);
        let tables = module
            .tables
            .iter()
            .map(|(h, decl)| {
                (staged.contains(&h.index()) && looked_up != Some(h.index()))
                    .then(|| bump.take(array_bytes(decl.len)))
            })
            .collect();
        if let Some(l) = lookup {
            l.copies = match bank_copies {
                true => l.bank_copies(),
                false => 1,
            };
            l.book = bump.take(l.book_bytes());
        }

        // A tensor-core score reads its query once, into registers before the
        // page loop: the score program's arrays need not outlive the prologue.
        let mma_score = mma.as_ref().is_some_and(|m| m.score.is_some());
        // Page-scaled values take their scales from the tile's header,
        // which the next copy may overwrite before a pipelined drain.
        let page_scaled = mma.as_ref().is_some_and(|m| m.channel.page_scale.is_some());
        // Page-scaled keys on the tensor cores take each page's scales into
        // the query at the page's first tile: the query (and bias) arrays are
        // read again after the prologue, so they may not lie in the staged
        // rows or under the stream's first tiles.
        let rereads: HashSet<Handle<ArrayDecl>> = match mma.as_ref().and_then(|m| m.score.as_ref())
        {
            Some(s) if s.key_scale.is_some() => s.key_bias.into_iter().chain([s.query]).collect(),
            _ => HashSet::new(),
        };
        let has_staged_rows = mma
            .as_ref()
            .is_some_and(|m| m.staging_bytes(tile_items) > 0);
        let mut score_reads = HashSet::new();
        if !mma_score {
            score_reads.extend(shared_reads(&module.key.score.exprs));
        } else if has_staged_rows {
            score_reads.extend(rereads.iter().copied());
        }
        let mut persistent = score_reads;
        persistent.insert(module.value.accumulator);
        let mut prologue = HashSet::from([module.query]);
        arrays_of_stages(&module.key.prologue.stages, &mut prologue);
        let mut epilogue = HashSet::from([module.value.output]);
        arrays_of_stages(&module.value.epilogue.stages, &mut epilogue);
        // An array both phases use must survive the stream.
        persistent.extend(prologue.intersection(&epilogue).copied());
        prologue.retain(|a| !persistent.contains(a));
        epilogue.retain(|a| !persistent.contains(a));

        let count = module.arrays.len();
        let mut arrays = vec![0; count];
        let mut array_stride = vec![0; count];
        let place = |bump: &mut Bump,
                     set: &HashSet<Handle<ArrayDecl>>,
                     arrays: &mut [u32],
                     stride: &mut [u32]| {
            for (h, decl) in module.arrays.iter() {
                if set.contains(&h) {
                    stride[h.index()] = array_bytes(decl.len);
                    arrays[h.index()] = bump.take(group_max * array_bytes(decl.len));
                }
            }
        };
        place(&mut bump, &persistent, &mut arrays, &mut array_stride);
        let state_bytes = array_bytes(group_max);
        let max = bump.take(state_bytes);
        let sum = bump.take(state_bytes);
        let decay = bump.take(state_bytes);
        // Every head of every score block has a slot (the last block may pass group_max).
        let head_stride = (head_blocks * head_block).div_ceil(4) * 4;
        let tile_max = bump.take(4 * head_stride);
        let headers_bytes =
            |s: &MmaScore| options.schedule.warps * s.header_rows() * s.padded_row_bytes();
        let page_queries = (mma.as_ref())
            .and_then(|m| m.score.as_ref())
            .filter(|s| s.padded_page_queries())
            .map(|s| PageQueries {
                query: bump.take(group_max * s.padded_row_bytes()),
                headers: bump.take(headers_bytes(s)),
            });

        // Every fragment register of a page's query, once per CTA, where
        // each warp has one to prepare (subspace's two registers a lane ran
        // 1-2 % slower split over 4 warps on an H200).
        let page_registers = (mma.as_ref())
            .filter(|_| options.schedule.warps > 1)
            .and_then(|m| m.score.as_ref().map(|s| (m, s)))
            .filter(|(_, s)| s.key_scale.is_some() && s.key_registers() >= options.schedule.warps)
            .map(|(m, s)| {
                let bytes = m.column_tiles * s.query_tiles() * s.key_registers() * 4 * WARP_LANES;
                match page_queries {
                    Some(pq) if bytes <= headers_bytes(s) => pq.headers,
                    _ => bump.take(bytes),
                }
            });

        let stream_start = bump.0;
        if swizzled {
            bump.0 = round_up(bump.0, SWIZZLE_ALIGN);
        }
        let buffers = bump.take(options.schedule.stages * buffer_bytes);
        let logits_bytes = match mma_score {
            true => head_stride * 4 * 2 * options.schedule.warps,
            false => head_stride * 4 * tile_items,
        };
        let logits = bump.take(logits_bytes);
        let page_fragments = page_registers.map(|registers| {
            let m = mma.as_ref().expect("page fragments are the tensor cores'");
            let stats = m.column_tiles * options.schedule.warps * TILE_HEADS * PAGE_STATS_BYTES;
            // A tile's heads are within the head stride, rounded to 4.
            assert!(stats <= logits_bytes, "page statistics fit the logits rows");
            PageFragments {
                stats: logits,
                registers,
            }
        });
        // Staged rows: [start, end) of shared memory, written only inside the
        // page loop (after the barrier that ends the prologue).
        let staged_rows = mma.as_mut().map(|m| {
            let bytes = m.staging_bytes(tile_items);
            let staging = bump.take(bytes);
            m.place_staging(staging, tile_items);
            (staging, staging + bytes)
        });
        let stream_end = bump.0;
        let mut epilogue_bump = Bump(stream_start);
        place(
            &mut epilogue_bump,
            &epilogue,
            &mut arrays,
            &mut array_stride,
        );
        let sums_bytes = mma
            .as_ref()
            .map_or(0, |m| options.schedule.warps * m.warp_sums_bytes());
        let arrays_end = stream_end.max(epilogue_bump.0);
        let warp_sums = match buffers + sums_bytes <= logits {
            true => buffers,
            false => Bump(arrays_end).take(sums_bytes),
        };
        let shared_end = arrays_end.max(round_up(warp_sums + sums_bytes, CHUNK));
        let limit = options.target.max_shared_bytes();

        // The prologue's arrays are dead once the page loop starts: in the
        // staged rows when they fit there (no copy writes those, so the first
        // tiles still load during the prologue), else past everything. Past
        // them, MosaicKV's query (2 KB at group 4) held it to 3 CTAs per SM
        // instead of 4 (H200: 0.2425 -> 0.2280 ms at 32K).
        let mut prologue_arrays = arrays.clone();
        let mut prologue_stride = array_stride.clone();
        let in_rows = staged_rows.is_some_and(|(start, end)| {
            let mut rows = Bump(start);
            place(
                &mut rows,
                &prologue,
                &mut prologue_arrays,
                &mut prologue_stride,
            );
            rows.0 <= end
        });
        let prologue_end = if in_rows {
            shared_end
        } else {
            let mut after = Bump(shared_end);
            place(
                &mut after,
                &prologue,
                &mut prologue_arrays,
                &mut prologue_stride,
            );
            after.0
        };
        let (prefetch, shared_bytes) = if prologue_end <= limit {
            arrays = prologue_arrays;
            array_stride = prologue_stride;
            (true, prologue_end)
        } else {
            let (kept, dead): (HashSet<_>, HashSet<_>) =
                prologue.iter().partition(|a| rereads.contains(a));
            let mut overlap = Bump(stream_start);
            place(&mut overlap, &dead, &mut arrays, &mut array_stride);
            let mut after = Bump(shared_end.max(overlap.0));
            place(&mut after, &kept, &mut arrays, &mut array_stride);
            (false, after.0)
        };
        if shared_bytes > limit {
            return Err(Error::SharedMemory {
                format: module.format.clone(),
                tier: module.tier.clone(),
                needed: shared_bytes,
                limit,
                target: options.target.name(),
            });
        }
        let mut score_units = (tile_items * score_head_blocks).div_ceil(threads);
        let mut fused_softmax = score_units * score_head_block <= FUSED_SCORE_REGISTERS;
        let (mut score_head_block, mut score_head_blocks) = (score_head_block, score_head_blocks);
        let score_split = match mma_score {
            true => None,
            false => score_split(module, threads, group_max, head_block, tile_items),
        };
        if let Some(split) = &score_split {
            score_head_block = split.head_block;
            score_head_blocks = group_max / split.head_block;
            score_units = split.units;
            fused_softmax = true;
        }
        // A tensor-core score has its own softmax, per warp.
        fused_softmax &= !mma_score;
        let register_accumulators = mma.is_none() && head_blocks * accumulate.channel_passes == 1;
        Ok(Plan {
            dependent_launch: options.target.dependent_launches(),
            threads,
            warps: options.schedule.warps,
            group_max,
            head_block,
            head_blocks,
            score_head_block,
            score_head_blocks,
            items_per_page,
            page_bytes: layout.page_bytes,
            tile_items,
            tiles_per_page: items_per_page.div_ceil(tile_items),
            header_bytes: layout.header_bytes,
            key,
            value,
            buffer_bytes,
            dims,
            accumulate,
            tables,
            arrays,
            array_stride,
            max,
            sum,
            decay,
            tile_max,
            score_units,
            fused_softmax,
            score_split,
            register_accumulators,
            mma,
            buffers,
            barriers,
            stages: options.schedule.stages,
            pipelined: options.schedule.pipeline && mma_score && !page_scaled,
            logits,
            head_stride,
            prefetch,
            warp_sums,
            page_queries,
            page_fragments,
            shared_bytes,
        })
    }

    pub fn stream(&self, side: Side) -> &Stream {
        side.pick(&self.key, &self.value)
    }
}

/// Items per tile: `wanted`, or as many as fit `budget` bytes; a whole page
/// when that is fewer. A page of several tiles is cut into equal tiles (not a
/// full one and a sliver), each a multiple of `quantum` items so that every
/// tile's unpadded streams start on a 16-byte boundary.
fn tile_items(
    key: &Stream,
    value: &Stream,
    layout: &TierLayout,
    wanted: Option<u32>,
    budget: u32,
) -> u32 {
    let items = layout.items_per_page;
    let step = |s: &Stream| CHUNK / gcd(s.stride, CHUNK);
    let quantum = lcm(step(key), step(value));
    let wanted = wanted.unwrap_or_else(|| {
        let per_item = key.shared_stride + value.shared_stride;
        (budget.saturating_sub(layout.header_bytes) / per_item).max(1)
    });
    if wanted >= items {
        return items;
    }
    let tiles = items.div_ceil(wanted.max(quantum));
    round_up(items.div_ceil(tiles), quantum).min(items)
}

/// Most (unit, head) logits a thread keeps in registers for the fused softmax
/// (each also has a reference and a partial sum); beyond, the separate
/// softmax phase.
const FUSED_SCORE_REGISTERS: u32 = 8;

impl Plan {
    /// The launch contract of the kernel this plan lays out.
    pub fn decode_kernel(&self, name: String, module: &Module) -> DecodeKernel {
        DecodeKernel {
            name,
            tier: module.layout.index,
            threads: self.threads,
            shared_bytes: self.shared_bytes,
            max_query_group: self.group_max,
            page_bytes: self.page_bytes,
            tile_items: self.tile_items,
            tables: TableBuffer::of(module),
            partials: PartialLayout::new(module.head_dim),
            tensor_maps: [Side::Key, Side::Value]
                .into_iter()
                .map(|side| (tensor_map_slot(side), self.stream(side)))
                .filter(|(_, s)| s.swizzled)
                .map(|(slot, s)| TensorMap {
                    slot,
                    page_offset: s.page_offset,
                    row_bytes: s.stride,
                    items_per_page: self.items_per_page,
                    page_bytes: self.page_bytes,
                    box_items: self.tile_items,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulate_partition_covers_every_channel() {
        for threads in [32, 64, 128, 256] {
            for dims in [1, 3, 16, 32, 48, 100, 128, 256, 1024] {
                for (head_block, pack) in [1, 4, 8].into_iter().flat_map(|h| [(h, 1), (h, PACK)]) {
                    let a = partition(threads, dims, head_block, pack, 32);
                    assert!(a.item_lanes.is_power_of_two() && a.item_lanes <= 32);
                    assert_eq!(a.slots * a.item_lanes, threads);
                    assert!(dims.is_multiple_of(a.pack));
                    assert!(a.slots * a.channels * a.channel_passes * a.pack >= dims);
                    assert!(a.channels * a.pack * head_block <= 32.max(head_block));
                }
            }
        }
    }

    fn tier(key_stride: u32, value_stride: u32) -> TierLayout {
        let spec = crate::front::parse_spec(
            "name = \"t\"\nhead_dim = 8\n[[tier]]\nname = \"a\"\n\
             key.field = [{ kind = \"dense\", dtype = \"f16\" }]\n\
             value.field = [{ kind = \"dense\", dtype = \"f16\" }]\n",
            "t.toml",
        )
        .expect("spec");
        let mut layout = TierLayout::new(&spec, 0);
        layout.key.stride = key_stride;
        layout.value.stride = value_stride;
        layout
    }

    #[test]
    fn partial_tiles_keep_streams_chunk_aligned() {
        let layout = tier(14, 6);
        let key = Stream::new(32, 14, false);
        let value = Stream::new(1024, 6, false);
        let items = tile_items(&key, &value, &layout, Some(5), 0);
        assert_eq!(items, 8);
        // 57 items would fit: two tiles of 32 rather than 56 + 8.
        let layout = tier(12, 256);
        let (key, value) = (Stream::new(32, 12, false), Stream::new(800, 256, false));
        assert_eq!(tile_items(&key, &value, &layout, None, 16 * 1024), 32);
        assert_eq!(items * 14 % 16, 0);
        assert_eq!(items * 6 % 16, 0);
        assert!(Stream::new(0, 256, false).padded());
        assert!(!Stream::new(0, 256, true).padded());
        assert!(!Stream::new(0, 48, false).padded());
        assert_eq!(Stream::new(0, 14, false).align(), 2);
        assert_eq!(Stream::new(0, 256, false).align(), 16);
    }

    fn values_pack(value_field: &str) -> u32 {
        let spec = format!(
            "name = \"v\"\nhead_dim = 64\n[page]\nitems = 64\n[[tier]]\nname = \"t\"\n\
             key.field = [{{ kind = \"dense\", dtype = \"f16\" }}]\nvalue.field = [{value_field}]\n"
        );
        let format = crate::Format::parse(&spec, "v.toml").expect("valid spec");
        let options = Options::for_target(super::super::Target::Sm90);
        let plan = Plan::new(format.tiers()[0].module(), 4, &options).expect("plans");
        plan.accumulate.pack
    }

    #[test]
    fn codewords_of_four_dimensions_give_a_thread_their_four_channels() {
        let quad = "{ kind = \"codebook\", group_size = 4, bits = 8, codewords = \"vector\", dtype = \"f16\" }";
        assert_eq!(values_pack(quad), PACK);
    }

    /// A plan for keys of `bits`-bit codes scaled per page (KIVI's) and
    /// values scaled per item, at `warps` warps and 4 query heads.
    fn page_scaled_plan(bits: u32, head_dim: u32, warps: u32) -> Plan {
        let spec = format!(
            "name = \"p\"\nhead_dim = {head_dim}\n[page]\nitems = 512\n[[tier]]\nname = \"t\"\n\
             key.field = [{{ kind = \"coeff\", bits = {bits}, scale = \"page_component\" }}]\n\
             value.field = [{{ kind = \"coeff\", bits = 8, scale = \"item\" }}]\n"
        );
        let format = crate::Format::parse(&spec, "p.toml").expect("valid spec");
        let options = Options {
            schedule: Schedule {
                warps,
                ..Schedule::default()
            },
            ..Options::for_target(super::super::Target::Sm90)
        };
        Plan::new(format.tiers()[0].module(), 4, &options).expect("plans")
    }

    #[test]
    fn page_fragments_take_dead_rows_where_every_warp_packs_a_register() {
        // 4-bit keys of 128 dims: 8 fragment registers a lane.
        for warps in [2, 4, 8] {
            let plan = page_scaled_plan(4, 128, warps);
            let fragments = plan.page_fragments.expect("split over the warps");
            assert_eq!(fragments.stats, plan.logits, "{warps} warps");
            // Two B tiles of 8 registers: 2 KiB, in the padded header rows
            // once 4 warps' rows hold them.
            let headers = plan.page_queries.expect("padded").headers;
            assert_eq!(fragments.registers == headers, warps >= 4, "{warps} warps");
        }
        assert_eq!(page_scaled_plan(4, 128, 1).page_fragments, None);
        // 8-bit keys of 32 dims (subspace's): 2 registers, fewer than 4 warps.
        assert!(page_scaled_plan(8, 32, 2).page_fragments.is_some());
        assert_eq!(page_scaled_plan(8, 32, 4).page_fragments, None);
    }

    #[test]
    fn codewords_of_other_sizes_stay_one_channel_per_thread() {
        let pair = "{ kind = \"codebook\", group_size = 2, bits = 8, codewords = \"vector\", dtype = \"f16\" }";
        assert_eq!(values_pack(pair), 1);
    }
}
