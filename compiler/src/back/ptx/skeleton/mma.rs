//! The score and accumulate phases on the tensor cores, for the tiers
//! `back/ptx/mma.rs` admits (docs/ptx-backend.md, seventh round).
//!
//! `m16n8k16` fragments (integer keys: `m16n8k32`), lane `4 · row + quad`
//! of a warp:
//! - score, per 16-token tile of the warp: `S = K · Q'ᵀ`. A = the tile's key
//!   rows (tokens × elements, a reduction step's elements in the lanes' load
//!   order, [`MmaScore::key_element`]); B = the queries (times the page's
//!   header scales) times a power of two σ per head, as columns (head,
//!   part): f16 `hi + lo` parts, so a head's two columns sum to its logit
//!   times σ; or, for integer keys, the three bytes of an integer
//!   ([`Queries`]).
//! - accumulate, per 16-token step of the warp: `Oᵀ += Vᵀ · P'ᵀ`. A = value
//!   channels × tokens (row `r` of channel tile `t` is channel `2 · t + r / 8`
//!   of lane group `r % 8`'s channels, two tokens per register by byte
//!   permutes; gathered values, as stored: a token's channel pair per
//!   register, the reduction over (token, channel parity),
//!   [`channel_pair_products`]); B = the softmax weights (times the items'
//!   scales and a power of two σ) as (head, part) columns (gathered values:
//!   (head, channel parity) columns, one `mma.sync` per part). Each warp sums its own steps
//!   in registers; the warps' sums meet in the accumulator array once, after
//!   the stream.
//!
//! A warp's score and accumulate steps are the same tokens. With the score
//! on the tensor cores, each warp keeps its own softmax reference and sums
//! per head: a lane's C columns in both are one head's, so the decays stay
//! in the lane, and the weights go from the score's C fragments to the
//! accumulate's B fragments by shuffles: no barrier and no shared round trip
//! between score and accumulate (twelfth round). The warps' states meet
//! once, after the stream.

use super::super::mma::{
    lane_chunk, Element, MmaPlan, MmaScore, Rows, ROW_LANES, TILE, WARP_LANES,
};
use super::super::plan::CHUNK;
use super::gather::FragmentGather;
use super::{divide, Rescale, Skeleton, Tile, RESCALE_SLACK_BITS};
use crate::back::ptx::builder::{Cmp, Kernel, Op, Pred, Reg, Shared, F32, S32, U32};

/// Binary exponent σ gives the largest scaled operand of a column: below
/// f16's 65504, and the low parts of the others well inside f16's range.
const HALF_EXPONENT: u32 = 14;
/// The same for queries as integers: below 2^22, so their top byte
/// `d0` of [`Queries`] stays within ±64.
const INT_EXPONENT: u32 = 21;
/// Independent accumulator chains of a score tile's `mma.sync`s on f16 rows
/// loaded whole: one chain waits a full tensor-core latency per 16
/// elements. Gathered rows take one: a step's gather hides that latency,
/// and the second chain's sums cost more than it saves (MosaicKV 1% slower
/// on an H200, twentieth round). Integer keys have one chain per B tile
/// ([`ScoreSums`]).
const HALF_SCORE_CHAINS: u32 = 2;
/// f32 exponent bias and largest finite biased exponent.
const BIAS: u32 = 127;
const MAX_EXPONENT: u32 = 254;

/// Where a lane sits in its warp's fragments.
struct Lanes {
    warp: Reg<U32>,
    /// Fragment row (`lane / 4`) and quad (`lane % 4`).
    row: Reg<U32>,
    quad: Reg<U32>,
    /// Whether the lane's B columns are low parts (odd row).
    low_part: Reg<Pred>,
}

/// A lane's tensor-core score and its warp's softmax, for the whole stream.
pub(super) struct MmaScoreThread {
    lanes: Lanes,
    /// Per column tile: the lane's first query element and whether its B
    /// column's head exists.
    query_at: Vec<(Reg<U32>, Reg<Pred>)>,
    /// The query fragments and the C sums' factor to logits: for the whole
    /// stream, or (with header scales) for the current page.
    queries: Queries,
    /// Byte offset of the lane's first key chunk in a tile's key stream (of
    /// its first item with gathered fragments).
    key_lane: Reg<U32>,
    /// Gathered key fragments: the lane's state.
    gather: Option<FragmentGather>,
    /// The lane's C row in the warp's first token tile (`16 · warp + row`).
    key_row: Reg<U32>,
    /// Per column tile: the warp's softmax state of the lane's C columns' head.
    heads: Vec<WarpHead>,
    /// With item scales: byte offset of the scale of the lane's first token
    /// in the value rows.
    scale_lane: Option<Reg<U32>>,
    /// The lanes whose C rows (halves 0 and 1) are the lane's B token pairs
    /// ([`StepTokens`]).
    sources: [Reg<U32>; 2],
}

/// A warp's softmax state of one head, as each lane of the head's C columns
/// holds it.
struct WarpHead {
    /// The warp's reference, in log2 units (logits times log2 e).
    reference: Reg<F32>,
    /// The lane's sum of the weights against it.
    sum: Reg<F32>,
}

/// A lane's tensor-core accumulate state for the whole stream.
pub(super) struct MmaValues {
    lanes: Lanes,
    /// The weights' place in the logits rows when the score is not on the
    /// tensor cores (they are then read from shared memory).
    shared: Option<SharedWeights>,
    /// Per column tile: whether the C columns' head (the score's, too) exists.
    out_ok: Vec<Reg<Pred>>,
    /// Per column tile and channel tile: the output accumulators.
    acc: Vec<Vec<[Reg<F32>; 4]>>,
    /// With item scales: the weights' running σ ([`Skeleton::mma_item_sigma`]).
    sigma: Option<Reg<F32>>,
    /// Byte offset of the lane's value channels in its first token (of the
    /// token with gathered fragments).
    value_lane: Reg<U32>,
    /// Gathered value fragments: the lane's state.
    gather: Option<FragmentGather>,
    /// With gathered values: per row half of a weights pair, the `prmt`
    /// selector that moves that half to the lane's B column parity
    /// ([`parity_fragments`]).
    parity_selectors: Option<[Reg<U32>; 2]>,
    /// The lane's first token of a step (`16 · warp + spacing · quad`),
    /// and its others' offsets from it ([`StepTokens`]).
    token: Reg<U32>,
    steps: [u32; 4],
}

/// The pipelined stream's carried tile ([`Skeleton::mma_tile`]): its
/// buffer, valid items and softmax weights, its values not yet accumulated.
pub(super) struct Pending {
    buf: Reg<U32>,
    items: Reg<U32>,
    /// Per (slot, column tile, row half), as [`mma_softmax`] returns them.
    weights: Vec<Reg<F32>>,
}

impl Pending {
    /// The tile's buffer and valid items.
    pub(super) fn span(&self) -> (Reg<U32>, Reg<U32>) {
        (self.buf, self.items)
    }
}

/// A tile whose values accumulate: its buffer and valid items, and (with
/// gathered values) whether one of the warp's rows of it has more set bits
/// than its bitmap keeps ([`Skeleton::mma_ready_rows`]).
#[derive(Clone, Copy)]
struct ValueTile {
    buf: Reg<U32>,
    items: Reg<U32>,
    over: Option<Reg<Pred>>,
}

/// Softmax weights the score phase left in the logits rows.
struct SharedWeights {
    /// Per column tile: the weights of the B column's head at the lane's
    /// first token, and whether that head exists.
    columns: Vec<(Reg<U32>, Reg<Pred>)>,
    /// Per column tile: the softmax state slot of the C columns' head.
    state: Vec<Reg<U32>>,
}

/// B fragments of the score, and per column tile the factor from its C
/// sums to logits in log2 units (1/σ of the C columns' head times the
/// softmax scale times log2 e, over 16 for 4-bit codes).
struct Queries {
    /// Per column tile and B tile: the lane's registers, two per reduction
    /// step. f16 keys: one B tile, columns (head, hi / lo part). Integer
    /// keys: the query times σ as a 24-bit integer of three signed bytes,
    /// `d0 · 2^16 + d1 · 2^8 + d2`, in two B tiles: columns (head, d0 / d1),
    /// then (head, d2 / nothing).
    tiles: Vec<Vec<Vec<Reg<U32>>>>,
    to_logits: Vec<Reg<F32>>,
}

/// A slot's score sums per column tile: f16 keys in `chains` chains of f32
/// accumulators taking the steps in turn; integer keys in one s32
/// accumulator per B tile (sums exact).
enum ScoreSums {
    Half(Vec<Vec<[Reg<F32>; 4]>>),
    Int {
        signed: bool,
        sums: Vec<Vec<[Reg<S32>; 4]>>,
    },
}

impl ScoreSums {
    fn new(k: &mut Kernel, score: &MmaScore, column_tiles: u32, chains: u32) -> ScoreSums {
        let tiles = |k: &mut Kernel, per_tile: u32| {
            (0..column_tiles)
                .map(|_| {
                    (0..per_tile)
                        .map(|_| [0; 4].map(|_| k.mov(0.0f32)))
                        .collect()
                })
                .collect()
        };
        match score.key {
            Element::Half => ScoreSums::Half(tiles(k, chains.min(score.key_steps()))),
            Element::Int { signed, .. } => ScoreSums::Int {
                signed,
                sums: (0..column_tiles)
                    .map(|_| {
                        (0..score.query_tiles())
                            .map(|_| [0; 4].map(|_| k.mov(0i32)))
                            .collect()
                    })
                    .collect(),
            },
        }
    }

