//! The score on the tensor cores (tiers `tensor_cores.rs` admits), per
//! 16-token tile of a warp: `S = K · Q'ᵀ`. A = the tile's key rows (tokens ×
//! elements, a reduction step's elements in the lanes' load order,
//! [`MmaScore::key_element`]); B = the queries (times the page's header
//! scales) times a power of two σ per head, as columns (head, part): f16
//! `hi + lo` parts, so a head's two columns sum to its logit times σ; or,
//! for integer keys, the three bytes of an integer ([`Queries`]). Keys with
//! zero points (`code · scale + zero`) score their codes so, and add the
//! page's `Σ query · zero` per head ([`Queries::bias`]).

use super::super::builder::{Cmp, Kernel, Op, Pred, Reg, Shared, F32, S32, U32};
use super::super::plan::PageQueries;
use super::super::streams::CHUNK;
use super::super::tensor_cores::{
    code_register, lane_chunk, triplet_register, Element, MmaPlan, MmaScore, ROW_LANES, TILE,
    TILE_HEADS, TRIPLET_SELECTORS, WARP_LANES,
};
use super::cta::{Cta, Tile};
use super::fragments::{
    column_sigma, f16_part, swizzled_if, unscale_of, Across, Fragments, Lanes, StepTokens,
    HALF_EXPONENT,
};
use super::gather::FragmentGather;
use crate::spec::Fp8;

/// The score on the tensor cores.
#[derive(Clone, Copy)]
pub(super) struct ScoreMma<'a> {
    pub(super) cta: &'a Cta<'a>,
    pub(super) frag: Fragments<'a>,
}

/// The same for queries as integers: below 2^22, so their top byte
/// `d0` of [`Queries`] stays within ±64.
pub(super) const INT_EXPONENT: u32 = 21;

/// The same for a page's `Σ query · zero` of a head, which bounds σ: the
/// bias in the C sums' units stays below 2^55, and the queries' rounding
/// then costs the codes' sum at most `Σ code / 2^48` of the bias (2^-33
/// for 128 8-bit codes), below the bias's own f32 rounding. It binds only
/// where the bias is 2^27 times the largest query times scale or more.
pub(super) const BIAS_EXPONENT: u32 = 48;

/// Independent accumulator chains of a score tile's `mma.sync`s on f16 rows
/// loaded whole: one chain waits a full tensor-core latency per 16
/// elements. Gathered rows take one: a step's gather hides that latency,
/// and a second chain's sums cost more than it saves (MosaicKV 1% slower
/// on an H200 with two). Integer keys have one chain per B tile
/// ([`ScoreSums`]).
pub(super) const HALF_SCORE_CHAINS: u32 = 2;

/// A lane's tensor-core score and its warp's softmax, for the whole stream.
pub(super) struct MmaScoreThread {
    pub(super) lanes: Lanes,
    /// Per column tile: the lane's first query element and whether its B
    /// column's head exists.
    pub(super) query_at: Vec<(Reg<U32>, Reg<Pred>)>,
    /// Per column tile, with a per-head score bias: its B column head's.
    pub(super) bias_at: Vec<Reg<U32>>,
    /// The query fragments and the C sums' factor to logits: for the whole
    /// stream, or (with header scales) for the current page.
    pub(super) queries: Queries,
    /// Byte offset of the lane's first key chunk in a tile's key stream (of
    /// its first item with gathered fragments).
    pub(super) key_lane: Reg<U32>,
    /// Gathered key fragments: the lane's state.
    pub(super) gather: Option<FragmentGather>,
    /// The lane's C row in the warp's first token tile (`16 · warp + row`).
    pub(super) key_row: Reg<U32>,
    /// Per column tile: the warp's softmax state of the lane's C columns' head.
    pub(super) heads: Vec<WarpHead>,
    /// With item scales: byte offset of the scale of the lane's first token
    /// in the value rows (with group scales: of its value row).
    pub(super) scale_lane: Option<Reg<U32>>,
    /// The lanes whose C rows (halves 0 and 1) are the lane's B token pairs
    /// ([`StepTokens`]).
    pub(super) sources: [Reg<U32>; 2],
}

/// A warp's softmax state of one head, as each lane of the head's C columns
/// holds it.
pub(super) struct WarpHead {
    /// The warp's reference, in log2 units (logits times log2 e).
    pub(super) reference: Reg<F32>,
    /// The lane's sum of the weights against it.
    pub(super) sum: Reg<F32>,
}

