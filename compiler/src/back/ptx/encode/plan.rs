//! How many items an encode CTA holds at once, and where its shared-memory
//! regions lie.

use crate::layout::{round_up, CodecLayout, FieldLayout, SlotRole, TierLayout};

/// Items per chunk when a page does not fit at once: chunks then start on
/// 16-byte boundaries of every stream, whatever the item stride.
pub const CHUNK_QUANTUM: u32 = 16;

/// Shared-memory regions (byte offsets from the dynamic shared base, each
/// 16-byte aligned) of the encode kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    /// Items per chunk.
    pub chunk: u32,
    /// `header_slots` f32: page maxima, then the header scales.
    pub scales: u32,
    /// `chunk * dims` f32: the chunk's transformed items.
    pub x: u32,
    /// `chunk * groups` u32: codeword indices, or bitmap kept flags.
    pub codes: u32,
    /// `chunk * groups` f32: radii, or bitmap group energies.
    pub aux: u32,
    /// `chunk * item_groups` f32: item scales (one per item, or per channel
    /// group of a coeff field).
    pub item_scales: u32,
    /// `chunk * item_groups` f32: the item scales' zero points (where a codec
    /// has them; else it aliases `item_scales` and is never used).
    pub item_zeros: u32,
    /// Item scales per item (the larger side's).
    pub item_groups: u32,
    /// The chunk's items as packed in the stream, `round16(chunk * stride)` bytes.
    pub image: u32,
    /// Total bytes.
    pub bytes: u32,
}

/// Scales a codec stores in each item: one per channel group of a coeff
/// field's group scale, else one.
pub fn item_groups(codec: &CodecLayout) -> u32 {
    match *codec.body() {
        FieldLayout::Coeff { count, group, .. } => count / group,
        _ => 1,
    }
}

/// Groups of a codec's body (codebook or bitmap), or 0.
pub fn groups(codec: &CodecLayout) -> u32 {
    match *codec.body() {
        FieldLayout::Codebook { groups, .. } | FieldLayout::Bitmap { groups, .. } => groups,
        _ => 0,
    }
}

impl Plan {
    /// Regions for chunks of `chunk` items.
    pub fn with_chunk(layout: &TierLayout, chunk: u32) -> Plan {
        let codecs = [&layout.key, &layout.value];
        let dims = codecs.iter().map(|c| c.dims).max().unwrap_or(0);
        let groups = codecs.iter().map(|c| groups(c)).max().unwrap_or(0);
        let stride = codecs.iter().map(|c| c.stride).max().unwrap_or(0);
        let item_groups = codecs.iter().map(|c| item_groups(c)).max().unwrap_or(1);
        let mut at = 0;
        let mut region = |bytes: u32| {
            let start = at;
            at += round_up(bytes.max(16), 16);
            start
        };
        let scales = region(4 * layout.header_slots);
        let x = region(4 * chunk * dims);
        let codes = region(4 * chunk * groups);
        let aux = region(4 * chunk * groups);
        let item_scales = region(4 * chunk * item_groups);
        // Only codecs with item zero points have a region for them.
        let zeros = codecs
            .iter()
            .any(|c| c.find_slot(SlotRole::ItemZero).is_some());
        let item_zeros = match zeros {
            true => region(4 * chunk * item_groups),
            false => item_scales,
        };
        let image = region(chunk * stride);
        Plan {
            chunk,
            scales,
            x,
            codes,
            aux,
            item_scales,
            item_zeros,
            item_groups,
            image,
            bytes: at,
        }
    }

    /// The whole page at once if it fits `limit` bytes, else the largest
    /// multiple of [`CHUNK_QUANTUM`] items that does; `Err(needed)` with the
    /// bytes of the smallest chunk when none fits.
    pub fn new(layout: &TierLayout, limit: u32) -> Result<Plan, u32> {
        let items = layout.items_per_page;
        let whole = Plan::with_chunk(layout, items);
        if whole.bytes <= limit {
            return Ok(whole);
        }
        let mut chunk = items / CHUNK_QUANTUM * CHUNK_QUANTUM;
        while chunk >= CHUNK_QUANTUM {
            let plan = Plan::with_chunk(layout, chunk);
            if plan.bytes <= limit {
                return Ok(plan);
            }
            chunk -= CHUNK_QUANTUM;
        }
        Err(Plan::with_chunk(layout, CHUNK_QUANTUM.min(items)).bytes)
    }
}