    /// Reduction step `s` with A fragment `a` and the queries' B tiles.
    fn step(&mut self, k: &mut Kernel, s: usize, a: [Reg<U32>; 4], b: &[Vec<Vec<Reg<U32>>>]) {
        let fragment = |tile: &[Reg<U32>]| [tile[2 * s], tile[2 * s + 1]];
        match self {
            ScoreSums::Half(sums) => {
                for (chains, b) in sums.iter().zip(b) {
                    k.mma_f16_f32(chains[s % chains.len()], a, fragment(&b[0]));
                }
            }
            ScoreSums::Int { signed, sums } => {
                for (tiles, b) in sums.iter().zip(b) {
                    for (&acc, b) in tiles.iter().zip(b) {
                        k.mma_i8_s32(acc, a, fragment(b), *signed);
                    }
                }
            }
        }
    }

    /// The sum of column tile `ct`'s C row half `half` (times the queries' σ).
    fn logit(&self, k: &mut Kernel, ct: usize, half: usize) -> Reg<F32> {
        let (first, second) = (2 * half, 2 * half + 1);
        match self {
            ScoreSums::Half(sums) => (sums[ct].iter())
                .flat_map(|chain| [chain[first], chain[second]])
                .reduce(|sum, part| k.add(sum, part))
                .expect("a chain"),
            ScoreSums::Int { sums, .. } => {
                let [high, middle] = [first, second].map(|i| k.s32_to_f32(sums[ct][0][i]));
                let low = k.s32_to_f32(sums[ct][1][first]);
                let sum = k.fma(middle, 256.0f32, low);
                k.fma(high, 65536.0f32, sum)
            }
        }
    }
}

