//! The accumulate's value fragments on the tensor cores: a token's code
//! words, channel pairs as f16x2 operands, integer pairs, the sums'
//! swizzle, and item scales.

use super::super::builder::{Kernel, Op, Pred, Reg, Shared, F32, U32};
use super::super::tensor_cores::{
    code_shift, subnormal_shift, Element, MmaPlan, ROW_LANES, WARP_LANES,
};

/// Lane groups (fragment rows, `lane / 4`) of a warp: each holds its
/// `channels` of a head.
pub(super) const ROW_GROUPS: u32 = WARP_LANES / ROW_LANES;

/// The XOR on the lane of group channel `c`'s sum ([`AccumulateMma::store`](super::accumulate_mma::AccumulateMma::store))
/// for `channels` per lane group: `c`'s low two bits, its others above the
/// lane bits that the rows of 32 consecutive channels take. Those 32 channels
/// then land in 32 banks (the rows' lane bits differ; the channels' XORs
/// cover each remaining bit pattern once). None unless `channels` is a
/// power of two from 4 to 32.
pub(super) fn sum_swizzle(c: u32, channels: u32) -> u32 {
    match sum_swizzle_shift(channels) {
        Some(shift) => (c & 3) | ((c >> 2) << shift),
        None => 0,
    }
}

