//! The item schema: an item as the ordered slots its fields occupy (a bit
//! range and what it holds), and the page-header scales those fields own.
//!
//! Field kinds say here, once, which slots they take; the layout packs them
//! back to back and every reader and writer of items (lowering, the
//! encoders, the macro's generated code, the reports) walks the result.

use super::Side;
use crate::spec::{BitmapElem, CoeffScale, FieldSpec, Fp8Scale, RadiusScale};

/// Bits of an f16 scale stored inside an item.
pub const ITEM_SCALE_BITS: u32 = 16;

/// What a slot's elements hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SlotRole {
    /// Unsigned radius codes, one per group.
    RadiusCode,
    /// Codeword indices, one per group.
    CodebookIndex,
    /// Signed coefficient codes, one per coordinate.
    Coefficient,
    /// f16 scales of the item's codes: one, or one per channel group.
    ItemScale,
    /// f16 zero points of the item's codes, one per item scale.
    ItemZero,
    /// One bit per bitmap group: set when the group is kept.
    MaskBit,
    /// The kept groups' elements, in group order.
    BitmapElement,
    /// Raw f16 / bf16 / f32 coordinates.
    DenseValue,
}

impl SlotRole {
    pub fn name(self) -> &'static str {
        match self {
            SlotRole::RadiusCode => "radius codes",
            SlotRole::CodebookIndex => "codeword indices",
            SlotRole::Coefficient => "coefficients",
            SlotRole::ItemScale => "f16 item scale",
            SlotRole::ItemZero => "f16 item zero point",
            SlotRole::MaskBit => "mask bits",
            SlotRole::BitmapElement => "kept elements",
            SlotRole::DenseValue => "values",
        }
    }
}

/// `count` elements of `width` bits (1..=32), back to back from bit `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BitRange {
    pub offset: u32,
    pub width: u32,
    pub count: u32,
}

impl BitRange {
    /// First bit of element `j`.
    pub fn at(&self, j: u32) -> u32 {
        self.offset + j * self.width
    }

    /// One past the range's last bit.
    pub fn end(&self) -> u32 {
        self.at(self.count)
    }

    /// The range as runs of at most `max` bits (a multiple of `width`):
    /// `(first bit, bits)` per run.
    pub fn runs(&self, max: u32) -> impl Iterator<Item = (u32, u32)> {
        let (start, end) = (self.offset, self.end());
        (start..end)
            .step_by(max as usize)
            .map(move |at| (at, (end - at).min(max)))
    }
}

/// One slot of an item: a bit range of field `field` (index into the codec's
/// fields) with its role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemSlot {
    pub field: usize,
    pub role: SlotRole,
    pub bits: BitRange,
}

/// Bits of one mask word: a bitmap's mask is read and written 32 groups at a time.
pub const MASK_WORD_BITS: u32 = 32;

impl ItemSlot {
    /// The slot's stored elements as `(first bit, bits)`: each element, or for
    /// a mask each word of up to [`MASK_WORD_BITS`] groups.
    pub fn elements(&self) -> impl Iterator<Item = (u32, u32)> {
        let step = match self.role {
            SlotRole::MaskBit => MASK_WORD_BITS,
            _ => self.bits.width,
        };
        self.bits.runs(step)
    }

    /// How many elements [`elements`](Self::elements) yields.
    pub fn element_count(&self) -> u32 {
        match self.role {
            SlotRole::MaskBit => self.bits.count.div_ceil(MASK_WORD_BITS),
            _ => self.bits.count,
        }
    }
}