impl Skeleton<'_> {
    /// Token tiles (or accumulate steps) per warp: slot `j` is tile
    /// `warp + j · warps`.
    pub(super) fn mma_slots(&self, m: &MmaPlan) -> u32 {
        m.token_tiles.div_ceil(self.plan.warps)
    }

    /// `Some(whether slot j's tile exists)` when some warp has no tile in it.
    fn mma_slot_ok(
        &self,
        k: &mut Kernel,
        m: &MmaPlan,
        warp: Reg<U32>,
        j: u32,
    ) -> Option<Reg<Pred>> {
        let warps = self.plan.warps;
        ((j + 1) * warps > m.token_tiles).then(|| k.setp(Cmp::Lt, warp, m.token_tiles - j * warps))
    }

    /// The lane's place in the fragments.
    fn mma_lanes(&self, k: &mut Kernel) -> Lanes {
        let warp = k.shr(self.tid, 5u32);
        let lane = k.and(self.tid, 31u32);
        let row = k.shr(lane, 2u32);
        let quad = k.and(lane, 3u32);
        let parity = k.and(row, 1u32);
        let low_part = k.setp(Cmp::Eq, parity, 1u32);
        Lanes {
            warp,
            row,
            quad,
            low_part,
        }
    }

    /// `(min(head, group_max − 1), smem + 4 · that)`: a head's slot in the
    /// per-head arrays, clamped for heads past the kernel's group.
    fn mma_head_slot(&self, k: &mut Kernel, head: Reg<U32>) -> (Reg<U32>, Reg<U32>) {
        let clamped = k.min(head, self.plan.group_max - 1);
        (clamped, k.mad_lo(clamped, 4u32, self.smem))
    }

    /// The score's and the warp softmax's constant state.
    pub(super) fn mma_score_setup(
        &self,
        k: &mut Kernel,
        m: &MmaPlan,
        s: &MmaScore,
    ) -> MmaScoreThread {
        let plan = self.plan;
        k.comment(&format!(
            "tensor-core score, softmax per warp: {} token tile(s) per warp, {} column tile(s), {:?} keys",
            self.mma_slots(m),
            m.column_tiles,
            s.key,
        ));
        let lanes = self.mma_lanes(k);
        let row_head = k.shr(lanes.row, 1u32);
        let chunk = self.lane_chunk_part(k, &lanes);
        let query = s.query.index();
        let query_base = self.array_base(k, query);
        let query_at: Vec<(Reg<U32>, Reg<Pred>)> = (0..m.column_tiles)
            .map(|ct| {
                let head = k.add(row_head, 4 * ct);
                let ok = k.setp(Cmp::Lt, head, self.group);
                let (clamped, _) = self.mma_head_slot(k, head);
                let at = k.mad_lo(clamped, plan.array_stride[query], query_base);
                (k.mad_lo(chunk, 4 * s.chunk_elements(), at), ok)
            })
            .collect();
        let key_row = k.mad_lo(lanes.warp, TILE, lanes.row);
        let gather =
            (m.key_fragments()).map(|g| FragmentGather::for_keys(k, g, s, &plan.key, lanes.quad));
        let key_chunk = match gather {
            Some(_) => k.mov(0u32),
            None => k.shl(chunk, 4u32),
        };
        let key_lane = k.mad_lo(key_row, m.key_rows.stride, key_chunk);
        let zero = k.mov(0.0f32);
        let queries = match s.key_scale {
            None => self.mma_queries(k, s, &lanes, &query_at, None),
            // Set by each page's first tile.
            Some(_) => Queries {
                tiles: (0..m.column_tiles)
                    .map(|_| {
                        (0..s.query_tiles())
                            .map(|_| (0..s.key_registers()).map(|_| k.mov(0u32)).collect())
                            .collect()
                    })
                    .collect(),
                to_logits: (0..m.column_tiles).map(|_| k.mov(zero)).collect(),
            },
        };
        let neg_inf = k.mov(f32::NEG_INFINITY);
        let heads = (0..m.column_tiles)
            .map(|_| WarpHead {
                reference: k.mov(neg_inf),
                sum: k.mov(zero),
            })
            .collect();
        let scale_lane = (m.item_scale).map(|bit| k.mad_lo(key_row, m.value_rows.stride, bit / 8));
        // Lane 4·r + q holds C row r's columns 2q, 2q + 1.
        let steps = StepTokens::of(m);
        let source = k.mul(lanes.quad, 4 * steps.spacing);
        let source = k.add(source, row_head);
        let sources = [source, k.add(source, 4 * steps.second)];
        MmaScoreThread {
            lanes,
            query_at,
            queries,
            key_lane,
            gather,
            key_row,
            heads,
            scale_lane,
            sources,
        }
    }

    /// The accumulate's constant state: zero accumulators, the lane's
    /// value channels and (with the weights in shared memory) their columns.
    pub(super) fn mma_values_setup(&self, k: &mut Kernel, m: &MmaPlan) -> MmaValues {
        k.comment(&format!(
            "tensor-core accumulate: {} step(s) per warp, {} column tile(s), {:?} values",
            self.mma_slots(m),
            m.column_tiles,
            m.value
        ));
        let lanes = self.mma_lanes(k);
        let steps = StepTokens::of(m);
        let token = k.mul(lanes.quad, steps.spacing);
        let token = k.mad_lo(lanes.warp, TILE, token);
        let zero = k.mov(0.0f32);
        // Gathered values: columns (head, channel parity), one C tile per two
        // channel tiles ([`channel_pair_products`]).
        let acc_tiles = match m.value_fragments() {
            Some(_) => m.channel_tiles() / 2,
            None => m.channel_tiles(),
        };
        let (mut out_ok, mut acc) = (Vec::new(), Vec::new());
        for ct in 0..m.column_tiles {
            let out_head = k.add(lanes.quad, 4 * ct);
            out_ok.push(k.setp(Cmp::Lt, out_head, self.group));
            acc.push(
                (0..acc_tiles)
                    .map(|_| [0; 4].map(|_| k.mov(zero)))
                    .collect(),
            );
        }
        let parity_selectors = m.value_fragments().map(|_| {
            [0u32, 1].map(|half| {
                // Bytes 4..8 are the zero operand's.
                let (low, high) = (2 * half, 2 * half + 1);
                let even = low | high << 4 | 0x4400;
                let odd = 0x44 | low << 8 | high << 12;
                k.selp(odd, even, lanes.low_part)
            })
        });
        let shared = m
            .score
            .is_none()
            .then(|| self.mma_shared_weights(k, m, &lanes, token));
        // The largest σ: the first tile sets the real one.
        let sigma = (m.item_scale).map(|_| k.mov(f32::from_bits(MAX_EXPONENT << 23)));
        let gather = (m.value_fragments())
            .map(|g| FragmentGather::for_values(k, g, m, &self.plan.value, lanes.row));
        let channels = match gather {
            Some(_) => k.mov(0u32),
            None => k.mad_lo(lanes.row, m.group_words() * 4, m.value_offset),
        };
        let value_lane = k.mad_lo(token, m.value_rows.stride, channels);
        MmaValues {
            lanes,
            shared,
            out_ok,
            acc,
            sigma,
            value_lane,
            gather,
            parity_selectors,
            token,
            steps: steps.offsets(),
        }
    }

    /// Where the lane finds its B weights in the logits rows.
    fn mma_shared_weights(
        &self,
        k: &mut Kernel,
        m: &MmaPlan,
        lanes: &Lanes,
        token: Reg<U32>,
    ) -> SharedWeights {
        let plan = self.plan;
        let row_head = k.shr(lanes.row, 1u32);
        let logits = k.add(self.smem, plan.logits);
        let row_bytes = 4 * plan.head_stride;
        let (mut columns, mut state) = (Vec::new(), Vec::new());
        for ct in 0..m.column_tiles {
            let head = k.add(row_head, 4 * ct);
            let ok = k.setp(Cmp::Lt, head, self.group);
            let (clamped, _) = self.mma_head_slot(k, head);
            let column = k.mad_lo(clamped, 4u32, logits);
            columns.push((k.mad_lo(token, row_bytes, column), ok));
            let out_head = k.add(lanes.quad, 4 * ct);
            state.push(self.mma_head_slot(k, out_head).1);
        }
        SharedWeights { columns, state }
    }

    /// The lane's query pairs of every column tile (times the header scales
    /// at `header` when the key has them) scaled by σ and split into parts,
    /// and the factor from its C sums to logits in log2 units.
    fn mma_queries(
        &self,
        k: &mut Kernel,
        m: &MmaScore,
        lanes: &Lanes,
        query_at: &[(Reg<U32>, Reg<Pred>)],
        header: Option<Reg<U32>>,
    ) -> Queries {
        let chunk = m.chunk_elements();
        let spread = self.spread_chunks();
        // The lane's chunk c holds elements chunk · (its chunk index), contiguous.
        let scales_at = header.map(|h| {
            let slot0 = m.key_scale.expect("header scales");
            let lane_chunk = self.lane_chunk_part(k, lanes);
            let first = k.mad_lo(lane_chunk, 4 * chunk, h);
            k.add(first, 4 * slot0)
        });
        // Logits in log2 units; 4-bit codes enter as 16 times the code.
        let code_scale = match m.key {
            Element::Int { bits, .. } => 1.0 / (1u32 << (8 - bits)) as f32,
            Element::Half => 1.0,
        };
        let softmax_scale = k.ld_param(&self.p.softmax_scale);
        let factor = k.mul(softmax_scale, std::f32::consts::LOG2_E * code_scale);
        let mut tiles = Vec::new();
        let mut to_logits = Vec::new();
        for &(at, ok) in query_at {
            let mut elements = Vec::new();
            for c in 0..m.lane_chunks() {
                for v in 0..chunk / 4 {
                    let offset = i64::from(4 * (chunk * lane_chunk(spread, c) + 4 * v));
                    let q = k.ld_shared_v4::<F32>(Shared::at(at).plus(offset));
                    let s = scales_at.map(|s| k.ld_shared_v4::<F32>(Shared::at(s).plus(offset)));
                    for (i, x) in q.into_iter().enumerate() {
                        let x = match s {
                            Some(s) => k.mul(x, s[i]),
                            None => x,
                        };
                        elements.push(k.selp(x, 0.0f32, ok));
                    }
                }
            }
            // Element i of the row is the lane's (i / 4·chunk)-th chunk's
            // (i % 4·chunk)-th: `elements` holds the chunks back to back.
            let position =
                |i: u32| (i / (ROW_LANES * chunk) * chunk + i % (ROW_LANES * chunk)) as usize;
            let of_register = |r: u32| -> Vec<usize> {
                (0..m.register_elements())
                    .map(|e| position(m.key_element(r, e)))
                    .collect()
            };
            // A B column's lanes: the four of its row.
            let (sigma, column_tiles) = match m.key {
                Element::Half => {
                    let sigma = column_sigma(k, &elements, &[1, 2], HALF_EXPONENT);
                    let scaled: Vec<Reg<F32>> = elements.iter().map(|&x| k.mul(x, sigma)).collect();
                    let pairs = (0..m.key_registers())
                        .map(|r| {
                            let at = of_register(r);
                            f16_part(k, scaled[at[0]], scaled[at[1]], lanes.low_part)
                        })
                        .collect();
                    (sigma, vec![pairs])
                }
                Element::Int { .. } => {
                    let sigma = column_sigma(k, &elements, &[1, 2], INT_EXPONENT);
                    // Q = d0 · 2^16 + d1 · 2^8 + d2 with signed bytes: d2 is
                    // Q's byte 0, d1 byte 1 of Q + 2^7, d0 byte 2 of Q +
                    // 2^15 + 2^7 (each carry rounds the digits above).
                    let odd = lanes.low_part;
                    let carry = k.selp(0x80u32, 0x8080u32, odd);
                    let byte = k.selp(0x51u32, 0x62u32, odd);
                    let even = k.selp(0u32, u32::MAX, odd);
                    let digits: Vec<[Reg<U32>; 2]> = (elements.iter())
                        .map(|&x| {
                            let scaled = k.mul(x, sigma);
                            let q = k.f32_to_s32(scaled);
                            let q = k.bitcast::<S32, U32>(q);
                            [k.add(q, carry), q]
                        })
                        .collect();
                    let tiles = [(byte, None), (k.mov(0x40u32), Some(even))]
                        .into_iter()
                        .enumerate()
                        .map(|(tile, (selector, mask))| {
                            (0..m.key_registers())
                                .map(|r| {
                                    let at = of_register(r);
                                    let [a, b, c, d] = [0, 1, 2, 3].map(|i| digits[at[i]][tile]);
                                    let low = k.prmt_by(a, b, selector);
                                    let high = k.prmt_by(c, d, selector);
                                    let packed = k.prmt(low, high, 0x5410);
                                    match mask {
                                        Some(mask) => k.and(packed, mask),
                                        None => packed,
                                    }
                                })
                                .collect()
                        })
                        .collect();
                    (sigma, tiles)
                }
            };
            tiles.push(column_tiles);
            // 1/σ of head 4·ct + quad: lane 8·quad's B column is that head's.
            let inverse = unscale_of(k, sigma);
            let owner = k.shl(lanes.quad, 3u32);
            let inverse = k.shfl_idx(inverse, owner);
            to_logits.push(k.mul(inverse, factor));
        }
        Queries { tiles, to_logits }
    }

    /// The lane's C sums, by slot, column tile and row half, in units of
    /// their column tile's `to_logits` (the softmax folds that factor into
    /// the step it takes anyway, twentieth round): token
    /// `16 · (warp + slot · warps) + row + 8 · half`, head `4 · column tile +
    /// quad`. Every lane runs every slot whose tile exists (rows past the
    /// tile's items read stale bytes: an mma row depends only on its own A
    /// row, and those logits are never used).
    pub(super) fn mma_logits(
        &self,
        k: &mut Kernel,
        tile: &Tile,
        t: &MmaScoreThread,
        over: Option<Reg<Pred>>,
    ) -> Vec<Reg<F32>> {
        let plan = self.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let score = m.score.as_ref().expect("tensor-core score");
        let queries = &t.queries;
        if score.key_scale.is_some() {
            k.comment("a page's first tile: the query times the page's header scales");
            let later = k.label();
            if let Some(first) = tile.first {
                let page_start = k.setp(Cmp::Eq, first, 0u32);
                k.bra_if(page_start, false, later);
            }
            let page = self.mma_queries(k, score, &t.lanes, &t.query_at, Some(tile.header));
            let registers = |q: &Queries| q.tiles.iter().flatten().flatten().copied().collect();
            let (to, from): (Vec<Reg<U32>>, Vec<Reg<U32>>) = (registers(queries), registers(&page));
            for (to, from) in to.iter().zip(&from) {
                k.assign(*to, *from);
            }
            for (to, from) in queries.to_logits.iter().zip(&page.to_logits) {
                k.assign(*to, *from);
            }
            k.place(later);
        }
        let stride = m.key_rows.stride;
        let spread = self.spread_chunks();
        let base = self.mma_rows(k, tile.buf, m.key_rows);
        let lane_base = k.add(base, t.key_lane);
        let mut logits = Vec::new();
        let chains = match t.gather {
            Some(_) => 1,
            None => HALF_SCORE_CHAINS,
        };
        for j in 0..self.mma_slots(m) {
            let mut sums = ScoreSums::new(k, score, m.column_tiles, chains);
            let skip = k.label();
            if let Some(ok) = self.mma_slot_ok(k, m, t.lanes.warp, j) {
                k.bra_if(ok, false, skip);
            }
            let half_offset = |half: u32| (j * plan.warps * TILE + 8 * half) * stride;
            let rows: Vec<Vec<Reg<U32>>> = match &t.gather {
                Some(gather) => {
                    let items = [0, 1].map(|half| k.add(lane_base, half_offset(half)));
                    let over = over.expect("gathers check their rows");
                    gather.rows(k, &items, over)
                }
                None => (0..2)
                    .map(|half| {
                        let offset = half_offset(half);
                        let words: Vec<Reg<U32>> = (0..score.lane_chunks())
                            .flat_map(|c| {
                                let at = Shared::at(lane_base)
                                    .plus(i64::from(offset + CHUNK * lane_chunk(spread, c)));
                                let at = swizzled_if(k, m.key_rows.swizzled, at);
                                k.ld_shared_v4::<U32>(at)
                            })
                            .collect();
                        words
                            .into_iter()
                            .flat_map(|w| key_registers(k, score.key, w))
                            .collect()
                    })
                    .collect(),
            };
            for s in 0..score.key_steps() as usize {
                let a = [
                    rows[0][2 * s],
                    rows[1][2 * s],
                    rows[0][2 * s + 1],
                    rows[1][2 * s + 1],
                ];
                sums.step(k, s, a, &queries.tiles);
            }
            k.place(skip);
            for ct in 0..queries.to_logits.len() {
                for half in 0..2 {
                    logits.push(sums.logit(k, ct, half));
                }
            }
        }
        logits
    }

    /// Whether the key rows' chunks are spread over the lanes ([`lane_chunk`]).
    fn spread_chunks(&self) -> bool {
        (self.plan.mma.as_ref()).is_some_and(|m| m.key_rows.swizzled)
    }

    /// The lane part of the key row chunks the lane loads ([`lane_chunk`]).
    fn lane_chunk_part(&self, k: &mut Kernel, lanes: &Lanes) -> Reg<U32> {
        if !self.spread_chunks() {
            return lanes.quad;
        }
        let low = k.and(lanes.quad, 1u32);
        let high = k.and(lanes.quad, 2u32);
        k.mad_lo(high, 2u32, low)
    }

    /// Row 0 of a side's rows for the tile in buffer `buf`.
    fn mma_rows(&self, k: &mut Kernel, buf: Reg<U32>, rows: Rows) -> Reg<U32> {
        match rows.staged {
            true => k.add(self.smem, rows.offset),
            false => k.add(buf, rows.offset),
        }
    }

    /// The pipeline's carried state, empty before the first tile. Its buffer
    /// is tile −1's, whose values no copy writes while the first tile's
    /// products read its (unused) rows.
    pub(super) fn mma_pending_setup(&self, k: &mut Kernel, m: &MmaPlan) -> Pending {
        let plan = self.plan;
        let weights = self.mma_slots(m) * m.column_tiles * 2;
        Pending {
            buf: k.add(
                self.smem,
                plan.buffers + (plan.stages - 1) * plan.buffer_bytes,
            ),
            items: k.mov(0u32),
            weights: (0..weights).map(|_| k.mov(0.0f32)).collect(),
        }
    }

    /// Per (slot, row half): whether the lane's C row is one of the `items`
    /// of its tile.
    fn mma_rows_in(
        &self,
        k: &mut Kernel,
        score: &MmaScoreThread,
        items: Reg<U32>,
    ) -> Vec<Reg<Pred>> {
        let plan = self.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        (0..self.mma_slots(m))
            .flat_map(|j| [0, 1].map(|half| (j, half)))
            .map(|(j, half)| {
                let token = k.add(score.key_row, j * plan.warps * TILE + 8 * half);
                k.setp(Cmp::Lt, token, items)
            })
            .collect()
    }

    /// One tile with the score on the tensor cores. Unpipelined: the warp's
    /// logits, its softmax, and its tokens' values times their weights.
    /// Pipelined: the logits of this tile, the pending tile's values times
    /// its weights, then this tile's softmax, whose weights become the
    /// pending ones. The score and the products share no data, so ptxas
    /// interleaves them; the products come before the softmax, whose decay
    /// they must take.
    pub(super) fn mma_tile(
        &self,
        k: &mut Kernel,
        tile: &Tile,
        pending: Option<&Pending>,
        score: &MmaScoreThread,
        values: &MmaValues,
    ) {
        let in_tile = self.mma_rows_in(k, score, tile.items);
        let values_buf = pending.map_or(tile.buf, |p| p.buf);
        let values_items = pending.map_or(tile.items, |p| p.items);
        let over = self.mma_ready_rows(
            k,
            Some((score, tile.buf)),
            Some((values, values_buf, values_items)),
        );
        let Some(pending) = pending else {
            // The item scales and σ first: they do not wait for the score.
            let scales = self.mma_item_scales(k, score, values, tile.buf, &in_tile);
            let logits = self.mma_logits(k, tile, score, over);
            let weights = mma_softmax(k, score, values, &logits, &in_tile);
            let tile = ValueTile {
                buf: tile.buf,
                items: tile.items,
                over,
            };
            self.mma_weighted_products(k, score, values, tile, &weights, scales);
            return;
        };
        let logits = self.mma_logits(k, tile, score, over);
        self.mma_drain(k, pending, score, values, over);
        let weights = mma_softmax(k, score, values, &logits, &in_tile);
        for (&to, &from) in pending.weights.iter().zip(&weights) {
            k.assign(to, from);
        }
        k.assign(pending.items, tile.items);
        k.assign(pending.buf, tile.buf);
    }

    /// The pending tile's values times its weights (times its item scales
    /// and σ, whose rescale of the accumulators comes first); `over` as
    /// [`Self::mma_ready_rows`] answers for them (`None`: checked here).
    pub(super) fn mma_drain(
        &self,
        k: &mut Kernel,
        pending: &Pending,
        score: &MmaScoreThread,
        values: &MmaValues,
        over: Option<Reg<Pred>>,
    ) {
        let over = over
            .or_else(|| self.mma_ready_rows(k, None, Some((values, pending.buf, pending.items))));
        let in_tile = self.mma_rows_in(k, score, pending.items);
        let scales = self.mma_item_scales(k, score, values, pending.buf, &in_tile);
        let tile = ValueTile {
            buf: pending.buf,
            items: pending.items,
            over,
        };
        self.mma_weighted_products(k, score, values, tile, &pending.weights, scales);
    }

    /// With gathered fragments, readies the rows the warp gathers from (its
    /// tokens of the key tile in buffer `keys.1` and of the value tile in
    /// `values.1`) and answers whether one has more set bits than its
    /// bitmap's `keep`, in any lane. Lane `l` takes the warp's token `l %
    /// 16` of slot `2 · i + l / 16`.
    ///
    /// Readying: in a tile with fewer items (`values.2`) than rows, the masks
    /// of the warp's value rows past them are zeroed, so their gathered words
    /// are zeros, where stale rows may hold any bits (0 · NaN poisons a sum),
    /// without a test per row in every tile (twentieth round). Stale key rows
    /// only meet logits the softmax drops.
    fn mma_ready_rows(
        &self,
        k: &mut Kernel,
        keys: Option<(&MmaScoreThread, Reg<U32>)>,
        values: Option<(&MmaValues, Reg<U32>, Reg<U32>)>,
    ) -> Option<Reg<Pred>> {
        let plan = self.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let sides: Vec<(&FragmentGather, Reg<U32>)> = [
            keys.and_then(|(t, buf)| Some((t.gather.as_ref()?, buf))),
            values.and_then(|(t, buf, _)| Some((t.gather.as_ref()?, buf))),
        ]
        .into_iter()
        .flatten()
        .collect();
        if sides.is_empty() {
            return None;
        }
        let warp = k.shr(self.tid, 5u32);
        let lane = k.and(self.tid, 31u32);
        let token = k.and(lane, 15u32);
        let half = k.shr(lane, 4u32);
        let rows: Vec<(Reg<U32>, Reg<Pred>)> = (0..self.mma_slots(m).div_ceil(2))
            .map(|i| {
                let slot = k.add(half, 2 * i);
                let tile = k.mad_lo(slot, plan.warps, warp);
                let row = k.mad_lo(tile, TILE, token);
                let read = k.setp(Cmp::Lt, row, plan.tile_items);
                // Rows past the tile are not checked, nor read.
                (k.min(row, plan.tile_items - 1), read)
            })
            .collect();
        if let Some((
            MmaValues {
                gather: Some(gather),
                ..
            },
            buf,
            items,
        )) = values
        {
            let full = k.setp(Cmp::Ge, items, plan.tile_items);
            let zeroed = k.label();
            k.bra_if(full, true, zeroed);
            let stale: Vec<(Reg<U32>, Reg<Pred>)> = (rows.iter())
                .map(|&(row, read)| {
                    let past = k.setp(Cmp::Ge, row, items);
                    (row, k.and_pred(past, read))
                })
                .collect();
            gather.zero_masks(k, buf, &stale);
            // A tile's items are the CTA's, so is the branch. A warp barrier
            // would do (each warp zeroes and reads its own rows), but ptxas
            // drops it in a converged warp and racecheck then flags the rows.
            k.bar_sync();
            k.place(zeroed);
        }
        let overs: Vec<Reg<Pred>> = (sides.iter())
            .map(|&(gather, buf)| gather.rows_over(k, buf, &rows))
            .collect();
        let over = (overs.into_iter())
            .reduce(|a, b| k.or_pred(a, b))
            .expect("a side");
        Some(k.vote_any(over))
    }

    /// The values of `tile` times its softmax `weights` ([`mma_softmax`]'s
    /// order) and item `scales`: the weights'
    /// f16 parts, moved to the accumulate's B fragments, into the products.
    fn mma_weighted_products(
        &self,
        k: &mut Kernel,
        score: &MmaScoreThread,
        values: &MmaValues,
        tile: ValueTile,
        weights: &[Reg<F32>],
        scales: Option<Vec<Reg<F32>>>,
    ) {
        let parts = weight_parts(k, weights, score.heads.len(), scales.as_deref());
        let b = mma_exchange(k, score, values, &parts);
        self.mma_products(k, tile, values, &b);
    }

    /// With item scales: those of the lane's C rows of the tile in `buf`
    /// (`in_tile` per slot and row half) times σ ([`Self::mma_item_sigma`]).
    fn mma_item_scales(
        &self,
        k: &mut Kernel,
        score: &MmaScoreThread,
        values: &MmaValues,
        buf: Reg<U32>,
        in_tile: &[Reg<Pred>],
    ) -> Option<Vec<Reg<F32>>> {
        let plan = self.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let lane = score.scale_lane?;
        let rows = self.mma_rows(k, buf, m.value_rows);
        let rows = k.add(rows, lane);
        let scales: Vec<Reg<F32>> = (0..in_tile.len() as u32)
            .map(|token| {
                let offset =
                    ((token / 2) * plan.warps * TILE + 8 * (token % 2)) * m.value_rows.stride;
                let at = Shared::at(rows).plus(offset.into());
                item_scale(k, at, in_tile[token as usize])
            })
            .collect();
        // The warp's tokens: rows of the lanes of one quad.
        Some(self.mma_item_sigma(k, values, &scales, &[4, 8, 16]))
    }

    /// The tile's weighted values into the lane's accumulators, the weights
    /// read from the logits rows; first, with `rescale`, the accumulators
    /// times their head's decay.
    pub(super) fn mma_accumulate(
        &self,
        k: &mut Kernel,
        tile: &Tile,
        t: &MmaValues,
        rescale: Rescale,
    ) {
        let plan = self.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let shared = t.shared.as_ref().expect("weights in the logits rows");
        let kept = k.label();
        if let Rescale::When(p) = rescale {
            k.bra_if(p, false, kept);
        }
        for (acc, &state) in t.acc.iter().zip(&shared.state) {
            let decay = k.ld_shared::<F32>(Shared::at(state).plus(plan.decay.into()));
            scale_all(k, acc, decay);
        }
        k.place(kept);
        let stride = m.value_rows.stride;
        let row_bytes = 4 * plan.head_stride;
        let items = self.mma_rows(k, tile.buf, m.value_rows);
        let token_rows = k.mad_lo(t.token, stride, items);
        let slots = self.mma_slots(m);
        let ok: Vec<Vec<Reg<Pred>>> = (0..slots)
            .map(|j| {
                (t.steps.iter())
                    .map(|&d| {
                        let token = k.add(t.token, j * plan.warps * TILE + d);
                        k.setp(Cmp::Lt, token, tile.items)
                    })
                    .collect()
            })
            .collect();
        // Per slot, the lane's 4 tokens' item scales times σ.
        let scales: Option<Vec<Reg<F32>>> = m.item_scale.map(|bit| {
            let scales: Vec<Reg<F32>> = (0..slots)
                .flat_map(|j| t.steps.iter().map(move |&d| (j, d)))
                .zip(ok.iter().flatten())
                .map(|((j, d), &ok)| {
                    let offset = (j * plan.warps * TILE + d) * stride + bit / 8;
                    item_scale(k, Shared::at(token_rows).plus(offset.into()), ok)
                })
                .collect();
            // The warp's tokens: quads of the lanes of one row.
            self.mma_item_sigma(k, t, &scales, &[1, 2])
        });
        // Per slot and column tile: the lane's 4 weights (times the item
        // scales and σ; zero past the tile's items and for heads the group
        // lacks) as B fragments.
        let mut b = Vec::new();
        for j in 0..slots {
            let first = j * plan.warps * TILE;
            let mut columns = Vec::new();
            for &(column, head_ok) in &shared.columns {
                let w: Vec<Reg<F32>> = (t.steps.iter().enumerate())
                    .map(|(i, &d)| {
                        let offset = (first + d) * row_bytes;
                        let w = k.mov(0.0f32);
                        k.guarded(ok[j as usize][i], true, |k| {
                            let at = Shared::at(column).plus(offset.into());
                            let loaded = k.ld_shared::<F32>(at);
                            k.assign(w, loaded);
                        });
                        let w = match &scales {
                            Some(s) => k.mul(w, s[t.steps.len() * j as usize + i]),
                            None => w,
                        };
                        k.selp(w, 0.0f32, head_ok)
                    })
                    .collect();
                columns.push(match t.parity_selectors {
                    Some(selectors) => {
                        let pairs = [(w[0], w[1]), (w[2], w[3])].map(|(a, b)| {
                            let (hi, lo) = f16_parts(k, a, b);
                            [hi, lo]
                        });
                        parity_fragments(k, pairs, selectors)
                    }
                    None => vec![[
                        f16_part(k, w[0], w[1], t.lanes.low_part),
                        f16_part(k, w[2], w[3], t.lanes.low_part),
                    ]],
                });
            }
            b.push(columns);
        }
        let over = self.mma_ready_rows(k, None, Some((t, tile.buf, tile.items)));
        let tile = ValueTile {
            buf: tile.buf,
            items: tile.items,
            over,
        };
        self.mma_products(k, tile, t, &b);
    }

    /// The values of `tile` times the weights' B fragments `b` (per slot and
    /// column tile, [`mma_exchange`]'s) into the lane's accumulators.
    fn mma_products(
        &self,
        k: &mut Kernel,
        tile: ValueTile,
        t: &MmaValues,
        b: &[Vec<Vec<[Reg<U32>; 2]>>],
    ) {
        let plan = self.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let stride = m.value_rows.stride;
        let items = tile.items;
        let rows = self.mma_rows(k, tile.buf, m.value_rows);
        let lane_base = k.add(rows, t.value_lane);
        for (j, b) in (0u32..).zip(b) {
            let skip = k.label();
            if let Some(ok) = self.mma_slot_ok(k, m, t.lanes.warp, j) {
                k.bra_if(ok, false, skip);
            }
            let first = j * plan.warps * TILE;
            let values: Vec<TokenWords> = match &t.gather {
                Some(gather) => {
                    let items_at: Vec<Reg<U32>> = (t.steps.iter())
                        .map(|&d| k.add(lane_base, (first + d) * stride))
                        .collect();
                    // Rows past the tile's items have zero masks (Self::mma_ready_rows).
                    let over = tile.over.expect("gathers check their rows");
                    (gather.rows(k, &items_at, over).into_iter())
                        .map(|words| TokenWords { words, skew: 0 })
                        .collect()
                }
                None => (t.steps.iter())
                    .map(|&d| {
                        let offset = (first + d) * stride;
                        let mut token = self.mma_value_words(k, m, lane_base, offset);
                        // Stale f16 rows past the tile's items may hold any
                        // bits (0 · NaN poisons a sum); integers are always finite.
                        if m.value == Element::Half {
                            let at = k.add(t.token, first + d);
                            let ok = k.setp(Cmp::Lt, at, items);
                            token.words =
                                (token.words.iter()).map(|&w| k.selp(w, 0u32, ok)).collect();
                        }
                        token
                    })
                    .collect(),
            };
            for (ct, sums) in t.acc.iter().enumerate() {
                if t.gather.is_some() {
                    channel_pair_products(k, &values, sums, &b[ct]);
                    continue;
                }
                for (tile_index, c) in sums.iter().enumerate() {
                    let channel = 2 * tile_index as u32;
                    let a = [
                        token_pair(k, m.value, &values[0], &values[1], channel),
                        token_pair(k, m.value, &values[0], &values[1], channel + 1),
                        token_pair(k, m.value, &values[2], &values[3], channel),
                        token_pair(k, m.value, &values[2], &values[3], channel + 1),
                    ];
                    k.mma_f16_f32(*c, a, b[ct][0]);
                }
            }
            k.place(skip);
        }
    }

    /// The weights' σ for a tile whose tokens' item scales are `scales`
    /// (the warp's tokens in the lanes the butterfly `masks` reach): the
    /// largest weight is 2^8 ([`RESCALE_SLACK_BITS`]), so σ of the largest
    /// scale times 2^8 keeps every weight times its scale in f16's range.
    /// The running σ only drops; when it does, the accumulators take the
    /// ratio. Returns the scales times σ.
    fn mma_item_sigma(
        &self,
        k: &mut Kernel,
        t: &MmaValues,
        scales: &[Reg<F32>],
        masks: &[u32],
    ) -> Vec<Reg<F32>> {
        let sigma = t.sigma.expect("σ with item scales");
        let tile = column_sigma(k, scales, masks, HALF_EXPONENT - RESCALE_SLACK_BITS as u32);
        let lower = k.setp(Cmp::Lt, tile, sigma);
        let kept = k.label();
        // σ is the same in every lane: so is the branch.
        k.bra_if(lower, false, kept);
        let inverse = unscale_of(k, sigma);
        let ratio = k.mul(tile, inverse);
        for acc in &t.acc {
            scale_all(k, acc, ratio);
        }
        k.assign(sigma, tile);
        k.place(kept);
        scales.iter().map(|&s| k.mul(s, sigma)).collect()
    }

    /// The words of one token's channels of the lane's group, `offset` bytes
    /// past `lane_base`: 16-byte loads when aligned; aligned words starting
    /// a known `skew` bytes before the channels when the rows' stride and
    /// the channels' offset are even (the byte permutes that pair tokens
    /// absorb the skew); else aligned words funnel-shifted into place.
    fn mma_value_words(
        &self,
        k: &mut Kernel,
        m: &MmaPlan,
        lane_base: Reg<U32>,
        offset: u32,
    ) -> TokenWords {
        let n = m.group_words();
        if m.value_aligned {
            let words = (0..n / 4)
                .flat_map(|v| {
                    let at = Shared::at(lane_base).plus(i64::from(offset + 16 * v));
                    let at = swizzled_if(k, m.value_rows.swizzled, at);
                    k.ld_shared_v4::<U32>(at)
                })
                .collect();
            return TokenWords { words, skew: 0 };
        }
        if m.value_rows.stride.is_multiple_of(2) && m.value_offset.is_multiple_of(2) {
            // Token rows start at even multiples of the stride from the
            // buffer (16-aligned), lane groups at whole words of channels:
            // `lane_base` is `value_offset` past a word boundary.
            let skew = (m.value_offset + offset) % 4;
            let first = i64::from(offset) - i64::from(skew);
            let words = (0..n + u32::from(skew != 0))
                .map(|w| k.ld_shared::<U32>(Shared::at(lane_base).plus(first + i64::from(4 * w))))
                .collect();
            return TokenWords { words, skew };
        }
        let at = k.add(lane_base, offset);
        let aligned = k.and(at, !3u32);
        let misaligned = k.and(at, 3u32);
        let shift = k.shl(misaligned, 3u32);
        let words: Vec<Reg<U32>> = (0..=n)
            .map(|w| k.ld_shared::<U32>(Shared::at(aligned).plus(i64::from(4 * w))))
            .collect();
        let words = words
            .windows(2)
            .map(|pair| k.shf_r_wrap(pair[0], pair[1], shift))
            .collect();
        TokenWords { words, skew: 0 }
    }

    /// After the stream (all threads past its last barrier): each head's
    /// reference becomes the largest of the warps'; each warp's sums and
    /// accumulators are scaled to it (and the accumulators by 1/σ), and the
    /// head's reference and sum go to its softmax state.
    pub(super) fn mma_warp_finish(&self, k: &mut Kernel, t: &MmaScoreThread, v: &MmaValues) {
        let plan = self.plan;
        k.comment("the warps' softmax states meet: one reference per head");
        let area = k.add(self.smem, plan.logits);
        let warp_bytes = 4 * plan.head_stride;
        let sums = i64::from(plan.warps * warp_bytes);
        let top = k.setp(Cmp::Eq, t.lanes.row, 0u32);
        let mut slots = Vec::new();
        for ((ct, head), &head_ok) in (0u32..).zip(&t.heads).zip(&v.out_ok) {
            let index = k.add(t.lanes.quad, 4 * ct);
            let (clamped, state) = self.mma_head_slot(k, index);
            let slot = k.mad_lo(clamped, 4u32, area);
            let mine = k.mad_lo(t.lanes.warp, warp_bytes, slot);
            let mut sum = head.sum;
            for mask in [4, 8, 16] {
                let other = k.shfl_bfly(sum, mask);
                sum = k.add(sum, other);
            }
            let writer = k.and_pred(top, head_ok);
            k.guarded(writer, true, |k| {
                k.st_shared(Shared::at(mine), head.reference);
                k.st_shared(Shared::at(mine).plus(sums), sum);
            });
            slots.push((slot, state));
        }
        k.bar_sync();
        let first_warp = k.setp(Cmp::Eq, t.lanes.warp, 0u32);
        let leader = k.and_pred(first_warp, top);
        let per_head = t.heads.iter().zip(slots).zip(&v.acc).zip(&v.out_ok);
        for (((head, (slot, state)), acc), &head_ok) in per_head {
            let at = |w: u32| Shared::at(slot).plus(i64::from(w * warp_bytes));
            let references: Vec<Reg<F32>> =
                (0..plan.warps).map(|w| k.ld_shared::<F32>(at(w))).collect();
            let most = (references.iter().copied())
                .reduce(|a, b| k.max(a, b))
                .expect("a warp");
            let factor = power_ratio(k, head.reference, most);
            scale_all(k, acc, factor);
            k.comment("the head's softmax state, from the first warp's lanes of row 0");
            let owner = k.and_pred(leader, head_ok);
            let skip = k.label();
            k.bra_if(owner, false, skip);
            let total = k.mov(0.0f32);
            for (w, &reference) in (0u32..).zip(&references) {
                let sum = k.ld_shared::<F32>(at(w).plus(sums));
                let ratio = power_ratio(k, reference, most);
                k.fma_to(total, sum, ratio, total);
            }
            let max = k.mul(most, std::f32::consts::LN_2);
            k.st_shared(Shared::at(state).plus(plan.max.into()), max);
            k.st_shared(Shared::at(state).plus(plan.sum.into()), total);
            k.place(skip);
        }
    }

    /// After the stream: every warp stores its sums (per lane group channel:
    /// the two parts of each head added, times 1/σ) to its own area of
    /// [`Plan::warp_sums`](super::super::plan::Plan::warp_sums); past a
    /// barrier, every thread adds the warps' sums of its (head, channel)s
    /// and stores the total to the accumulator array (not zeroed first:
    /// this writes every channel of the group's heads). A sum's word is its register's
    /// (lane-major: a store is one wavefront) with the lane swizzled by its
    /// channel ([`sum_swizzle`]: a warp's 32 channels of a head then read 32
    /// banks). Serialized, one warp per barrier, this took a third of a
    /// one-tile split's time (docs/gpu-bench.md, twenty-third round).
    pub(super) fn mma_store(&self, k: &mut Kernel, t: &MmaValues) {
        let plan = self.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let channels = m.group_channels();
        let warp_bytes = m.warp_sums_bytes();
        let sums = k.add(self.smem, plan.warp_sums);
        let lane = k.mad_lo(t.lanes.row, ROW_LANES, t.lanes.quad);
        let own = k.mad_lo(t.lanes.warp, warp_bytes, sums);
        k.comment("each warp's sums into its own area");
        let unscale = t.sigma.map(|sigma| unscale_of(k, sigma));
        for (ct, acc) in (0u32..).zip(&t.acc) {
            // Per lane group channel, its sum's registers: columns
            // (head, part) add their two parts; gathered values' columns
            // are (head, parity).
            let parts: Vec<(Reg<F32>, Option<Reg<F32>>)> = match t.gather {
                Some(_) => acc.iter().flatten().map(|&c| (c, None)).collect(),
                None => (acc.iter())
                    .flat_map(|c| [0, 2].map(|h| (c[h], Some(c[h + 1]))))
                    .collect(),
            };
            for (channel, (first, second)) in (0u32..).zip(parts) {
                let sum = match second {
                    Some(second) => k.add(first, second),
                    None => first,
                };
                let sum = match unscale {
                    Some(u) => k.mul(sum, u),
                    None => sum,
                };
                let swizzled = k.xor(lane, sum_swizzle(channel, channels));
                let at = k.mad_lo(swizzled, 4u32, own);
                let register = ct * channels + channel;
                k.st_shared(
                    Shared::at(at).plus(i64::from(register * WARP_LANES * 4)),
                    sum,
                );
            }
        }
        k.bar_sync();
        k.comment("the warps' sums of each (head, channel) into the accumulators");
        let acc_index = self.m.value.accumulator.index();
        let acc_base = self.array_base(k, acc_index);
        let acc_stride = plan.array_stride[acc_index];
        let head_channels = ROW_GROUPS * channels;
        let total = k.mul(self.group, head_channels);
        self.strided(k, self.tid, Op::Reg(total), plan.threads, |k, idx| {
            let (head, channel) = divide(k, idx, head_channels);
            // A column tile's heads are its lanes' quads.
            let (ct, quad) = divide(k, head, ROW_LANES);
            let (row, group_channel) = divide(k, channel, channels);
            let lane = k.mad_lo(row, ROW_LANES, quad);
            let swizzle = sum_swizzle_of(k, group_channel, channels);
            let lane = k.xor(lane, swizzle);
            let register = k.mad_lo(ct, channels, group_channel);
            let word = k.mad_lo(register, WARP_LANES, lane);
            let at = k.mad_lo(word, 4u32, sums);
            let mut sum = k.ld_shared::<F32>(Shared::at(at));
            for w in 1..plan.warps {
                let other = Shared::at(at).plus(i64::from(w * warp_bytes));
                let x = k.ld_shared::<F32>(other);
                sum = k.add(sum, x);
            }
            let row_at = k.mad_lo(head, acc_stride, acc_base);
            let dst = k.mad_lo(channel, 4u32, row_at);
            k.st_shared(Shared::at(dst), sum);
        });
        k.bar_sync();
    }
}