/// B fragments of the score, and per column tile the factor from its C
/// sums to logits in log2 units (1/σ of the C columns' head times the
/// softmax scale times log2 e, over 16 or 64 for 4- or 2-bit codes).
pub(super) struct Queries {
    /// Per column tile and B tile: the lane's registers, two per reduction
    /// step. f16 keys: one B tile, columns (head, hi / lo part). Integer
    /// keys: the query times σ as a 24-bit integer of three signed bytes,
    /// `d0 · 2^16 + d1 · 2^8 + d2`, in two B tiles: columns (head, d0 / d1),
    /// then (head, d2 / nothing).
    pub(super) tiles: Vec<Vec<Vec<Reg<U32>>>>,
    pub(super) to_logits: Vec<Reg<F32>>,
    /// Keys with zero points, per column tile: the C columns' head's
    /// `Σ query · zero` of the page, in the C sums' units (what the sums
    /// would hold for it: times σ, over the codes' factor).
    pub(super) bias: Option<Vec<Reg<F32>>>,
}

/// Where a page's query preparation reads the header scales (and zero points).
#[derive(Clone, Copy)]
pub(super) enum PageHeader {
    /// The tile's header: scale slot 0's address.
    Slots(Reg<U32>),
    /// A warp's padded copy ([`ScoreMma::pad_header`]).
    Padded(Reg<U32>),
}

/// The address of 16-byte vector `vector` of a key row in the padded row at
/// `row` ([`MmaScore::padded_chunk_bytes`]).
fn padded_vector(k: &mut Kernel, s: &MmaScore, row: Reg<U32>, vector: Reg<U32>) -> Shared {
    let per_chunk = s.chunk_elements() / 4;
    let chunk = k.shr(vector, per_chunk.trailing_zeros());
    let within = k.and(vector, per_chunk - 1);
    let at = k.mad_lo(chunk, s.padded_chunk_bytes(), row);
    Shared::at(k.mad_lo(within, CHUNK, at))
}

/// A slot's score sums per column tile: f16 keys in `chains` chains of f32
/// accumulators taking the steps in turn; integer keys in one s32
/// accumulator per B tile (sums exact).
pub(super) enum ScoreSums {
    Half(Vec<Vec<[Reg<F32>; 4]>>),
    Int {
        signed: bool,
        sums: Vec<Vec<[Reg<S32>; 4]>>,
    },
}

