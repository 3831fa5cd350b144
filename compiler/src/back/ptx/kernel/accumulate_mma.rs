//! The accumulate on the tensor cores (tiers `tensor_cores.rs` admits), per
//! 16-token step of a warp: `Oᵀ += Vᵀ · P'ᵀ`. A = value channels × tokens
//! (row `r` of channel tile `t` is channel `2 · t + r / 8` of lane group
//! `r % 8`'s channels, two tokens per register by byte permutes; gathered
//! values, as stored: a token's channel pair per register, the reduction
//! over (token, channel parity), [`channel_pair_products`]); B = the softmax
//! weights (times the items' scales and a power of two σ) as (head, part)
//! columns (gathered values: (head, channel parity) columns, one `mma.sync`
//! per part). Each warp sums its own steps in registers; the warps' sums
//! meet in the accumulator array once, after the stream.

use super::super::builder::{Cmp, Kernel, Op, Pred, Reg, Shared, F32, U32};
use super::super::tensor_cores::{
    code_shift, subnormal_shift, window_channel, Element, MmaPlan, ValueGroups, ROW_LANES, TILE,
    TILE_HEADS, WARP_LANES,
};
use super::cta::{divide, Cta, Rescale, Tile, HEADER_SLOT0};
use super::fragments::{
    column_sigma, f16_part, f16_parts, scale_all, swizzled_if, unscale_of, Across, Fragments,
    Lanes, StepTokens, HALF_EXPONENT, MAX_EXPONENT,
};
use super::gather::FragmentGather;
use super::lookup::{LaneLookup, Lookups};
use super::softmax::RESCALE_SLACK_BITS;
use super::value_fragments::{
    channel_pair_products, int_pair, item_scale, parity_fragments, sum_swizzle, sum_swizzle_of,
    token_pair, TokenWords, ROW_GROUPS,
};

/// The accumulate on the tensor cores.
#[derive(Clone, Copy)]
pub(super) struct AccumulateMma<'a> {
    pub(super) cta: &'a Cta<'a>,
    pub(super) frag: Fragments<'a>,
}

/// A lane's tensor-core accumulate state for the whole stream.
pub(super) struct MmaValues {
    pub(super) lanes: Lanes,
    /// The weights' place in the logits rows when the score is not on the
    /// tensor cores (they are then read from shared memory).
    pub(super) shared: Option<SharedWeights>,
    /// Per column tile: whether the C columns' head (the score's, too) exists.
    pub(super) out_ok: Vec<Reg<Pred>>,
    /// Per column tile and channel tile: the output accumulators.
    pub(super) acc: Vec<Vec<[Reg<F32>; 4]>>,
    /// With zero points, per column tile and value group: the lane's tokens'
    /// weights (times σ) times the group's zero points, for its C columns'
    /// head ([`ValueGroups`]); scaled with the accumulators.
    pub(super) zero_sums: Vec<Vec<Reg<F32>>>,
    /// Value groups whose lane-group codes are one or two bytes of a word:
    /// per byte, the `prmt` selector that takes it from two tokens' words
    /// to bytes 0 and 2 ([`AccumulateMma::group_products`]).
    pub(super) byte_selectors: Vec<Reg<U32>>,
    /// Windowed value groups ([`ValueGroups::windowed`]): where the lane
    /// group's codes lie past the word `value_lane` points at.
    pub(super) window: Option<CodeWindow>,
    /// With item scales: the weights' running σ ([`AccumulateMma::item_sigma`]).
    pub(super) sigma: Option<Reg<F32>>,
    /// Byte offset of the lane's value channels in its first token (of the
    /// token with gathered fragments).
    pub(super) value_lane: Reg<U32>,
    /// Gathered value fragments: the lane's state.
    pub(super) gather: Option<FragmentGather>,
    /// Looked-up value fragments: the lane's state.
    pub(super) lookup: Option<LaneLookup>,
    /// With gathered values: per row half of a weights pair, the `prmt`
    /// selector that moves that half to the lane's B column parity
    /// ([`parity_fragments`]).
    pub(super) parity_selectors: Option<[Reg<U32>; 2]>,
    /// The lane's first token of a step (`16 · warp + spacing · quad`),
    /// and its others' offsets from it ([`StepTokens`]).
    pub(super) token: Reg<U32>,
    pub(super) steps: [u32; 4],
}