/// Lane groups (fragment rows, `lane / 4`) of a warp: each holds its
/// `channels` of a head.
const ROW_GROUPS: u32 = WARP_LANES / ROW_LANES;

/// The XOR on the lane of group channel `c`'s sum ([`Skeleton::mma_store`])
/// for `channels` per lane group: `c`'s low two bits, its others above the
/// lane bits that the rows of 32 consecutive channels take. Those 32 channels
/// then land in 32 banks (the rows' lane bits differ; the channels' XORs
/// cover each remaining bit pattern once). None unless `channels` is a
/// power of two from 4 to 32.
fn sum_swizzle(c: u32, channels: u32) -> u32 {
    match sum_swizzle_shift(channels) {
        Some(shift) => (c & 3) | ((c >> 2) << shift),
        None => 0,
    }
}

/// [`sum_swizzle`] of a channel in a register.
fn sum_swizzle_of(k: &mut Kernel, c: Reg<U32>, channels: u32) -> Op<U32> {
    match sum_swizzle_shift(channels) {
        Some(shift) => {
            let low = k.and(c, 3u32);
            let high = k.shr(c, 2u32);
            let high = k.shl(high, shift);
            Op::Reg(k.or(low, high))
        }
        None => Op::Imm(0),
    }
}

/// Where [`sum_swizzle`] puts a channel's bits past the low two: above the
/// quad's two lane bits and the `log2(32 / channels)` bits of the rows.
fn sum_swizzle_shift(channels: u32) -> Option<u32> {
    (channels.is_power_of_two() && (4..=WARP_LANES).contains(&channels))
        .then(|| 2 + (WARP_LANES / channels).trailing_zeros())
}

