//! A tile with both score and accumulate on the tensor cores: a warp's
//! score and accumulate steps are the same tokens, so each warp keeps its own
//! softmax reference and sums per head (a lane's C columns in both are one
//! head's, so the decays stay in the lane), and the weights go from the
//! score's C fragments to the accumulate's B fragments by shuffles: no
//! barrier and no write and read back through shared memory between score
//! and accumulate.
//! Pipelined, a tile's values accumulate during the next tile, beside its
//! score. The warps' softmax states meet once, after the stream.

use super::super::builder::{Cmp, Kernel, Pred, Reg, Shared, F32, U32};
use super::super::tensor_cores::{MmaPlan, TILE, TILE_HEADS};
use super::accumulate_mma::{AccumulateMma, MmaValues, ValueTile};
use super::cta::{Cta, Tile};
use super::fragments::{f16_parts, Across, Fragments};
use super::score_mma::{MmaScoreThread, ScoreMma};
use super::softmax::RESCALE_SLACK_BITS;
use super::value_fragments::{item_scale, parity_fragments};

/// The tensor-core tile: score, warp softmax and accumulate together.
#[derive(Clone, Copy)]
pub(super) struct WarpTile<'a> {
    pub(super) cta: &'a Cta<'a>,
    pub(super) frag: Fragments<'a>,
    pub(super) score_mma: ScoreMma<'a>,
    pub(super) acc_mma: AccumulateMma<'a>,
}

/// The pipelined stream's carried tile ([`WarpTile::tile`]): its
/// buffer, valid items and softmax weights, its values not yet accumulated.
pub(super) struct Pending {
    pub(super) buf: Reg<U32>,
    pub(super) items: Reg<U32>,
    /// Per (slot, column tile, row half), as [`mma_softmax`] returns them.
    pub(super) weights: Vec<Reg<F32>>,
}

impl Pending {
    /// The tile's buffer and valid items.
    pub(super) fn span(&self) -> (Reg<U32>, Reg<U32>) {
        (self.buf, self.items)
    }
}