/// Slots of one field of a codec with `dims` coordinates, in item order:
/// `(role, element width, element count)`. `None` when a group size does not
/// divide `dims` (a spec error reported elsewhere). Counts are `u64` so that the
/// checker can size items of any spec without overflow.
pub fn field_slots(field: &FieldSpec, dims: u64) -> Option<Vec<(SlotRole, u32, u64)>> {
    let groups = |group_size: u32| {
        let g = u64::from(group_size);
        (g > 0 && dims.is_multiple_of(g)).then(|| dims / g)
    };
    Some(match *field {
        FieldSpec::Radius {
            group_size, bits, ..
        } => vec![(SlotRole::RadiusCode, bits, groups(group_size)?)],
        FieldSpec::Codebook {
            group_size, bits, ..
        } => vec![(SlotRole::CodebookIndex, bits, groups(group_size)?)],
        FieldSpec::Coeff {
            bits,
            scale,
            zero_point,
            group,
        } => {
            let mut slots = Vec::new();
            let scales = match scale {
                CoeffScale::Item => Some(1),
                CoeffScale::Group => Some(groups(group.unwrap_or(0))?),
                _ => None,
            };
            if let Some(n) = scales {
                slots.push((SlotRole::ItemScale, ITEM_SCALE_BITS, n));
                if zero_point {
                    slots.push((SlotRole::ItemZero, ITEM_SCALE_BITS, n));
                }
            }
            slots.push((SlotRole::Coefficient, bits, dims));
            slots
        }
        FieldSpec::Bitmap {
            group_size,
            keep,
            elem,
        } => {
            let mut slots = vec![(SlotRole::MaskBit, 1, groups(group_size)?)];
            if elem.scaled() {
                slots.push((SlotRole::ItemScale, ITEM_SCALE_BITS, 1));
            }
            let elems = u64::from(keep).saturating_mul(u64::from(group_size));
            slots.push((SlotRole::BitmapElement, bitmap_elem_bits(elem), elems));
            slots
        }
        FieldSpec::Dense { dtype, scale } => {
            let mut slots = Vec::new();
            if scale == Some(Fp8Scale::Item) {
                slots.push((SlotRole::ItemScale, ITEM_SCALE_BITS, 1));
            }
            slots.push((SlotRole::DenseValue, dtype.bits(), dims));
            slots
        }
    })
}

/// Payload bits of an item with `fields`, or `None` when a field's sizes are
/// invalid.
pub fn item_bits(fields: &[FieldSpec], dims: u64) -> Option<u64> {
    let mut total = 0u64;
    for field in fields {
        for (_, width, count) in field_slots(field, dims)? {
            total = total.saturating_add(count.saturating_mul(u64::from(width)));
        }
    }
    Some(total)
}

/// Scales a field keeps in the page header (f32 each), for `dims` coordinates.
pub fn header_scale_count(field: &FieldSpec, dims: u32) -> u32 {
    match *field {
        FieldSpec::Radius {
            group_size, scale, ..
        } => match scale {
            RadiusScale::Page => 1,
            RadiusScale::PageGroup => dims / group_size,
        },
        FieldSpec::Coeff {
            scale, zero_point, ..
        } => {
            let scales = match scale {
                CoeffScale::Page => 1,
                CoeffScale::PageComponent => dims,
                CoeffScale::Item | CoeffScale::Component | CoeffScale::Group => 0,
            };
            // Zero points follow the scales, one each.
            scales * (1 + u32::from(zero_point))
        }
        FieldSpec::Dense { scale, .. } => u32::from(scale == Some(Fp8Scale::Page)),
        FieldSpec::Codebook { .. } | FieldSpec::Bitmap { .. } => 0,
    }
}

/// Page-header scale slots `first..first + count` of field `field` of the
/// `side` codec: the scales of its `scales` slot (one, or one per group or
/// coordinate), then, for a coeff field with zero points, as many zero points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderScales {
    pub side: Side,
    pub field: usize,
    pub scales: SlotRole,
    pub first: u32,
    pub count: u32,
    /// The second half of the run holds zero points.
    pub zero_points: bool,
}

impl HeaderScales {
    /// The header slot of element `j` of the scaled slot.
    pub fn slot_of(&self, j: u32) -> u32 {
        let scales = self.count / (1 + u32::from(self.zero_points));
        if scales == 1 {
            self.first
        } else {
            self.first + j
        }
    }
}

pub fn bitmap_elem_bits(elem: BitmapElem) -> u32 {
    match elem {
        BitmapElem::F16 => 16,
        BitmapElem::Int8 | BitmapElem::Fp8e4m3 | BitmapElem::Fp8e5m2 => 8,
    }
}