/// σ = 2^(`exponent` − e) for the largest |x| = 2^e·(1.…) of a B column (its
/// values in the lanes the butterfly `masks` reach): the column's scaled
/// values stay below 2^(`exponent` + 1) whatever their magnitude.
fn column_sigma(k: &mut Kernel, values: &[Reg<F32>], masks: &[u32], exponent: u32) -> Reg<F32> {
    let mut most = k.abs_f32(values[0]);
    for &x in &values[1..] {
        let a = k.abs_f32(x);
        most = k.max(most, a);
    }
    for &mask in masks {
        let other = k.shfl_bfly(most, mask);
        most = k.max(most, other);
    }
    let bits = k.bitcast::<F32, U32>(most);
    let biased = k.shr(bits, 23u32);
    let field = k.sub(2 * BIAS + exponent, biased);
    let field = k.min(field, MAX_EXPONENT);
    let sigma = k.shl(field, 23u32);
    k.bitcast::<U32, F32>(sigma)
}

/// 1/σ for a power of two σ with biased exponent `f`: biased exponent 254 − f.
fn unscale_of(k: &mut Kernel, sigma: Reg<F32>) -> Reg<F32> {
    let bits = k.bitcast::<F32, U32>(sigma);
    let field = k.shr(bits, 23u32);
    let inverse = k.sub(MAX_EXPONENT, field);
    let inverse = k.shl(inverse, 23u32);
    k.bitcast::<U32, F32>(inverse)
}