impl ScoreSums {
    pub(super) fn new(
        k: &mut Kernel,
        score: &MmaScore,
        column_tiles: u32,
        chains: u32,
    ) -> ScoreSums {
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
            Element::Half | Element::Fp8(_) => {
                ScoreSums::Half(tiles(k, chains.min(score.key_steps())))
            }
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
    pub(super) fn step(
        &mut self,
        k: &mut Kernel,
        s: usize,
        a: [Reg<U32>; 4],
        b: &[Vec<Vec<Reg<U32>>>],
    ) {
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
    pub(super) fn logit(&self, k: &mut Kernel, ct: usize, half: usize) -> Reg<F32> {
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

impl ScoreMma<'_> {
    /// The score's and the warp softmax's constant state.
    pub(super) fn setup(&self, k: &mut Kernel, m: &MmaPlan, s: &MmaScore) -> MmaScoreThread {
        let plan = self.cta.plan;
        k.comment(&format!(
            "tensor-core score, softmax per warp: {} token tile(s) per warp, {} column tile(s), {:?} keys",
            self.frag.slots(m),
            m.column_tiles,
            s.key,
        ));
        let lanes = self.frag.lanes(k);
        let row_head = k.shr(lanes.row, 1u32);
        let chunk = self.frag.lane_chunk_part(k, &lanes);
        let query = s.query.index();
        let query_base = self.cta.array_base(k, query);
        let (rows, row_bytes, chunk_bytes) = match plan.page_queries {
            Some(pq) => {
                self.pad_queries(k, s, pq, query_base);
                let rows = k.add(self.cta.smem, pq.query);
                (rows, s.padded_row_bytes(), s.padded_chunk_bytes())
            }
            None => (query_base, plan.array_stride[query], 4 * s.chunk_elements()),
        };
        let query_at: Vec<(Reg<U32>, Reg<Pred>)> = (0..m.column_tiles)
            .map(|ct| {
                let head = k.add(row_head, TILE_HEADS * ct);
                let ok = k.setp(Cmp::Lt, head, self.cta.group);
                let (clamped, _) = self.frag.head_slot(k, head);
                let at = k.mad_lo(clamped, row_bytes, rows);
                (k.mad_lo(chunk, chunk_bytes, at), ok)
            })
            .collect();
        let key_row = k.mad_lo(lanes.warp, TILE, lanes.row);
        let gather = (m.key_rows.fragments())
            .map(|g| FragmentGather::for_keys(k, g, s, &plan.key, lanes.quad));
        let key_chunk = match gather {
            Some(_) => k.mov(0u32),
            None => match s.chunk_bytes() {
                bytes if bytes.is_power_of_two() => k.shl(chunk, bytes.trailing_zeros()),
                bytes => k.mul(chunk, bytes),
            },
        };
        let key_lane = k.mad_lo(key_row, m.key_rows.stride, key_chunk);
        let zero = k.mov(0.0f32);
        // The per-head bias array's element of each column tile's B column head.
        let bias_at: Vec<Reg<U32>> = match s.key_bias {
            Some(array) => {
                let index = array.index();
                let base = self.cta.array_base(k, index);
                (0..m.column_tiles)
                    .map(|ct| {
                        let head = k.add(row_head, TILE_HEADS * ct);
                        let (clamped, _) = self.frag.head_slot(k, head);
                        k.mad_lo(clamped, plan.array_stride[index], base)
                    })
                    .collect()
            }
            None => Vec::new(),
        };
        let queries = match s.key_scale {
            None => self.queries(k, s, &lanes, &query_at, &bias_at, None),
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
                bias: (s.biased()).then(|| (0..m.column_tiles).map(|_| k.mov(zero)).collect()),
            },
        };
        let neg_inf = k.mov(f32::NEG_INFINITY);
        let heads = (0..m.column_tiles)
            .map(|_| WarpHead {
                reference: k.mov(neg_inf),
                sum: k.mov(zero),
            })
            .collect();
        let scale_lane = m.scaled_values().then(|| {
            let bit = m.channel.scale.unwrap_or(0);
            k.mad_lo(key_row, m.value_rows.stride, bit / 8)
        });
        // Lane 4·r + q holds C row r's columns 2q, 2q + 1.
        let steps = StepTokens::of(m);
        let source = k.mul(lanes.quad, 4 * steps.spacing);
        let source = k.add(source, row_head);
        let sources = [source, k.add(source, 4 * steps.second)];
        MmaScoreThread {
            lanes,
            query_at,
            bias_at,
            queries,
            key_lane,
            gather,
            key_row,
            heads,
            scale_lane,
            sources,
        }
    }

    /// Every head's query in the padded rows at `pq.query`, once per CTA.
    /// The barrier first: the key prologue may have written the query; the
    /// page loop's first barrier makes the copy visible.
    fn pad_queries(&self, k: &mut Kernel, s: &MmaScore, pq: PageQueries, query_base: Reg<U32>) {
        let plan = self.cta.plan;
        k.bar_sync();
        let vectors = s.key_dims / 4;
        let stride = plan.array_stride[s.query.index()];
        let rows = k.add(self.cta.smem, pq.query);
        let count = Op::Imm(plan.group_max * vectors);
        self.cta
            .strided(k, self.cta.tid, count, plan.threads, |k, i| {
                let head = k.div_u32(i, vectors);
                let vector = k.rem_u32(i, vectors);
                let src = k.mad_lo(head, stride, query_base);
                let src = k.mad_lo(vector, CHUNK, src);
                let x = k.ld_shared_v4::<F32>(Shared::at(src));
                let row = k.mad_lo(head, s.padded_row_bytes(), rows);
                let dst = padded_vector(k, s, row, vector);
                k.st_shared_v4(dst, x);
            });
    }

    /// The page's header scales (and zero points) in this warp's padded
    /// rows at `pq.headers`, whose address it returns: each lane moves whole
    /// 16-byte vectors from `header` (scale slot 0's address).
    fn pad_header(
        &self,
        k: &mut Kernel,
        s: &MmaScore,
        pq: PageQueries,
        header: Reg<U32>,
    ) -> Reg<U32> {
        let warp = k.shr(self.cta.tid, 5u32);
        let lane = k.and(self.cta.tid, WARP_LANES - 1);
        let row_bytes = s.padded_row_bytes();
        let rows = k.add(self.cta.smem, pq.headers);
        let rows = k.mad_lo(warp, s.header_rows() * row_bytes, rows);
        let vectors = s.key_dims / 4;
        let slots: Vec<u32> = [s.key_scale, s.key_zero].into_iter().flatten().collect();
        // The warp's reads of the previous page's rows are done.
        k.bar_warp_sync();
        for pass in 0..vectors.div_ceil(WARP_LANES) {
            let vector = k.add(lane, pass * WARP_LANES);
            let inside = k.setp(Cmp::Lt, vector, vectors);
            k.guarded(inside, true, |k| {
                let src = k.mad_lo(vector, CHUNK, header);
                for (r, &slot0) in (0u32..).zip(&slots) {
                    let x = k.ld_shared_v4::<F32>(Shared::at(src).plus(i64::from(4 * slot0)));
                    let row = k.add(rows, r * row_bytes);
                    let dst = padded_vector(k, s, row, vector);
                    k.st_shared_v4(dst, x);
                }
            });
        }
        k.bar_warp_sync();
        rows
    }

    /// The lane's query pairs of every column tile (times the page's header
    /// scales when the key has them) scaled by σ and split into parts, the
    /// factor from its C sums to logits in log2 units, and (zero points in
    /// the header) the sums' bias.
    pub(super) fn queries(
        &self,
        k: &mut Kernel,
        m: &MmaScore,
        lanes: &Lanes,
        query_at: &[(Reg<U32>, Reg<Pred>)],
        bias_at: &[Reg<U32>],
        header: Option<PageHeader>,
    ) -> Queries {
        let source = self.query_source(k, m, lanes, header);
        let (factor, code_scale) = self.logit_factor(k, m);
        let registers: Vec<u32> = (0..m.key_registers()).collect();
        let mut tiles = Vec::new();
        let mut to_logits = Vec::new();
        let mut bias = Vec::new();
        for (ct, &(at, ok)) in query_at.iter().enumerate() {
            let (elements, lane_zeros) = self.lane_elements(k, m, &source, at, ok, &registers);
            let query_zeros = lane_zeros.map(|sum| row_sum(k, sum, ok));
            let query_zeros = self.plus_bias(k, query_zeros, bias_at.get(ct));
            let values: Vec<Reg<F32>> = elements.iter().flatten().copied().collect();
            let sigma = column_sigma(k, &values, Across::Butterfly(&[1, 2]), exponent(m));
            let sigma = bounded_sigma(k, sigma, query_zeros);
            tiles.push(self.pack(k, m, lanes, &elements, sigma, &registers));
            let (logit_factor, page_bias) =
                column_factors(k, lanes, sigma, query_zeros, factor, code_scale);
            to_logits.push(logit_factor);
            bias.extend(page_bias);
        }
        Queries {
            tiles,
            to_logits,
            bias: (!bias.is_empty()).then_some(bias),
        }
    }

    /// Where the lane's query chunks and the page's header scales (and
    /// zero points) lie.
    pub(super) fn query_source(
        &self,
        k: &mut Kernel,
        m: &MmaScore,
        lanes: &Lanes,
        header: Option<PageHeader>,
    ) -> QuerySource {
        let chunk = m.chunk_elements();
        // The lane's chunk c holds elements chunk · (its chunk index),
        // contiguous; chunks `chunk_bytes` apart.
        let chunk_bytes = match header {
            Some(PageHeader::Padded(_)) => m.padded_chunk_bytes(),
            _ => 4 * chunk,
        };
        let (scales_at, zeros_at) = match header {
            None => (None, None),
            Some(header) => {
                let (PageHeader::Slots(base) | PageHeader::Padded(base)) = header;
                let part = self.frag.lane_chunk_part(k, lanes);
                let lane = k.mad_lo(part, chunk_bytes, base);
                match header {
                    PageHeader::Slots(_) => {
                        let mut slot = |slot0: Option<u32>| slot0.map(|s| k.add(lane, 4 * s));
                        (slot(m.key_scale), slot(m.key_zero))
                    }
                    // Scales in the first row, zero points in the second.
                    PageHeader::Padded(_) => {
                        let zeros = m.key_zero.map(|_| k.add(lane, m.padded_row_bytes()));
                        (Some(lane), zeros)
                    }
                }
            }
        };
        QuerySource {
            chunk_bytes,
            spread: self.frag.spread_chunks(),
            scales_at,
            zeros_at,
        }
    }

    /// The factor from C sums (over σ) to logits in log2 units, and the
    /// codes' own factor: 4- and 2-bit codes enter as 16 or 64 times the code.
    pub(super) fn logit_factor(&self, k: &mut Kernel, m: &MmaScore) -> (Reg<F32>, f32) {
        let code_scale = match m.key {
            Element::Int { bits, .. } => 1.0 / (1u32 << (8 - bits)) as f32,
            Element::Half | Element::Fp8(_) => 1.0,
        };
        let softmax_scale = k.ld_param(&self.cta.p.softmax_scale);
        let factor = k.mul(softmax_scale, std::f32::consts::LOG2_E * code_scale);
        (factor, code_scale)
    }

    /// The lane's query elements of the fragment registers `registers` (the
    /// others `None`), times the page's header scales, zero where the B
    /// column's head does not exist (`ok`); and with zero points the lane's
    /// part of its head's `Σ query · zero` over those elements.
    pub(super) fn lane_elements(
        &self,
        k: &mut Kernel,
        m: &MmaScore,
        source: &QuerySource,
        at: Reg<U32>,
        ok: Reg<Pred>,
        registers: &[u32],
    ) -> (Vec<Option<Reg<F32>>>, Option<Reg<F32>>) {
        let chunk = m.chunk_elements();
        let mut wanted = vec![false; (m.lane_chunks() * chunk) as usize];
        for &r in registers {
            for at in register_positions(m, r) {
                wanted[at] = true;
            }
        }
        let mut elements = vec![None; wanted.len()];
        // The lane's Σ query · zero, in four chains (one per vector lane).
        let mut query_zeros: [Option<Reg<F32>>; 4] = [None; 4];
        for c in 0..m.lane_chunks() {
            for v in 0..chunk / 4 {
                let first = (c * chunk + 4 * v) as usize;
                if !wanted[first..first + 4].iter().any(|&w| w) {
                    continue;
                }
                let offset =
                    i64::from(source.chunk_bytes * lane_chunk(source.spread, c) + CHUNK * v);
                let q = k.ld_shared_v4::<F32>(Shared::at(at).plus(offset));
                let s =
                    (source.scales_at).map(|s| k.ld_shared_v4::<F32>(Shared::at(s).plus(offset)));
                let z =
                    (source.zeros_at).map(|z| k.ld_shared_v4::<F32>(Shared::at(z).plus(offset)));
                for (i, x) in q.into_iter().enumerate() {
                    if !wanted[first + i] {
                        continue;
                    }
                    if let Some(z) = z {
                        query_zeros[i] = Some(match query_zeros[i] {
                            Some(sum) => k.fma(x, z[i], sum),
                            None => k.mul(x, z[i]),
                        });
                    }
                    let x = match s {
                        Some(s) => k.mul(x, s[i]),
                        None => x,
                    };
                    elements[first + i] = Some(k.selp(x, 0.0f32, ok));
                }
            }
        }
        let lane_sum = query_zeros.into_iter().flatten().reduce(|a, b| k.add(a, b));
        (elements, lane_sum)
    }

    /// A head's `Σ query · zero` plus its own bias term (at `bias_at`).
    pub(super) fn plus_bias(
        &self,
        k: &mut Kernel,
        query_zeros: Option<Reg<F32>>,
        bias_at: Option<&Reg<U32>>,
    ) -> Option<Reg<F32>> {
        let constant = bias_at.map(|&at| k.ld_shared::<F32>(Shared::at(at)));
        match (query_zeros, constant) {
            (Some(sum), Some(c)) => Some(k.add(sum, c)),
            (sum, c) => sum.or(c),
        }
    }

    /// The lane's fragment registers `registers` of each B tile, from its
    /// elements ([`ScoreMma::lane_elements`]) times σ: f16 hi / lo parts,
    /// or the bytes of a 24-bit integer ([`Queries`]).
    pub(super) fn pack(
        &self,
        k: &mut Kernel,
        m: &MmaScore,
        lanes: &Lanes,
        elements: &[Option<Reg<F32>>],
        sigma: Reg<F32>,
        registers: &[u32],
    ) -> Vec<Vec<Reg<U32>>> {
        let element = |at: usize| elements[at].expect("the register's elements are computed");
        match m.key {
            Element::Half | Element::Fp8(_) => {
                let scaled: Vec<Option<Reg<F32>>> = (elements.iter())
                    .map(|x| x.map(|x| k.mul(x, sigma)))
                    .collect();
                let pairs = (registers.iter())
                    .map(|&r| {
                        let at = register_positions(m, r);
                        let [a, b] = [at[0], at[1]].map(|i| scaled[i].expect("computed"));
                        f16_part(k, a, b, lanes.low_part)
                    })
                    .collect();
                vec![pairs]
            }
            Element::Int { .. } => {
                // Q = d0 · 2^16 + d1 · 2^8 + d2 with signed bytes: d2 is
                // Q's byte 0, d1 byte 1 of Q + 2^7, d0 byte 2 of Q +
                // 2^15 + 2^7 (each carry rounds the digits above).
                let odd = lanes.low_part;
                let carry = k.selp(0x80u32, 0x8080u32, odd);
                let byte = k.selp(0x51u32, 0x62u32, odd);
                let even = k.selp(0u32, u32::MAX, odd);
                let digits: Vec<Option<[Reg<U32>; 2]>> = (0..elements.len())
                    .map(|at| {
                        elements[at].map(|_| {
                            let scaled = k.mul(element(at), sigma);
                            let q = k.f32_to_s32(scaled);
                            let q = k.bitcast::<S32, U32>(q);
                            [k.add(q, carry), q]
                        })
                    })
                    .collect();
                [(byte, None), (k.mov(0x40u32), Some(even))]
                    .into_iter()
                    .enumerate()
                    .map(|(tile, (selector, mask))| {
                        (registers.iter())
                            .map(|&r| {
                                let at = register_positions(m, r);
                                let [a, b, c, d] =
                                    [0, 1, 2, 3].map(|i| digits[at[i]].expect("computed")[tile]);
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
                    .collect()
            }
        }
    }

    /// At a page's first tile, with keys scaled per page: the lane's
    /// queries (`t.queries`) times the page's header scales. Before the
    /// tile's other shared loads, which would otherwise wait, live, through
    /// the preparation's barriers.
    pub(super) fn page_queries(&self, k: &mut Kernel, tile: &Tile, t: &MmaScoreThread) {
        let plan = self.cta.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let score = m.score.as_ref().expect("tensor-core score");
        let queries = &t.queries;
        if score.key_scale.is_none() {
            return;
        }
        k.comment("a page's first tile: the query times the page's header scales");
        let later = k.label();
        if let Some(first) = tile.first {
            let page_start = k.setp(Cmp::Eq, first, 0u32);
            k.bra_if(page_start, false, later);
        }
        let header = match plan.page_queries {
            Some(pq) => PageHeader::Padded(self.pad_header(k, score, pq, tile.header)),
            None => PageHeader::Slots(tile.header),
        };
        match plan.page_fragments {
            Some(shared) => self.shared_queries(k, score, t, header, shared),
            None => {
                let page = self.queries(k, score, &t.lanes, &t.query_at, &t.bias_at, Some(header));
                let registers = |q: &Queries| q.tiles.iter().flatten().flatten().copied().collect();
                let (to, from): (Vec<Reg<U32>>, Vec<Reg<U32>>) =
                    (registers(queries), registers(&page));
                for (to, from) in to.iter().zip(&from) {
                    k.assign(*to, *from);
                }
                for (to, from) in queries.to_logits.iter().zip(&page.to_logits) {
                    k.assign(*to, *from);
                }
                for (to, from) in queries
                    .bias
                    .iter()
                    .flatten()
                    .zip(page.bias.iter().flatten())
                {
                    k.assign(*to, *from);
                }
            }
        }
        k.place(later);
    }

    /// The lane's C sums, by slot, column tile and row half, in units of
    /// their column tile's `to_logits` (the softmax folds that factor into
    /// the step it takes anyway): token
    /// `16 · (warp + slot · warps) + row + 8 · half`, head `4 · column tile +
    /// quad`. Every lane runs every slot whose tile exists (rows past the
    /// tile's items read stale bytes: an mma row depends only on its own A
    /// row, and those logits are never used).
    pub(super) fn logits(
        &self,
        k: &mut Kernel,
        tile: &Tile,
        t: &MmaScoreThread,
        over: Option<Reg<Pred>>,
    ) -> Vec<Reg<F32>> {
        let plan = self.cta.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let score = m.score.as_ref().expect("tensor-core score");
        let queries = &t.queries;
        let stride = m.key_rows.stride;
        let spread = self.frag.spread_chunks();
        let base = self.frag.rows(k, tile.buf, m.key_rows);
        let lane_base = k.add(base, t.key_lane);
        let mut logits = Vec::new();
        let chains = match t.gather {
            Some(_) => 1,
            None => HALF_SCORE_CHAINS,
        };
        for j in 0..self.frag.slots(m) {
            let mut sums = ScoreSums::new(k, score, m.column_tiles, chains);
            let skip = k.label();
            if let Some(ok) = self.frag.slot_ok(k, m, t.lanes.warp, j) {
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
                        let chunk = score.chunk_bytes();
                        let words: Vec<Reg<U32>> = (0..score.lane_chunks())
                            .flat_map(|c| {
                                let at = Shared::at(lane_base)
                                    .plus(i64::from(offset + chunk * lane_chunk(spread, c)));
                                let at = swizzled_if(k, m.key_rows.swizzled, at);
                                match chunk {
                                    CHUNK => k.ld_shared_v4::<U32>(at).to_vec(),
                                    8 => k.ld_shared_v2::<U32>(at).to_vec(),
                                    // 3-bit codes: three words (only f16 rows are swizzled).
                                    _ => (0..chunk / 4)
                                        .map(|w| k.ld_shared::<U32>(at.plus(i64::from(4 * w))))
                                        .collect(),
                                }
                            })
                            .collect();
                        match score.straddling() {
                            true => (words.chunks(3))
                                .flat_map(|chunk| triplet_registers(k, chunk))
                                .collect(),
                            false => (words.into_iter())
                                .flat_map(|w| key_registers(k, score.key, w))
                                .collect(),
                        }
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
                    let logit = sums.logit(k, ct, half);
                    logits.push(match &queries.bias {
                        Some(bias) => k.add(logit, bias[ct]),
                        None => logit,
                    });
                }
            }
        }
        logits
    }

    /// Per (slot, row half): whether the lane's C row is one of the `items`
    /// of its tile.
    pub(super) fn rows_in(
        &self,
        k: &mut Kernel,
        score: &MmaScoreThread,
        items: Reg<U32>,
    ) -> Vec<Reg<Pred>> {
        let plan = self.cta.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        (0..self.frag.slots(m))
            .flat_map(|j| [0, 1].map(|half| (j, half)))
            .map(|(j, half)| {
                let token = k.add(score.key_row, j * plan.warps * TILE + 8 * half);
                k.setp(Cmp::Lt, token, items)
            })
            .collect()
    }
}

/// Where a lane's query elements come from ([`ScoreMma::query_source`]).
pub(super) struct QuerySource {
    /// Bytes from one of the lane's query chunks to the next.
    chunk_bytes: u32,
    spread: bool,
    /// The lane's first header scale and zero point.
    scales_at: Option<Reg<U32>>,
    zeros_at: Option<Reg<U32>>,
}

/// Where the elements of fragment register `r` lie among a lane's elements
/// ([`ScoreMma::lane_elements`]: its chunks back to back).
pub(super) fn register_positions(m: &MmaScore, r: u32) -> Vec<usize> {
    let chunk = m.chunk_elements();
    // Element i of the row is the lane's (i / 4·chunk)-th chunk's (i % 4·chunk)-th.
    let position = |i: u32| (i / (ROW_LANES * chunk) * chunk + i % (ROW_LANES * chunk)) as usize;
    (0..m.register_elements())
        .map(|e| position(m.key_element(r, e)))
        .collect()
}

/// The sum over a B column's four lanes (its row) of the lanes' `sum`,
/// zero where the column's head does not exist.
pub(super) fn row_sum(k: &mut Kernel, sum: Reg<F32>, ok: Reg<Pred>) -> Reg<F32> {
    let mut sum = k.selp(sum, 0.0f32, ok);
    for mask in [1, 2] {
        let other = k.shfl_bfly(sum, mask);
        sum = k.add(sum, other);
    }
    sum
}

/// The exponent of the queries' σ ([`column_sigma`]).
pub(super) fn exponent(m: &MmaScore) -> u32 {
    match m.key {
        Element::Half | Element::Fp8(_) => HALF_EXPONENT,
        Element::Int { .. } => INT_EXPONENT,
    }
}

/// σ, lowered so that the bias times σ stays finite where the scaled
/// queries are (near) zero, as on a page of one item (every scale 0).
pub(super) fn bounded_sigma(
    k: &mut Kernel,
    sigma: Reg<F32>,
    query_zeros: Option<Reg<F32>>,
) -> Reg<F32> {
    match query_zeros {
        Some(sum) => {
            let bound = column_sigma(k, &[sum], Across::Butterfly(&[]), BIAS_EXPONENT);
            k.min(sigma, bound)
        }
        None => sigma,
    }
}

/// The C columns' head's factor to logits (`factor` over its σ), and its
/// bias in the C sums' units (the head's `Σ query · zero` times σ over the
/// codes' factor): lane 8·quad's B column is head `quad`'s.
pub(super) fn column_factors(
    k: &mut Kernel,
    lanes: &Lanes,
    sigma: Reg<F32>,
    query_zeros: Option<Reg<F32>>,
    factor: Reg<F32>,
    code_scale: f32,
) -> (Reg<F32>, Option<Reg<F32>>) {
    let inverse = unscale_of(k, sigma);
    let owner = k.shl(lanes.quad, 3u32);
    let inverse = k.shfl_idx(inverse, owner);
    let to_logits = k.mul(inverse, factor);
    let bias = query_zeros.map(|sum| {
        let scaled = k.mul(sum, sigma);
        let units = k.mul(scaled, 1.0 / code_scale);
        k.shfl_idx(units, owner)
    });
    (to_logits, bias)
}

/// The fragment registers of one word of key elements
/// ([`MmaScore::key_element`]): f16 pairs and bytes as they are; 4- or 2-bit
/// codes as the bytes' top bits, 2^(8 − bits) times the code (the codes at
/// the lowest bits first); fp8 bytes as two exact f16 pairs (bytes 0-1,
/// then 2-3).
pub(super) fn key_registers(k: &mut Kernel, element: Element, w: Reg<U32>) -> Vec<Reg<U32>> {
    match element {
        Element::Int { bits, .. } if bits < 8 => (0..8 / bits)
            .map(|j| match code_register(bits, j) {
                (0, mask) => k.and(w, mask),
                (shift, mask) => {
                    let codes = k.shl(w, shift);
                    k.and(codes, mask)
                }
            })
            .collect(),
        Element::Fp8(format) => {
            let high = k.shr(w, 16u32);
            [w, high]
                .into_iter()
                .map(|x| fp8_pair(k, format, x))
                .collect()
        }
        _ => vec![w],
    }
}

/// The fragment registers of a 12-byte chunk of 3-bit codes (its three
/// words): transposed by byte permutes, then each register's parts
/// shifted and masked ([`triplet_register`]).
pub(super) fn triplet_registers(k: &mut Kernel, words: &[Reg<U32>]) -> Vec<Reg<U32>> {
    let [w0, w1, w2] = words else {
        unreachable!("a chunk of 3-bit codes is three words")
    };
    let transposed = TRIPLET_SELECTORS.map(|(first, second)| {
        let low = k.prmt(*w0, *w1, first);
        k.prmt(low, *w2, second)
    });
    (0..8)
        .map(|j| {
            let parts: Vec<Reg<U32>> = (triplet_register(j).into_iter())
                .map(|(b, shift, mask)| {
                    let x = transposed[b];
                    let x = match shift {
                        0 => x,
                        s if s > 0 => k.shl(x, s as u32),
                        s => k.shr(x, s.unsigned_abs()),
                    };
                    k.and(x, mask)
                })
                .collect();
            parts.into_iter().reduce(|a, b| k.or(a, b)).expect("a part")
        })
        .collect()
}

/// The exact f16 pair of the fp8 bytes 0 (low half) and 1 (high half) of `x`.
pub(super) fn fp8_pair(k: &mut Kernel, format: Fp8, x: Reg<U32>) -> Reg<U32> {
    let pair = k.low16(x);
    let halves = match format {
        Fp8::E4m3 => k.e4m3x2_to_f16x2(pair),
        Fp8::E5m2 => k.e5m2x2_to_f16x2(pair),
    };
    k.bitcast(halves)
}