impl WarpTile<'_> {
    /// The pipeline's carried state, empty before the first tile. Its buffer
    /// is tile −1's, whose values no copy writes while the first tile's
    /// products read its (unused) rows.
    pub(super) fn pending(&self, k: &mut Kernel, m: &MmaPlan) -> Pending {
        let plan = self.cta.plan;
        let weights = self.frag.slots(m) * m.column_tiles * 2;
        Pending {
            buf: k.add(
                self.cta.smem,
                plan.buffers + (plan.stages - 1) * plan.buffer_bytes,
            ),
            items: k.mov(0u32),
            weights: (0..weights).map(|_| k.mov(0.0f32)).collect(),
        }
    }

    /// One tile with the score on the tensor cores. Unpipelined: the warp's
    /// logits, its softmax, and its tokens' values times their weights.
    /// Pipelined: the logits of this tile, the pending tile's values times
    /// its weights, then this tile's softmax, whose weights become the
    /// pending ones. The score and the products share no data, so ptxas
    /// interleaves them; the products come before the softmax, whose decay
    /// they must take.
    pub(super) fn tile(
        &self,
        k: &mut Kernel,
        tile: &Tile,
        pending: Option<&Pending>,
        score: &MmaScoreThread,
        values: &MmaValues,
    ) {
        let in_tile = self.score_mma.rows_in(k, score, tile.items);
        let values_buf = pending.map_or(tile.buf, |p| p.buf);
        let values_items = pending.map_or(tile.items, |p| p.items);
        let over = self.frag.ready_rows(
            k,
            score.gather.as_ref().map(|g| (g, tile.buf)),
            values
                .gather
                .as_ref()
                .map(|g| (g, values_buf, values_items)),
        );
        self.score_mma.page_queries(k, tile, score);
        let Some(pending) = pending else {
            // The item scales and σ first: they do not wait for the score.
            let scales = self.item_scales(k, score, values, tile.buf, &in_tile);
            let logits = self.score_mma.logits(k, tile, score, over);
            let weights = mma_softmax(k, score, values, &logits, &in_tile);
            let tile = ValueTile {
                buf: tile.buf,
                items: tile.items,
                over,
            };
            self.weighted_products(k, score, values, tile, &weights, scales);
            return;
        };
        let logits = self.score_mma.logits(k, tile, score, over);
        self.drain(k, pending, score, values, over);
        let weights = mma_softmax(k, score, values, &logits, &in_tile);
        for (&to, &from) in pending.weights.iter().zip(&weights) {
            k.assign(to, from);
        }
        k.assign(pending.items, tile.items);
        k.assign(pending.buf, tile.buf);
    }

    /// The pending tile's values times its weights (times its item scales
    /// and σ, whose rescale of the accumulators comes first); `over` as
    /// [`Fragments::ready_rows`] answers for them (`None`: checked here).
    pub(super) fn drain(
        &self,
        k: &mut Kernel,
        pending: &Pending,
        score: &MmaScoreThread,
        values: &MmaValues,
        over: Option<Reg<Pred>>,
    ) {
        let over = over.or_else(|| {
            self.frag.ready_rows(
                k,
                None,
                values
                    .gather
                    .as_ref()
                    .map(|g| (g, pending.buf, pending.items)),
            )
        });
        let in_tile = self.score_mma.rows_in(k, score, pending.items);
        let scales = self.item_scales(k, score, values, pending.buf, &in_tile);
        let tile = ValueTile {
            buf: pending.buf,
            items: pending.items,
            over,
        };
        self.weighted_products(k, score, values, tile, &pending.weights, scales);
    }

    /// The values of `tile` times its softmax `weights` ([`mma_softmax`]'s
    /// order) and item `scales`: the weights'
    /// f16 parts, moved to the accumulate's B fragments (one per value group),
    /// into the products; with zero points, the weights times the zeros
    /// into the zero sums.
    pub(super) fn weighted_products(
        &self,
        k: &mut Kernel,
        score: &MmaScoreThread,
        values: &MmaValues,
        tile: ValueTile,
        weights: &[Reg<F32>],
        scales: Option<TokenScales>,
    ) {
        let columns = score.heads.len();
        let (weights, scales) = match scales {
            Some(s) => {
                let (weights, s) = s.apply_sigma(k, weights);
                (weights, Some(s))
            }
            None => (weights.to_vec(), None),
        };
        if let Some(zeros) = scales.as_ref().and_then(|s| s.zeros.as_ref()) {
            for (i, &w) in weights.iter().enumerate() {
                let sums = &values.zero_sums[i / 2 % columns];
                for (&sum, &zero) in sums.iter().zip(&zeros[token_of(i, columns)]) {
                    k.fma_to(sum, w, zero, sum);
                }
            }
        }
        let parts = weight_parts(k, &weights, columns, scales.as_ref());
        let b = mma_exchange(k, score, values, &parts);
        self.acc_mma.products(k, tile, values, &b);
    }

    /// With value scales: those of the lane's C rows of the tile in `buf`
    /// (`in_tile` per slot and row half) and the tile's σ
    /// ([`AccumulateMma::item_sigma`]), with their zero points.
    pub(super) fn item_scales(
        &self,
        k: &mut Kernel,
        score: &MmaScoreThread,
        values: &MmaValues,
        buf: Reg<U32>,
        in_tile: &[Reg<Pred>],
    ) -> Option<TokenScales> {
        let plan = self.cta.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let lane = score.scale_lane?;
        let rows = self.frag.rows(k, buf, m.value_rows);
        let rows = k.add(rows, lane);
        let tokens: Vec<(Shared, Reg<Pred>)> = (0..in_tile.len() as u32)
            .map(|token| {
                let offset =
                    ((token / 2) * plan.warps * TILE + 8 * (token % 2)) * m.value_rows.stride;
                (
                    Shared::at(rows).plus(offset.into()),
                    in_tile[token as usize],
                )
            })
            .collect();
        let groups = m.value_groups();
        let rows_align = if m.value_rows.swizzled {
            4
        } else {
            m.value_rows.align()
        };
        let words = |k: &mut Kernel, first: u32, count: u32| -> Vec<Vec<Reg<U32>>> {
            let byte = first / 8;
            let align = rows_align.min(1 << byte.trailing_zeros().min(4));
            (tokens.iter())
                .map(|&(at, ok)| guarded_words(k, at.plus(byte.into()), ok, count, align))
                .collect()
        };
        let halves = |k: &mut Kernel, words: &[Vec<Reg<U32>>]| -> Vec<Vec<Reg<F32>>> {
            (words.iter())
                .map(|token| token.iter().flat_map(|&w| halves_f32(k, w)).collect())
                .collect()
        };
        let (scales, zeros, largest) = match m.channel.groups {
            Some(g) if groups > 1 => {
                let pairs = groups / 2;
                // Zero points right after the scales load with them.
                let (scale_words, zero_words) = match g.zero {
                    Some(z) if z == g.scale + 32 * pairs => {
                        let both = words(k, g.scale, 2 * pairs);
                        let (s, z) = both
                            .into_iter()
                            .map(|mut w| {
                                let zeros = w.split_off(pairs as usize);
                                (w, zeros)
                            })
                            .unzip();
                        (s, Some(z))
                    }
                    zero => (words(k, g.scale, pairs), zero.map(|z| words(k, z, pairs))),
                };
                // The lane's largest |scale|, on the packed halves.
                let most = (scale_words.iter().flatten().copied())
                    .reduce(|a, b| k.max_abs_f16x2(a, b))
                    .expect("a token");
                let largest = halves_f32(k, most).to_vec();
                let zeros = zero_words.map(|w: Vec<Vec<Reg<U32>>>| halves(k, &w));
                (halves(k, &scale_words), zeros, largest)
            }
            _ => {
                let scales: Vec<Vec<Reg<F32>>> = (tokens.iter())
                    .map(|&(at, ok)| vec![item_scale(k, at, ok)])
                    .collect();
                let zeros = (m.channel.groups.and_then(|g| g.zero)).map(|z| {
                    (tokens.iter())
                        .map(|&(at, ok)| vec![item_scale(k, at.plus((z / 8).into()), ok)])
                        .collect()
                });
                let largest = scales.iter().flatten().copied().collect();
                (scales, zeros, largest)
            }
        };
        // The warp's tokens: rows of the lanes of one quad.
        let sigma = self.acc_mma.lower_sigma(k, values, &largest, Across::Warp);
        Some(TokenScales {
            sigma,
            scales,
            zeros,
        })
    }

    /// After the stream (all threads past its last barrier): each head's
    /// reference becomes the largest of the warps'; each warp's sums and
    /// accumulators are scaled to it (and the accumulators by 1/σ), and the
    /// head's reference and sum go to its softmax state.
    pub(super) fn finish(&self, k: &mut Kernel, t: &MmaScoreThread, v: &MmaValues) {
        let plan = self.cta.plan;
        k.comment("the warps' softmax states meet: one reference per head");
        let area = k.add(self.cta.smem, plan.logits);
        let warp_bytes = 4 * plan.head_stride;
        let sums = i64::from(plan.warps * warp_bytes);
        let top = k.setp(Cmp::Eq, t.lanes.row, 0u32);
        let mut slots = Vec::new();
        for ((ct, head), &head_ok) in (0u32..).zip(&t.heads).zip(&v.out_ok) {
            let index = k.add(t.lanes.quad, TILE_HEADS * ct);
            let (clamped, state) = self.frag.head_slot(k, index);
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
        let per_head = t.heads.iter().zip(slots).zip(&v.out_ok).enumerate();
        for (ct, ((head, (slot, state)), &head_ok)) in per_head {
            let at = |w: u32| Shared::at(slot).plus(i64::from(w * warp_bytes));
            let references: Vec<Reg<F32>> =
                (0..plan.warps).map(|w| k.ld_shared::<F32>(at(w))).collect();
            let most = (references.iter().copied())
                .reduce(|a, b| k.max(a, b))
                .expect("a warp");
            let factor = power_ratio(k, head.reference, most);
            v.scale_column(k, ct, factor);
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
}

/// The warp's online softmax of the C sums of [`ScoreMma::logits`]
/// (logits over their column tile's `to_logits`, a positive factor: the
/// maxima are taken on the sums, the weights' exponents by one `fma`).
/// When a logit passes its head's reference by more than the slack in
/// some lane (a warp vote), the warp's references move to the tile's
/// maxima and the sums and accumulators decay; the weights are then
/// 2^(s − reference). Returns the lane's weights in the logits' order (per
/// slot, column tile and row half: tokens `row` and `row + 8`). `in_tile`
/// is per (slot, row half) of the lane's C rows.
pub(super) fn mma_softmax(
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
    for (ct, (head, &best)) in t.heads.iter().zip(&most).enumerate() {
        // The head's lanes: the same quad in every row.
        let mut best = best;
        for mask in [4, 8, 16] {
            let other = k.shfl_bfly(best, mask);
            best = k.max(best, other);
        }
        let new = k.max(head.reference, best);
        let decay = power_ratio(k, head.reference, new);
        k.mul_to(head.sum, head.sum, decay);
        values.scale_column(k, ct, decay);
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
pub(super) fn token_of(i: usize, columns: usize) -> usize {
    i / (2 * columns) * 2 + i % 2
}

/// Per token of the lane's C rows ([`token_of`]): its value scales, one per
/// value group (or the item's one), and with zero points those; and the
/// tile's σ, which the weights take instead where they are fewer
/// ([`TokenScales::apply_sigma`]).
pub(super) struct TokenScales {
    pub(super) sigma: Reg<F32>,
    pub(super) scales: Vec<Vec<Reg<F32>>>,
    pub(super) zeros: Option<Vec<Vec<Reg<F32>>>>,
}

impl TokenScales {
    /// σ on the fewer registers: the `weights` times σ, or the scales and
    /// zeros; returns the weights and scales to multiply.
    fn apply_sigma(self, k: &mut Kernel, weights: &[Reg<F32>]) -> (Vec<Reg<F32>>, TokenScales) {
        let sigma = self.sigma;
        let zeros = self.zeros.iter().flatten().flatten().count();
        if weights.len() < self.scales.iter().flatten().count() + zeros {
            return (weights.iter().map(|&w| k.mul(w, sigma)).collect(), self);
        }
        let times = |k: &mut Kernel, rows: Vec<Vec<Reg<F32>>>| -> Vec<Vec<Reg<F32>>> {
            (rows.into_iter())
                .map(|row| row.into_iter().map(|x| k.mul(x, sigma)).collect())
                .collect()
        };
        let scales = times(k, self.scales);
        let zeros = self.zeros.map(|z| times(k, z));
        let scaled = TokenScales {
            sigma,
            scales,
            zeros,
        };
        (weights.to_vec(), scaled)
    }
}

/// `count` words at `at` (0 where `ok` fails), whose address is a multiple
/// of `align` bytes: by the widest loads that alignment allows.
fn guarded_words(
    k: &mut Kernel,
    at: Shared,
    ok: Reg<Pred>,
    count: u32,
    align: u32,
) -> Vec<Reg<U32>> {
    let words: Vec<Reg<U32>> = (0..count).map(|_| k.mov(0u32)).collect();
    k.guarded(ok, true, |k| {
        let mut w = 0;
        while w < count {
            let here = at.plus((4 * w).into());
            let aligned = |bytes: u32| align >= bytes && (4 * w) % bytes == 0;
            let loaded: Vec<Reg<U32>> = if count - w >= 4 && aligned(16) {
                k.ld_shared_v4::<U32>(here).to_vec()
            } else if count - w >= 2 && aligned(8) {
                k.ld_shared_v2::<U32>(here).to_vec()
            } else {
                vec![k.ld_shared::<U32>(here)]
            };
            for x in loaded {
                k.assign(words[w as usize], x);
                w += 1;
            }
        }
    });
    words
}

/// Both f16 halves of `word` as f32, the low one first.
fn halves_f32(k: &mut Kernel, word: Reg<U32>) -> [Reg<F32>; 2] {
    let (low, high) = k.split_halves(word);
    [k.f16_to_f32(low), k.f16_to_f32(high)]
}

/// [`mma_softmax`]'s weights times the value scales (and σ, per token) as
/// f16 `[hi, lo]` pairs, per slot, column tile and value group.
pub(super) fn weight_parts(
    k: &mut Kernel,
    weights: &[Reg<F32>],
    columns: usize,
    scales: Option<&TokenScales>,
) -> Vec<Vec<Vec<[Reg<U32>; 2]>>> {
    let groups = scales.map_or(1, |s| s.scales[0].len());
    // Per weight, per group.
    let scaled: Vec<Vec<Reg<F32>>> = (weights.iter().enumerate())
        .map(|(i, &w)| match scales {
            Some(s) => (s.scales[token_of(i, columns)].iter())
                .map(|&scale| k.mul(w, scale))
                .collect(),
            None => vec![w],
        })
        .collect();
    scaled
        .chunks(2 * columns)
        .map(|slot| {
            slot.chunks(2)
                .map(|pair| {
                    (0..groups)
                        .map(|g| {
                            let (hi, lo) = f16_parts(k, pair[0][g], pair[1][g]);
                            [hi, lo]
                        })
                        .collect()
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
pub(super) fn mma_exchange(
    k: &mut Kernel,
    t: &MmaScoreThread,
    values: &MmaValues,
    parts: &[Vec<Vec<[Reg<U32>; 2]>>],
) -> Vec<Vec<Vec<[Reg<U32>; 2]>>> {
    k.comment("the weights from the score's C fragments to the accumulate's B fragments");
    let mut b = Vec::new();
    for slot in parts {
        let mut columns = Vec::new();
        for groups in slot {
            let mut fragments = Vec::new();
            for &[hi, lo] in groups {
                match values.parity_selectors {
                    Some(selectors) => {
                        let pairs = t
                            .sources
                            .map(|source| [hi, lo].map(|part| k.shfl_idx(part, source)));
                        fragments.extend(parity_fragments(k, pairs, selectors));
                    }
                    None => fragments.push(t.sources.map(|source| {
                        let high = k.shfl_idx(hi, source);
                        let low = k.shfl_idx(lo, source);
                        k.selp(low, high, t.lanes.low_part)
                    })),
                }
            }
            columns.push(fragments);
        }
        b.push(columns);
    }
    b
}

/// 2^(from − to) for references in log2 units, 1 when they are equal (also
/// when both are −∞: a head with no logits yet).
pub(super) fn power_ratio(k: &mut Kernel, from: Reg<F32>, to: Reg<F32>) -> Reg<F32> {
    let d = k.sub(from, to);
    let ratio = k.ex2(d);
    let same = k.setp(Cmp::Eq, from, to);
    k.selp(1.0f32, ratio, same)
}