/// The hi and lo f16 parts of `(a, b)`, `a` in the low halves: hi = f16(x),
/// lo = f16(x − hi), so hi + lo is x to about 2⁻²² relative.
fn f16_parts(k: &mut Kernel, a: Reg<F32>, b: Reg<F32>) -> (Reg<U32>, Reg<U32>) {
    let high = k.pack_f16x2(a, b);
    let (ha, hb) = k.split_halves(high);
    let (fa, fb) = (k.f16_to_f32(ha), k.f16_to_f32(hb));
    let (ra, rb) = (k.sub(a, fa), k.sub(b, fb));
    (high, k.pack_f16x2(ra, rb))
}

/// The hi (or, with `low`, lo) part of [`f16_parts`].
fn f16_part(k: &mut Kernel, a: Reg<F32>, b: Reg<F32>, low: Reg<Pred>) -> Reg<U32> {
    let (high, rest) = f16_parts(k, a, b);
    k.selp(rest, high, low)
}

/// The warp's online softmax of the C sums of [`Skeleton::mma_logits`]
/// (logits over their column tile's `to_logits`, a positive factor: the
/// maxima are taken on the sums, the weights' exponents by one `fma`).
/// When a logit passes its head's reference by more than the slack in
/// some lane (a warp vote), the warp's references move to the tile's
/// maxima and the sums and accumulators decay; the weights are then
/// 2^(s − reference). Returns the lane's weights in the logits' order (per
/// slot, column tile and row half: tokens `row` and `row + 8`). `in_tile`
/// is per (slot, row half) of the lane's C rows.
fn mma_softmax(
    k: &mut Kernel,
    t: &MmaScoreThread,
    values: &MmaValues,
    logits: &[Reg<F32>],
    in_tile: &[Reg<Pred>],
) -> Vec<Reg<F32>> {
    let columns = t.heads.len();
    let column_of = |i: usize| i / 2 % columns;
    k.comment("the warp's softmax of its tokens, against its running references");
    let neg_inf = k.mov(f32::NEG_INFINITY);
    let mut valid = Vec::new();
    let mut scores = Vec::new();
    let mut most: Vec<Option<Reg<F32>>> = vec![None; columns];
    for (i, &logit) in logits.iter().enumerate() {
        let ok = k.and_pred(in_tile[token_of(i, columns)], values.out_ok[column_of(i)]);
        let s = k.selp(logit, neg_inf, ok);
        let best = &mut most[column_of(i)];
        *best = Some(match *best {
            None => s,
            Some(b) => k.max(b, s),
        });
        valid.push(ok);
        scores.push(s);
    }
    let most: Vec<Reg<F32>> = (most.into_iter().zip(&t.queries.to_logits))
        .map(|(best, &factor)| k.mul(best.expect("a logit"), factor))
        .collect();
    let mut over = None;
    for (head, &best) in t.heads.iter().zip(&most) {
        let limit = k.add(head.reference, RESCALE_SLACK_BITS);
        let passes = k.setp(Cmp::Gt, best, limit);
        over = Some(match over {
            None => passes,
            Some(p) => k.or_pred(p, passes),
        });
    }
    let any = k.vote_any(over.expect("a column tile"));
    let settled = k.label();
    k.bra_if(any, false, settled);
    k.comment("rare: the references move to the tile's maxima; sums and accumulators decay");
    for ((head, &best), acc) in t.heads.iter().zip(&most).zip(&values.acc) {
        // The head's lanes: the same quad in every row.
        let mut best = best;
        for mask in [4, 8, 16] {
            let other = k.shfl_bfly(best, mask);
            best = k.max(best, other);
        }
        let new = k.max(head.reference, best);
        let decay = power_ratio(k, head.reference, new);
        k.mul_to(head.sum, head.sum, decay);
        scale_all(k, acc, decay);
        k.assign(head.reference, new);
    }
    k.place(settled);

    let below: Vec<Reg<F32>> = t.heads.iter().map(|h| k.neg_f32(h.reference)).collect();
    let mut weights = Vec::new();
    for (i, &s) in scores.iter().enumerate() {
        let column = column_of(i);
        let head = &t.heads[column];
        let d = k.fma(s, t.queries.to_logits[column], below[column]);
        let w = k.ex2(d);
        // Also keeps 2^(−∞ + ∞) out of heads with no logits yet.
        let w = k.selp(w, 0.0f32, valid[i]);
        k.add_to(head.sum, head.sum, w);
        weights.push(w);
    }
    weights
}