/// A lane group's codes of a value group at any bit: they start `shift`
/// bits into the word at `value_lane` (plus the group's offset) and end in
/// the word `next` bytes after it (0 or 4).
#[derive(Clone, Copy)]
pub(super) struct CodeWindow {
    pub(super) shift: Reg<U32>,
    pub(super) next: Reg<U32>,
}

impl MmaValues {
    /// Column tile `ct`'s accumulators and zero sums times `factor`.
    pub(super) fn scale_column(&self, k: &mut Kernel, ct: usize, factor: Reg<F32>) {
        scale_all(k, &self.acc[ct], factor);
        for &sum in &self.zero_sums[ct] {
            k.mul_to(sum, sum, factor);
        }
    }
}

/// A tile whose values accumulate: its buffer and valid items, and (with
/// gathered values) whether one of the warp's rows of it has more set bits
/// than its bitmap keeps ([`Fragments::ready_rows`]).
#[derive(Clone, Copy)]
pub(super) struct ValueTile {
    pub(super) buf: Reg<U32>,
    pub(super) items: Reg<U32>,
    pub(super) over: Option<Reg<Pred>>,
}

/// Softmax weights the score phase left in the logits rows.
pub(super) struct SharedWeights {
    /// Per column tile: the weights of the B column's head at the lane's
    /// first token, and whether that head exists.
    pub(super) columns: Vec<(Reg<U32>, Reg<Pred>)>,
    /// Per column tile: the softmax state slot of the C columns' head.
    pub(super) state: Vec<Reg<U32>>,
}