/// [`sum_swizzle`] of a channel in a register.
pub(super) fn sum_swizzle_of(k: &mut Kernel, c: Reg<U32>, channels: u32) -> Op<U32> {
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
pub(super) fn sum_swizzle_shift(channels: u32) -> Option<u32> {
    (channels.is_power_of_two() && (4..=WARP_LANES).contains(&channels))
        .then(|| 2 + (WARP_LANES / channels).trailing_zeros())
}

/// The f16 item scale at `at` (0 where `ok` fails: rows past the tile's
/// items are not read, past the last slot they are outside the buffers).
pub(super) fn item_scale(k: &mut Kernel, at: Shared, ok: Reg<Pred>) -> Reg<F32> {
    let bits = k.mov(0u32);
    k.guarded(ok, true, |k| {
        let loaded = k.ld_shared_narrow(at, 16);
        k.assign(bits, loaded);
    });
    let half = k.low16(bits);
    k.f16_to_f32(half)
}

/// Gathered values' B fragments of one slot and column tile, whose columns
/// are (head, channel parity): from `pairs` (per token pair `(t, t + 8)`,
/// the `[hi, lo]` f16 parts of its weights), per reduction step `s` (row
/// half `s` of both pairs) and part, the weight at the half of the lane's
/// column parity and zero at the other ([`channel_pair_products`]).
pub(super) fn parity_fragments(
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

/// One token's value words: the lane group's channels start `skew` bytes
/// into the first.
pub(super) struct TokenWords {
    pub(super) words: Vec<Reg<U32>>,
    pub(super) skew: u32,
}

impl TokenWords {
    /// The word holding byte `byte` of the lane group's channels, and the
    /// byte's place in it.
    pub(super) fn byte(&self, byte: u32) -> (Reg<U32>, u32) {
        let at = byte + self.skew;
        (self.words[(at / 4) as usize], at % 4)
    }
}

/// The (token 0, token 1) f16 pair of lane-group channel `channel` from the
/// two tokens' words.
pub(super) fn token_pair(
    k: &mut Kernel,
    m: &MmaPlan,
    first: &TokenWords,
    second: &TokenWords,
    channel: u32,
) -> Reg<U32> {
    let element = m.channel.element;
    // The channel's (first) byte: f16 halves and integer bytes never
    // straddle a word, as skews are even.
    let byte = channel * element.bits() / 8;
    let ((a, i), (b, j)) = (first.byte(byte), second.byte(byte));
    match element {
        Element::Half => k.prmt(a, b, i | (i + 1) << 4 | (4 + j) << 8 | (5 + j) << 12),
        Element::Fp8(format) => {
            // The channel's byte of both tokens at bytes 0 and 1, widened.
            let x = k.prmt(a, b, i | (4 + j) << 4);
            super::score_mma::fp8_pair(k, format, x)
        }
        Element::Int { bits, signed } => {
            // The element's byte of both tokens at bytes 0 and 2.
            let x = k.prmt(a, b, i | i << 4 | (4 + j) << 8 | (4 + j) << 12);
            let shift = code_shift(channel, bits);
            int_pair(k, x, bits, signed, shift, m.subnormal_codes())
        }
    }
}

/// The products of one column tile's step with the values as stored: each
/// A register one word of a token (its two channels), where
/// [`token_pair`] pairs two tokens' halves of a channel by a byte permute
/// per register (gathered values). The reduction takes 8
/// tokens, each as (token, channel parity), and the columns are (head,
/// channel parity): a B column weighs its parity's rows, its others zero,
/// and the weights' hi and lo parts are two `mma.sync`s into the same C
/// tile. So a C tile holds four channels of one head where the (head,
/// part) columns of the other tiers need two tiles.
///
/// A step's tokens are `values` (the lane's [`StepTokens`](super::fragments::StepTokens) `t + {0, 8, e, e +
/// 8}`, channel pair words in the lane group's order); `b`: per reduction
/// step and part, the lane's B fragment ([`parity_fragments`]). Reduction
/// step `s` takes tokens `8 · s` and `8 · s + e`; M tile `i` takes the lane
/// group's channel pairs `2i` (row `g`) and `2i + 1` (row `g + 8`): C
/// register `j` of tile `i` is channel `4i + j` of the lane group's
/// channels, of head `quad`.
pub(super) fn channel_pair_products(
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

/// The exact f16 pair of the `bits`-wide integers at bits `shift..` and
/// `16 + shift..` of `x` (shift + bits ≤ 10, f16's mantissa), offset to
/// unsigned when `signed`. `subnormal` ([`MmaPlan::subnormal_codes`]): the
/// field's bits alone (moved up to [`subnormal_shift`] by one `shl`) are the
/// f16 subnormal `2^(shift − 24) · u`, one `and`. Else
/// `2^shift · u` becomes the mantissa of 1024 by one `lop3`, and one f16 op
/// takes 1024 (and the offset, and the 2^shift) off again.
pub(super) fn int_pair(
    k: &mut Kernel,
    x: Reg<U32>,
    bits: u32,
    signed: bool,
    shift: u32,
    subnormal: bool,
) -> Reg<U32> {
    const MAGIC: u32 = 0x6400_6400; // 1024.0 in both halves
    let (x, shift) = match subnormal_shift(shift, bits) {
        lifted if subnormal && lifted != shift => (k.shl(x, lifted - shift), lifted),
        _ => (x, shift),
    };
    let field = (1u32 << bits) - 1;
    let mask = (field | field << 16) << shift;
    if subnormal {
        assert!(
            !signed,
            "subnormal codes are unsigned (MmaPlan::subnormal_codes)"
        );
        return k.and(x, mask);
    }
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
    if shift > 0 {
        // (1024 + 2^shift·u) / 2^shift − (1024 / 2^shift + offset)
        let unit = 1.0 / (1u32 << shift) as f32;
        let fraction = half_bits(unit);
        let fraction = k.mov(fraction | fraction << 16);
        let minus = half_bits(-(1024.0 * unit + offset as f32));
        let minus = k.mov(minus | minus << 16);
        k.fma_f16x2(biased, fraction, minus)
    } else {
        let bias = half_bits(1024.0 + offset as f32);
        let bias = k.mov(bias | bias << 16);
        k.sub_f16x2(biased, bias)
    }
}

/// The f16 bits of `x` (exact for the small integers used here).
pub(super) fn half_bits(x: f32) -> u32 {
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