/// The token (slot, row half), as entry `2 · slot + half`, of the `i`-th
/// logit or weight: slot `i / (2 · columns)`, column tile `i / 2 % columns`,
/// half `i % 2`.
fn token_of(i: usize, columns: usize) -> usize {
    i / (2 * columns) * 2 + i % 2
}

/// [`mma_softmax`]'s weights times the item scales (and σ, per token) as
/// f16 `[hi, lo]` pairs, per slot and column tile.
fn weight_parts(
    k: &mut Kernel,
    weights: &[Reg<F32>],
    columns: usize,
    scales: Option<&[Reg<F32>]>,
) -> Vec<Vec<[Reg<U32>; 2]>> {
    let scaled: Vec<Reg<F32>> = match scales {
        Some(scales) => (weights.iter().enumerate())
            .map(|(i, &w)| k.mul(w, scales[token_of(i, columns)]))
            .collect(),
        None => weights.to_vec(),
    };
    scaled
        .chunks(2 * columns)
        .map(|slot| {
            slot.chunks(2)
                .map(|pair| {
                    let (hi, lo) = f16_parts(k, pair[0], pair[1]);
                    [hi, lo]
                })
                .collect()
        })
        .collect()
}

/// The accumulate's B fragments from the score lanes' weight parts
/// ([`mma_softmax`]), per slot and column tile. Lane `(row, quad)` takes
/// head `row / 2`'s tokens `quad + {0, 8}` and `quad + {4, 12}`, each pair
/// from the lane whose C rows they are (its row halves 0 and 1): hi parts
/// on even rows and lo parts on odd ones, one fragment (columns (head,
/// part)); or, for gathered values, both parts per reduction step
/// ([`parity_fragments`]).
fn mma_exchange(
    k: &mut Kernel,
    t: &MmaScoreThread,
    values: &MmaValues,
    parts: &[Vec<[Reg<U32>; 2]>],
) -> Vec<Vec<Vec<[Reg<U32>; 2]>>> {
    k.comment("the weights from the score's C fragments to the accumulate's B fragments");
    let mut b = Vec::new();
    for slot in parts {
        let mut columns = Vec::new();
        for &[hi, lo] in slot {
            columns.push(match values.parity_selectors {
                Some(selectors) => {
                    let pairs = t
                        .sources
                        .map(|source| [hi, lo].map(|part| k.shfl_idx(part, source)));
                    parity_fragments(k, pairs, selectors)
                }
                None => vec![t.sources.map(|source| {
                    let high = k.shfl_idx(hi, source);
                    let low = k.shfl_idx(lo, source);
                    k.selp(low, high, t.lanes.low_part)
                })],
            });
        }
        b.push(columns);
    }
    b
}

/// Gathered values' B fragments of one slot and column tile, whose columns
/// are (head, channel parity): from `pairs` (per token pair `(t, t + 8)`,
/// the `[hi, lo]` f16 parts of its weights), per reduction step `s` (row
/// half `s` of both pairs) and part, the weight at the half of the lane's
/// column parity and zero at the other ([`channel_pair_products`]).
fn parity_fragments(
    k: &mut Kernel,
    pairs: [[Reg<U32>; 2]; 2],
    selectors: [Reg<U32>; 2],
) -> Vec<[Reg<U32>; 2]> {
    let zero = k.mov(0u32);
    let mut b = Vec::new();
    for selector in selectors {
        for part in 0..2 {
            b.push(pairs.map(|pair| k.prmt_by(pair[part], zero, selector)));
        }
    }
    b
}

