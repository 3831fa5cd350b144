//! The reference encoder: what every field of a tier stores for a vector —
//! transforms, codeword search, scales and zero points, rounding — and the
//! reference decoder back to dense vectors. It defines encoding as the
//! interpreter defines decoding; the JIT and PTX encoders and the encoders
//! `kv_format!` generates are tested byte for byte against it.
//!
//! - [`ops`]: the numbers every encoder computes, one function each.
//! - `codec`: one codec's items of a page, walking its fields and schema.
//! - [`transform`]: a codec's transform of dense vectors and its inverse.
//! - [`hadamard`], [`nearest`]: the Walsh–Hadamard transforms and the
//!   codebook searches the transforms and codebook fields use.

mod codec;
pub mod hadamard;
pub mod nearest;
pub mod ops;
pub mod transform;

use crate::layout::{Side, TierLayout};
use crate::lower::encode::lower_codec;
use crate::page::PageHeader;

/// Encodes the tokens of one kv head (`[token][head_dim]` keys and as many
/// values, finite, at most a page) into `page` (`layout.page_bytes`), with
/// this head's `tables`. Callers check the inputs (`kvcc_runtime::encode`
/// does, with errors); here they are the caller's promise.
pub fn encode_page(
    layout: &TierLayout,
    tables: &[Vec<f32>],
    keys: &[f32],
    values: &[f32],
    page: &mut [u8],
) {
    let head_dim = layout.head_dim as usize;
    let tokens = keys.len() / head_dim;
    debug_assert_eq!(values.len(), keys.len(), "as many keys as values");
    debug_assert!(tokens <= layout.items_per_page as usize, "at most a page");
    page.fill(0);
    let mut scales = vec![0.0f32; layout.header_slots as usize];
    for (side, data) in [(Side::Key, keys), (Side::Value, values)] {
        let codec = layout.codec(side);
        let items: Vec<Vec<f32>> = data
            .chunks(head_dim)
            .map(|x| transform::forward(codec.transform, tables, x))
            .collect();
        let start = layout.stream_offset(side) as usize;
        let stream = &mut page[start..start + tokens * codec.stride as usize];
        codec::encode_page(codec, tables, &items, &mut scales, stream);
    }
    PageHeader {
        tier: layout.index,
        count: tokens as u32,
        flags: 0,
        scales,
    }
    .write(layout, page);
}

/// The dense keys and values a page stands for (`[token][head_dim]` each).
/// Kernels never do this; tests and fidelity measurements do.
pub fn decode_page(layout: &TierLayout, tables: &[Vec<f32>], page: &[u8]) -> (Vec<f32>, Vec<f32>) {
    let header = PageHeader::read(layout, page).expect("a page is longer than its header");
    let mut out = [Vec::new(), Vec::new()];
    for (side, dense) in [Side::Key, Side::Value].into_iter().zip(out.iter_mut()) {
        let codec = layout.codec(side);
        let encode = lower_codec(codec);
        let stride = codec.stride as usize;
        let start = layout.stream_offset(side) as usize;
        for i in 0..header.count as usize {
            let item = &page[start + i * stride..start + (i + 1) * stride];
            let y = codec::decode_item(codec, &encode, tables, item, &header.scales);
            dense.extend(transform::inverse(
                codec.transform,
                tables,
                &y,
                layout.head_dim as usize,
            ));
        }
    }
    let [keys, values] = out;
    (keys, values)
}

/// Seeded random inputs for this module's tests.
#[cfg(test)]
pub(crate) mod test_rng {
    pub use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    pub fn seeded(seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(seed)
    }

    /// A standard normal sample (Box–Muller).
    pub fn normal(rng: &mut impl rand::Rng) -> f32 {
        let uniform = |rng: &mut dyn rand::Rng| (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let (u1, u2) = (1.0 - uniform(rng), uniform(rng));
        ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
    }

    /// A uniform index below `n`.
    pub fn below(rng: &mut impl rand::Rng, n: usize) -> usize {
        ((u128::from(rng.next_u64()) * n as u128) >> 64) as usize
    }
}