impl AccumulateMma<'_> {
    /// The accumulate's constant state: zero accumulators, the lane's
    /// value channels and (with the weights in shared memory) their columns.
    pub(super) fn setup(&self, k: &mut Kernel, m: &MmaPlan) -> MmaValues {
        k.comment(&format!(
            "tensor-core accumulate: {} step(s) per warp, {} column tile(s), {:?} values",
            self.frag.slots(m),
            m.column_tiles,
            m.channel.element
        ));
        let lanes = self.frag.lanes(k);
        let steps = StepTokens::of(m);
        let token = k.mul(lanes.quad, steps.spacing);
        let token = k.mad_lo(lanes.warp, TILE, token);
        let zero = k.mov(0.0f32);
        // Gathered values: columns (head, channel parity), one C tile per two
        // channel tiles ([`channel_pair_products`]).
        let acc_tiles = match m.value_rows.fragments() {
            Some(_) => m.channel_tiles() / 2,
            None => m.channel_tiles(),
        };
        let (mut out_ok, mut acc) = (Vec::new(), Vec::new());
        for ct in 0..m.column_tiles {
            let out_head = k.add(lanes.quad, TILE_HEADS * ct);
            out_ok.push(k.setp(Cmp::Lt, out_head, self.cta.group));
            acc.push(
                (0..acc_tiles)
                    .map(|_| [0; 4].map(|_| k.mov(zero)))
                    .collect(),
            );
        }
        let parity_selectors = m.value_rows.fragments().map(|_| {
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
            .then(|| self.shared_weights(k, m, &lanes, token));
        // The largest σ: the first tile sets the real one.
        let sigma = m
            .scaled_values()
            .then(|| k.mov(f32::from_bits(MAX_EXPONENT << 23)));
        let zero_sums = (0..m.column_tiles)
            .map(|_| (0..m.zero_sums()).map(|_| k.mov(zero)).collect())
            .collect();
        let gather = (m.value_rows.fragments())
            .map(|g| FragmentGather::for_values(k, g, m, &self.cta.plan.value, lanes.row));
        let mut byte_selectors = Vec::new();
        let mut window = None;
        let lookup = Lookups { cta: self.cta }.setup(k, m, &lanes);
        let channels = match (&lookup, gather.as_ref(), m.channel.groups) {
            (Some(lookup), _, _) => lookup.codes,
            (None, Some(_), _) => k.mov(0u32),
            (None, None, Some(groups)) if groups.windowed(m.channel.element) => {
                let bits = groups.lane_bits(m.channel.element);
                let first = k.mul(lanes.row, bits);
                let shift = k.and(first, 31u32);
                let end = k.add(shift, bits);
                let straddles = k.setp(Cmp::Gt, end, 32u32);
                window = Some(CodeWindow {
                    shift,
                    next: k.selp(4u32, 0u32, straddles),
                });
                let word = k.shr(first, 5u32);
                k.mad_lo(word, 4u32, m.value_offset())
            }
            (None, None, Some(groups)) => {
                // The word holding the lane group's codes of group 0.
                let lane_bytes = groups.lane_bytes(m.channel.element);
                let bytes = k.mul(lanes.row, lane_bytes);
                if lane_bytes < 4 {
                    let first = k.and(bytes, 3u32);
                    for b in 0..lane_bytes {
                        let byte = k.add(first, b);
                        byte_selectors.push(k.mad_lo(byte, 0x1111u32, 0x4400u32));
                    }
                }
                let word = k.and(bytes, !3u32);
                k.add(word, m.value_offset())
            }
            (None, None, None) => k.mad_lo(lanes.row, m.group_words() * 4, m.value_offset()),
        };
        let value_lane = k.mad_lo(token, m.value_rows.stride, channels);
        MmaValues {
            lanes,
            shared,
            out_ok,
            acc,
            zero_sums,
            byte_selectors,
            window,
            sigma,
            value_lane,
            gather,
            lookup,
            parity_selectors,
            token,
            steps: steps.offsets(),
        }
    }

    /// Where the lane finds its B weights in the logits rows.
    pub(super) fn shared_weights(
        &self,
        k: &mut Kernel,
        m: &MmaPlan,
        lanes: &Lanes,
        token: Reg<U32>,
    ) -> SharedWeights {
        let plan = self.cta.plan;
        let row_head = k.shr(lanes.row, 1u32);
        let logits = k.add(self.cta.smem, plan.logits);
        let row_bytes = 4 * plan.head_stride;
        let (mut columns, mut state) = (Vec::new(), Vec::new());
        for ct in 0..m.column_tiles {
            let head = k.add(row_head, TILE_HEADS * ct);
            let ok = k.setp(Cmp::Lt, head, self.cta.group);
            let (clamped, _) = self.frag.head_slot(k, head);
            let column = k.mad_lo(clamped, 4u32, logits);
            columns.push((k.mad_lo(token, row_bytes, column), ok));
            let out_head = k.add(lanes.quad, TILE_HEADS * ct);
            state.push(self.frag.head_slot(k, out_head).1);
        }
        SharedWeights { columns, state }
    }

    /// The tile's weighted values into the lane's accumulators, the weights
    /// read from the logits rows; first, with `rescale`, the accumulators
    /// times their head's decay.
    pub(super) fn tile(&self, k: &mut Kernel, tile: &Tile, t: &MmaValues, rescale: Rescale) {
        let plan = self.cta.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let shared = t.shared.as_ref().expect("weights in the logits rows");
        let kept = k.label();
        if let Rescale::When(p) = rescale {
            k.bra_if(p, false, kept);
        }
        for (ct, &state) in shared.state.iter().enumerate() {
            let decay = k.ld_shared::<F32>(Shared::at(state).plus(plan.decay.into()));
            t.scale_column(k, ct, decay);
        }
        k.place(kept);
        let stride = m.value_rows.stride;
        let row_bytes = 4 * plan.head_stride;
        let items = self.frag.rows(k, tile.buf, m.value_rows);
        let token_rows = k.mad_lo(t.token, stride, items);
        let slots = self.frag.slots(m);
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
        let scales: Option<Vec<Reg<F32>>> = m.channel.scale.map(|bit| {
            let scales: Vec<Reg<F32>> = (0..slots)
                .flat_map(|j| t.steps.iter().map(move |&d| (j, d)))
                .zip(ok.iter().flatten())
                .map(|((j, d), &ok)| {
                    let offset = (j * plan.warps * TILE + d) * stride + bit / 8;
                    item_scale(k, Shared::at(token_rows).plus(offset.into()), ok)
                })
                .collect();
            // The warp's tokens: quads of the lanes of one row.
            self.item_sigma(k, t, &scales, Across::Butterfly(&[1, 2]))
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
        let over = self.frag.ready_rows(
            k,
            None,
            t.gather.as_ref().map(|g| (g, tile.buf, tile.items)),
        );
        let tile = ValueTile {
            buf: tile.buf,
            items: tile.items,
            over,
        };
        self.products(k, tile, t, &b);
    }

    /// The values of `tile` times the weights' B fragments `b` (per slot and
    /// column tile, [`super::warp_tile::mma_exchange`]'s) into the lane's accumulators.
    pub(super) fn products(
        &self,
        k: &mut Kernel,
        tile: ValueTile,
        t: &MmaValues,
        b: &[Vec<Vec<[Reg<U32>; 2]>>],
    ) {
        let plan = self.cta.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let stride = m.value_rows.stride;
        let items = tile.items;
        let rows = self.frag.rows(k, tile.buf, m.value_rows);
        let lane_base = k.add(rows, t.value_lane);
        // Page-scaled channels: the tile's products apart, scaled after.
        let sums: Vec<Vec<[Reg<F32>; 4]>> = match m.channel.page_scale {
            Some(_) => (t.acc.iter())
                .map(|tiles| {
                    tiles
                        .iter()
                        .map(|_| [0; 4].map(|_| k.mov(0.0f32)))
                        .collect()
                })
                .collect(),
            None => t.acc.clone(),
        };
        for (j, b) in (0u32..).zip(b) {
            let skip = k.label();
            if let Some(ok) = self.frag.slot_ok(k, m, t.lanes.warp, j) {
                k.bra_if(ok, false, skip);
            }
            let first = j * plan.warps * TILE;
            if let Some(groups) = m.channel.groups {
                self.group_products(k, m, groups, t, lane_base, first, b);
                k.place(skip);
                continue;
            }
            let values: Vec<TokenWords> = match &t.gather {
                Some(gather) => {
                    let items_at: Vec<Reg<U32>> = (t.steps.iter())
                        .map(|&d| k.add(lane_base, (first + d) * stride))
                        .collect();
                    // Rows past the tile's items have zero masks (Fragments::ready_rows).
                    let over = tile.over.expect("gathers check their rows");
                    (gather.rows(k, &items_at, over).into_iter())
                        .map(|words| TokenWords { words, skew: 0 })
                        .collect()
                }
                None => (t.steps.iter())
                    .map(|&d| {
                        let offset = (first + d) * stride;
                        let mut token = match &t.lookup {
                            Some(lookup) => {
                                let at = Shared::at(lane_base).plus(i64::from(offset));
                                TokenWords {
                                    words: lookup.words(k, at),
                                    skew: 0,
                                }
                            }
                            None => self.value_words(k, m, lane_base, offset),
                        };
                        // Stale f16 rows past the tile's items may hold any
                        // bits (0 · NaN poisons a sum); integers are always finite.
                        if m.channel.element.is_half() {
                            let at = k.add(t.token, first + d);
                            let ok = k.setp(Cmp::Lt, at, items);
                            token.words =
                                (token.words.iter()).map(|&w| k.selp(w, 0u32, ok)).collect();
                        }
                        token
                    })
                    .collect(),
            };
            for (ct, sums) in sums.iter().enumerate() {
                if t.gather.is_some() {
                    channel_pair_products(k, &values, sums, &b[ct]);
                    continue;
                }
                for (tile_index, c) in sums.iter().enumerate() {
                    let channel = 2 * tile_index as u32;
                    let a = [
                        token_pair(k, m, &values[0], &values[1], channel),
                        token_pair(k, m, &values[0], &values[1], channel + 1),
                        token_pair(k, m, &values[2], &values[3], channel),
                        token_pair(k, m, &values[2], &values[3], channel + 1),
                    ];
                    k.mma_f16_f32(*c, a, b[ct][0]);
                }
            }
            k.place(skip);
        }
        if let Some(slot0) = m.channel.page_scale {
            self.take_page_scales(k, m, t, tile.buf, slot0, &sums);
        }
    }

    /// The tile's sums times their channels' page scales (header slots
    /// `slot0 + channel`) into the accumulators.
    fn take_page_scales(
        &self,
        k: &mut Kernel,
        m: &MmaPlan,
        t: &MmaValues,
        buf: Reg<U32>,
        slot0: u32,
        sums: &[Vec<[Reg<F32>; 4]>],
    ) {
        let channels = m.group_channels();
        let header = k.add(buf, HEADER_SLOT0);
        let first = k.mad_lo(t.lanes.row, 4 * channels, header);
        let scales: Vec<Reg<F32>> = (0..channels)
            .map(|c| k.ld_shared::<F32>(Shared::at(first).plus(i64::from(4 * (slot0 + c)))))
            .collect();
        for (acc, sums) in t.acc.iter().zip(sums) {
            for (i, (acc, sum)) in acc.iter().zip(sums).enumerate() {
                // Registers 0, 1: the tile's row-half 0 channel, 2, 3: its other.
                for r in 0..4 {
                    let scale = scales[2 * i + r / 2];
                    k.fma_to(acc[r], sum[r], scale, acc[r]);
                }
            }
        }
    }

    /// One slot's products of grouped values ([`ValueGroups`]): per value
    /// group, the lane group's codes of the step's four tokens (one word, or
    /// the bytes of one by [`MmaValues::byte_selectors`]), as exact f16
    /// token pairs per channel, times that group's B fragments (`b`: per
    /// column tile, one per group) into the group's channel tiles.
    #[allow(clippy::too_many_arguments)]
    fn group_products(
        &self,
        k: &mut Kernel,
        m: &MmaPlan,
        groups: ValueGroups,
        t: &MmaValues,
        lane_base: Reg<U32>,
        first: u32,
        b: &[Vec<[Reg<U32>; 2]>],
    ) {
        let Element::Int { bits, signed } = m.channel.element else {
            unreachable!("grouped values are integer codes (ValueGroups::fits)")
        };
        let stride = m.value_rows.stride;
        let lane_bytes = groups.lane_bytes(m.channel.element);
        let group_bytes = groups.size * bits / 8;
        let per_group = m.group_channels() / m.value_groups();
        let tiles = groups.size / TILE;
        let window_end = t.window.map(|w| k.add(lane_base, w.next));
        let subnormal = m.subnormal_codes();
        for g in 0..m.value_groups() {
            if let (Some(window), Some(end)) = (t.window, window_end) {
                // Each token's codes as the low bits of one funnel-shifted word.
                let codes: Vec<Reg<U32>> = (t.steps.iter())
                    .map(|&d| {
                        let offset = i64::from((first + d) * stride + g * group_bytes);
                        let low = k.ld_shared::<U32>(Shared::at(lane_base).plus(offset));
                        let high = k.ld_shared::<U32>(Shared::at(end).plus(offset));
                        k.shf_r_wrap(low, high, window.shift)
                    })
                    .collect();
                let pairs: Vec<Vec<Reg<U32>>> = [(0, 1), (2, 3)]
                    .into_iter()
                    .map(|(x, y)| {
                        // Both tokens' bytes as halves, once per selector.
                        let mut halves: Vec<(u32, Reg<U32>)> = Vec::new();
                        (0..per_group)
                            .map(|c| {
                                let (selector, shift) = window_channel(c, bits);
                                let x = match halves.iter().find(|(s, _)| *s == selector) {
                                    Some(&(_, x)) => x,
                                    None => {
                                        let x = k.prmt(codes[x], codes[y], selector);
                                        halves.push((selector, x));
                                        x
                                    }
                                };
                                int_pair(k, x, bits, signed, shift, subnormal)
                            })
                            .collect()
                    })
                    .collect();
                self.group_tiles(k, t, g, tiles, &pairs, b);
                continue;
            }
            let tokens: Vec<Vec<Reg<U32>>> = (t.steps.iter())
                .map(|&d| {
                    let offset = (first + d) * stride + g * group_bytes;
                    (0..lane_bytes.div_ceil(4))
                        .map(|w| {
                            let at = Shared::at(lane_base).plus(i64::from(offset + 4 * w));
                            k.ld_shared::<U32>(at)
                        })
                        .collect()
                })
                .collect();
            // Per token pair (0, 1) and (2, 3), per lane-group channel of the
            // group: its f16 pair.
            let pairs: Vec<Vec<Reg<U32>>> = [(0, 1), (2, 3)]
                .into_iter()
                .map(|(x, y)| {
                    let bytes: Vec<Reg<U32>> = (0..lane_bytes)
                        .map(|byte| match t.byte_selectors.get(byte as usize) {
                            Some(&selector) => k.prmt_by(tokens[x][0], tokens[y][0], selector),
                            None => {
                                let (w, i) = ((byte / 4) as usize, byte % 4);
                                let selector = i | i << 4 | (4 + i) << 8 | (4 + i) << 12;
                                k.prmt(tokens[x][w], tokens[y][w], selector)
                            }
                        })
                        .collect();
                    (0..per_group)
                        .map(|c| {
                            let byte = bytes[(c * bits / 8) as usize];
                            int_pair(k, byte, bits, signed, code_shift(c, bits), subnormal)
                        })
                        .collect()
                })
                .collect();
            self.group_tiles(k, t, g, tiles, &pairs, b);
        }
    }

    /// Group `g`'s channel tiles of a slot: `pairs` per token pair and
    /// lane-group channel of the group, times its B fragments.
    fn group_tiles(
        &self,
        k: &mut Kernel,
        t: &MmaValues,
        g: u32,
        tiles: u32,
        pairs: &[Vec<Reg<U32>>],
        b: &[Vec<[Reg<U32>; 2]>],
    ) {
        for i in 0..tiles {
            let c = 2 * i as usize;
            let a = [pairs[0][c], pairs[0][c + 1], pairs[1][c], pairs[1][c + 1]];
            for (acc, b) in t.acc.iter().zip(b) {
                k.mma_f16_f32(acc[(g * tiles + i) as usize], a, b[g as usize]);
            }
        }
    }

    /// The weights' σ for a tile whose tokens' item scales are `scales`
    /// (the warp's tokens in the lanes `across`): the
    /// largest weight is 2^8 ([`RESCALE_SLACK_BITS`]), so σ of the largest
    /// scale times 2^8 keeps every weight times its scale in f16's range.
    /// The running σ only drops; when it does, the accumulators take the
    /// ratio. Returns the scales times σ.
    pub(super) fn item_sigma(
        &self,
        k: &mut Kernel,
        t: &MmaValues,
        scales: &[Reg<F32>],
        across: Across,
    ) -> Vec<Reg<F32>> {
        let sigma = self.lower_sigma(k, t, scales, across);
        scales.iter().map(|&s| k.mul(s, sigma)).collect()
    }

    /// [`AccumulateMma::item_sigma`]'s σ update alone; returns σ.
    pub(super) fn lower_sigma(
        &self,
        k: &mut Kernel,
        t: &MmaValues,
        scales: &[Reg<F32>],
        across: Across,
    ) -> Reg<F32> {
        let sigma = t.sigma.expect("σ with item scales");
        let tile = column_sigma(k, scales, across, HALF_EXPONENT - RESCALE_SLACK_BITS as u32);
        let lower = k.setp(Cmp::Lt, tile, sigma);
        let kept = k.label();
        // σ is the same in every lane: so is the branch.
        k.bra_if(lower, false, kept);
        let inverse = unscale_of(k, sigma);
        let ratio = k.mul(tile, inverse);
        for ct in 0..t.acc.len() {
            t.scale_column(k, ct, ratio);
        }
        k.assign(sigma, tile);
        k.place(kept);
        sigma
    }

    /// The words of one token's channels of the lane's group, `offset` bytes
    /// past `lane_base`: 16-byte loads when aligned; aligned words starting
    /// a known `skew` bytes before the channels when the rows' stride and
    /// the channels' offset are even (the byte permutes that pair tokens
    /// absorb the skew); else aligned words funnel-shifted into place.
    pub(super) fn value_words(
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
        if m.value_rows.stride.is_multiple_of(2) && m.value_offset().is_multiple_of(2) {
            // Token rows start at even multiples of the stride from the
            // buffer (16-aligned), lane groups at whole words of channels:
            // `lane_base` is `value_offset` past a word boundary.
            let skew = (m.value_offset() + offset) % 4;
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

    /// After the stream: every warp stores its sums (per lane group channel:
    /// the two parts of each head added, times 1/σ) to its own area of
    /// [`Plan::warp_sums`](super::super::plan::Plan::warp_sums); past a
    /// barrier, every thread adds the warps' sums of its (head, channel)s
    /// and stores the total to the accumulator array (not zeroed first:
    /// this writes every channel of the group's heads). A sum's word is its register's
    /// (lane-major: a store is one wavefront) with the lane swizzled by its
    /// channel ([`sum_swizzle`]: a warp's 32 channels of a head then read 32
    /// banks). All warps store at once: one warp per barrier would cost a
    /// third of a one-tile split's time (docs/gpu-bench.md).
    pub(super) fn store(&self, k: &mut Kernel, t: &MmaValues) {
        let plan = self.cta.plan;
        let m = plan.mma.as_ref().expect("tensor-core plan");
        let channels = m.group_channels();
        let warp_bytes = m.warp_sums_bytes();
        let sums = k.add(self.cta.smem, plan.warp_sums);
        let lane = k.mad_lo(t.lanes.row, ROW_LANES, t.lanes.quad);
        let own = k.mad_lo(t.lanes.warp, warp_bytes, sums);
        k.comment("each warp's sums into its own area");
        let unscale = t.sigma.map(|sigma| unscale_of(k, sigma));
        let per_group = channels / m.value_groups();
        for (ct, acc) in (0u32..).zip(&t.acc) {
            // The warp's zero sums of the lane's head: over its rows' tokens.
            let zero_sums: Vec<Reg<F32>> = (t.zero_sums[ct as usize].iter())
                .map(|&sum| {
                    let mut sum = sum;
                    for mask in [4, 8, 16] {
                        let other = k.shfl_bfly(sum, mask);
                        sum = k.add(sum, other);
                    }
                    sum
                })
                .collect();
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
                // Subnormal codes: their channel's power of two off.
                let sum = match m.channel.element {
                    Element::Int { bits, .. } if m.subnormal_codes() => {
                        let shift = subnormal_shift(code_shift(channel % per_group, bits), bits);
                        k.mul(sum, f32::from_bits((127 + 24 - shift) << 23))
                    }
                    _ => sum,
                };
                let sum = match zero_sums.get((channel / per_group) as usize) {
                    Some(&zeros) => k.add(sum, zeros),
                    None => sum,
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
        let acc_index = self.cta.m.value.accumulator.index();
        let acc_base = self.cta.array_base(k, acc_index);
        let acc_stride = plan.array_stride[acc_index];
        let head_channels = ROW_GROUPS * channels;
        let total = k.mul(self.cta.group, head_channels);
        self.cta
            .strided(k, self.cta.tid, Op::Reg(total), plan.threads, |k, idx| {
                let (head, channel) = divide(k, idx, head_channels);
                // A column tile's heads are its lanes' quads.
                let (ct, quad) = divide(k, head, ROW_LANES);
                let (row, group_channel) = match m.channel.groups {
                    // Channel c of row r is size · (c / n) + n · r + c % n.
                    Some(groups) => {
                        let (group, within) = divide(k, channel, groups.size);
                        let (row, c) = divide(k, within, per_group);
                        (row, k.mad_lo(group, per_group, c))
                    }
                    None => divide(k, channel, channels),
                };
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