/// The f16 item scale at `at` (0 where `ok` fails: rows past the tile's
/// items are not read, past the last slot they are outside the buffers).
fn item_scale(k: &mut Kernel, at: Shared, ok: Reg<Pred>) -> Reg<F32> {
    let bits = k.mov(0u32);
    k.guarded(ok, true, |k| {
        let loaded = k.ld_shared_narrow(at, 16);
        k.assign(bits, loaded);
    });
    let half = k.low16(bits);
    k.f16_to_f32(half)
}

/// Every accumulator of `acc` times `factor`.
fn scale_all(k: &mut Kernel, acc: &[[Reg<F32>; 4]], factor: Reg<F32>) {
    for c in acc.iter().flatten() {
        k.mul_to(*c, *c, factor);
    }
}

/// 2^(from − to) for references in log2 units, 1 when they are equal (also
/// when both are −∞: a head with no logits yet).
fn power_ratio(k: &mut Kernel, from: Reg<F32>, to: Reg<F32>) -> Reg<F32> {
    let d = k.sub(from, to);
    let ratio = k.ex2(d);
    let same = k.setp(Cmp::Eq, from, to);
    k.selp(1.0f32, ratio, same)
}

/// `at` in rows the 128-byte swizzle placed (when `swizzled`): 16-byte chunk
/// `c` of 128-byte line `l` (of shared memory, 1024-byte aligned) sits at
/// chunk `c ^ (l % 8)`, as the tensor copies put it.
fn swizzled_if(k: &mut Kernel, swizzled: bool, at: Shared) -> Shared {
    if !swizzled {
        return at;
    }
    let address = match u32::try_from(at.offset).expect("tile row offsets fit a u32") {
        0 => at.base,
        offset => k.add(at.base, offset),
    };
    let line = k.shr(address, 3u32);
    // address ^ (line & 0x70): the line's low 3 bits onto the chunk's.
    Shared::at(k.lop3(address, line, 0x70u32, 0x78))
}

/// The fragment registers of one word of key elements
/// ([`MmaScore::key_element`]): f16 pairs and bytes as they are; 4-bit codes
/// as the bytes' high nibbles, 16 times the code (low nibbles, then high).
fn key_registers(k: &mut Kernel, element: Element, w: Reg<U32>) -> Vec<Reg<U32>> {
    const HIGH_NIBBLES: u32 = 0xF0F0_F0F0;
    match element {
        Element::Int { bits: 4, .. } => {
            let low = k.shl(w, 4u32);
            vec![k.and(low, HIGH_NIBBLES), k.and(w, HIGH_NIBBLES)]
        }
        _ => vec![w],
    }
}

/// The tokens of a 16-token accumulate step lane quad `q` takes: `spacing ·
/// q + {0, 8, second, second + 8}`, two pairs `(r, r + 8)` whose weights are
/// one register each of the score's C fragments (row `r`'s halves), so they
/// reach the B fragments without byte permutes (twentieth round).
#[derive(Clone, Copy)]
struct StepTokens {
    spacing: u32,
    second: u32,
}

impl StepTokens {
    fn of(m: &MmaPlan) -> StepTokens {
        match m.value_fragments() {
            // A gathering load's lanes then read four adjacent rows, whose
            // words meet fewer bank conflicts than every other row's.
            Some(_) => StepTokens {
                spacing: 1,
                second: 4,
            },
            // Tokens whose words pair by a known skew start on even rows.
            None => StepTokens {
                spacing: 2,
                second: 1,
            },
        }
    }

    /// The tokens' offsets from the lane's first, in the order the
    /// products take them.
    fn offsets(self) -> [u32; 4] {
        [0, 8, self.second, self.second + 8]
    }
}

/// One token's value words: the lane group's channels start `skew` bytes
/// into the first.
struct TokenWords {
    words: Vec<Reg<U32>>,
    skew: u32,
}

impl TokenWords {
    /// The word holding byte `byte` of the lane group's channels, and the
    /// byte's place in it.
    fn byte(&self, byte: u32) -> (Reg<U32>, u32) {
        let at = byte + self.skew;
        (self.words[(at / 4) as usize], at % 4)
    }
}

/// The (token 0, token 1) f16 pair of lane-group channel `channel` from the
/// two tokens' words.
fn token_pair(
    k: &mut Kernel,
    element: Element,
    first: &TokenWords,
    second: &TokenWords,
    channel: u32,
) -> Reg<U32> {
    // The channel's (first) byte: f16 halves and integer bytes never
    // straddle a word, as skews are even.
    let byte = channel * element.bits() / 8;
    let ((a, i), (b, j)) = (first.byte(byte), second.byte(byte));
    match element {
        Element::Half => k.prmt(a, b, i | (i + 1) << 4 | (4 + j) << 8 | (5 + j) << 12),
        Element::Int { bits, signed } => {
            // The element's byte of both tokens at bytes 0 and 2.
            let x = k.prmt(a, b, i | i << 4 | (4 + j) << 8 | (4 + j) << 12);
            int_pair(k, x, bits, signed, bits == 4 && channel % 2 == 1)
        }
    }
}

/// The products of one column tile's step with the values as stored: each
/// A register one word of a token (its two channels), where
/// [`token_pair`] pairs two tokens' halves of a channel by a byte permute
/// per register (gathered values, eighteenth round). The reduction takes 8
/// tokens, each as (token, channel parity), and the columns are (head,
/// channel parity): a B column weighs its parity's rows, its others zero,
/// and the weights' hi and lo parts are two `mma.sync`s into the same C
/// tile. So a C tile holds four channels of one head where the (head,
/// part) columns of the other tiers need two tiles (twenty-second round).
///
/// A step's tokens are `values` (the lane's [`StepTokens`] `t + {0, 8, e, e +
/// 8}`, channel pair words in the lane group's order); `b`: per reduction
/// step and part, the lane's B fragment ([`parity_fragments`]). Reduction
/// step `s` takes tokens `8 · s` and `8 · s + e`; M tile `i` takes the lane
/// group's channel pairs `2i` (row `g`) and `2i + 1` (row `g + 8`): C
/// register `j` of tile `i` is channel `4i + j` of the lane group's
/// channels, of head `quad`.
fn channel_pair_products(
    k: &mut Kernel,
    values: &[TokenWords],
    sums: &[[Reg<F32>; 4]],
    b: &[[Reg<U32>; 2]],
) {
    for (step, parts) in b.chunks(2).enumerate() {
        let (first, second) = (&values[step].words, &values[2 + step].words);
        for (i, &c) in sums.iter().enumerate() {
            let a = [
                first[2 * i],
                first[2 * i + 1],
                second[2 * i],
                second[2 * i + 1],
            ];
            for &b in parts {
                k.mma_f16_f32(c, a, b);
            }
        }
    }
}

/// The exact f16 pair of the `bits`-wide integers in bits `0..` and `16..`
/// of `x` (with `high_nibble`, bits `4..8` and `20..24`): the integer (offset
/// to unsigned) becomes the mantissa of 1024 by one `lop3`, and one f16 op
/// takes 1024 (and the offset, and a nibble's ×16) off again.
fn int_pair(k: &mut Kernel, x: Reg<U32>, bits: u32, signed: bool, high_nibble: bool) -> Reg<U32> {
    const MAGIC: u32 = 0x6400_6400; // 1024.0 in both halves
    let field = (1u32 << bits) - 1;
    let shift = if high_nibble { 4 } else { 0 };
    let mask = (field | field << 16) << shift;
    let sign = 1u32 << (bits - 1);
    let flip = if signed {
        (sign | sign << 16) << shift
    } else {
        0
    };
    // (x & mask) ^ c: the field's bits flipped by c's, elsewhere c's bits.
    let lut = (0xF0 & 0xCC) ^ 0xAA;
    let biased = k.lop3(x, mask, MAGIC | flip, lut);
    let offset = if signed { sign } else { 0 };
    if high_nibble {
        // (1024 + 16·u) / 16 − (64 + offset)
        let sixteenth = k.mov(0x2C00_2C00u32);
        let minus = half_bits(-(64.0 + offset as f32));
        let minus = k.mov(minus | minus << 16);
        k.fma_f16x2(biased, sixteenth, minus)
    } else {
        let bias = half_bits(1024.0 + offset as f32);
        let bias = k.mov(bias | bias << 16);
        k.sub_f16x2(biased, bias)
    }
}

/// The f16 bits of `x` (exact for the small integers used here).
fn half_bits(x: f32) -> u32 {
    u32::from(half::f16::from_f32(x).to_bits())
}

#[cfg(test)]
mod tests {
    use super::half_bits;

    #[test]
    fn half_bits_of_the_magic_constants() {
        assert_eq!(half_bits(1024.0), 0x6400);
        assert_eq!(half_bits(1152.0), 0x6480);
        assert_eq!(half_bits(1032.0), 0x6408);
        assert_eq!(half_bits(-72.0), 0xD480);
        assert_eq!(half_bits(-64.0), 0xD400);
    }
}
