//! The score's B fragments: each head's query (times a page's header
//! scales and zero points, rebuilt at each page's first tile) times a power
//! of two σ per head, as f16 hi / lo parts or the signed bytes of an
//! integer; and the factor from the C sums to logits. [`super::page_fragments`]
//! splits a page's preparation over the CTA's warps.

use super::super::builder::{Cmp, Kernel, Op, Pred, Reg, Shared, F32, S32, U32};
use super::super::plan::PageQueries;
use super::super::streams::CHUNK;
use super::super::tensor_cores::{lane_chunk, Element, MmaScore, ROW_LANES, WARP_LANES};
use super::cta::Tile;
use super::fragments::{column_sigma, f16_part, unscale_of, Across, Lanes, HALF_EXPONENT};
use super::score_mma::{MmaScoreThread, Queries, ScoreMma};

/// [`HALF_EXPONENT`] for queries as integers: below 2^22, so their top
/// byte `d0` of [`Queries`] stays within ±64.
pub(super) const INT_EXPONENT: u32 = 21;

/// The same for a page's `Σ query · zero` of a head, which bounds σ: the
/// bias in the C sums' units stays below 2^55, and the queries' rounding
/// then costs the codes' sum at most `Σ code / 2^48` of the bias (2^-33
/// for 128 8-bit codes), below the bias's own f32 rounding. It binds only
/// where the bias is 2^27 times the largest query times scale or more.
pub(super) const BIAS_EXPONENT: u32 = 48;

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

impl ScoreMma<'_> {
    /// Every head's query in the padded rows at `pq.query`, once per CTA.
    /// The barrier first: the key prologue may have written the query; the
    /// page loop's first barrier makes the copy visible.
    pub(super) fn pad_queries(
        &self,
        k: &mut Kernel,
        s: &MmaScore,
        pq: PageQueries,
        query_base: Reg<U32>,
    ) {
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
