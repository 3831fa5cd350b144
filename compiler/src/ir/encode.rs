//! The encode description of a codec: what its page encoder measures over
//! the page, what it measures per item, and what each field stores, with
//! the source of every scale and zero point resolved. `lower::encode` builds
//! it once from the codec's layout; every encoder walks it: the reference
//! encoder (`back::interp::encode`), the JIT (`back::clif::encode`).
//!
//! Where a number comes from is said here once; how a back end computes it
//! is that back end's (`back::interp::encode::ops` defines each number).

use crate::spec::{BitmapElem, CodewordKind, DenseDtype, Fp8};

/// One codec's encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct CodecEncode {
    /// The header scales measured over the page, in field order; every one
    /// is set before any item is encoded.
    pub page_scales: Vec<PageScale>,
    /// What each field of the codec stores per item, in field order
    /// (`CodecLayout::fields`).
    pub fields: Vec<FieldEncode>,
}

impl CodecEncode {
    /// What the body field (every field but a radius) stores.
    pub fn body(&self) -> &FieldEncode {
        self.fields
            .iter()
            .find(|f| !matches!(f, FieldEncode::Radius { .. }))
            .expect("checked codecs have a body field")
    }

    /// The radius field's bits and scale, if any.
    pub fn radius(&self) -> Option<(u32, Source)> {
        self.fields.iter().find_map(|f| match *f {
            FieldEncode::Radius { bits, scale, .. } => Some((bits, scale)),
            _ => None,
        })
    }
}

/// Header scales of one field measured over the page's items: `slots`
/// consecutive slots from `slot`, one for the whole page or one per
/// component (or group).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PageScale {
    /// What is measured.
    pub of: Measured,
    /// `false`: one statistic over every component (or group) of every
    /// item; `true`: one per component (group) index over the items.
    pub each: bool,
    /// How the statistic becomes the stored scale.
    pub rule: ScaleRule,
    /// First header slot.
    pub slot: u32,
}

impl PageScale {
    /// The header slots this scale sets (its zero points apart).
    pub fn slots(&self) -> u32 {
        match self.each {
            false => 1,
            true => self.of.count(),
        }
    }
}

/// The page-wide quantity a header scale is measured on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measured {
    /// The radius of each group along its chosen codeword (`ops::radius_of`).
    Radii { groups: u32 },
    /// The codec's transformed coordinates, the first `dims` of each item.
    Coordinates { dims: u32 },
}

impl Measured {
    /// Components (groups) of one item.
    pub fn count(self) -> u32 {
        match self {
            Measured::Radii { groups } => groups,
            Measured::Coordinates { dims } => dims,
        }
    }
}

/// How a page statistic becomes a header scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleRule {
    /// `scale_or_one(max |v| / q)`: symmetric codes of largest magnitude `q`
    /// (1 for radii, which the code's levels divide later).
    Magnitude { q: f32 },
    /// `zero_point_scale(min, max, bits)`: unsigned codes with their zero
    /// points in `zero_slot..`.
    Range { bits: u32, zero_slot: u32 },
}

/// What one field stores for an item.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FieldEncode {
    /// A codeword index per group of `group_size` coordinates: the book's
    /// best direction (largest dot product) or nearest vector; first best
    /// wins.
    Codebook {
        groups: u32,
        group_size: u32,
        codewords: CodewordKind,
    },
    /// Each group's radius along its codeword as a `bits`-bit code under
    /// the scale.
    Radius {
        groups: u32,
        bits: u32,
        scale: Source,
    },
    /// `count` coefficients as `bits`-bit codes: symmetric
    /// (`ops::quantize`) under `scale`, or unsigned (`ops::quantize_unsigned`)
    /// under `scale` and `zero`.
    Coeff {
        count: u32,
        bits: u32,
        /// Scales (and zero points) the item measures and stores itself.
        item: Option<ItemScales>,
        scale: Source,
        zero: Option<Source>,
    },
    /// The `keep` groups of largest energy: mask bits and their elements.
    Bitmap {
        groups: u32,
        group_size: u32,
        keep: u32,
        elem: BitmapElem,
    },
    /// `count` coordinates stored as `dtype`, divided by `divide_by` first.
    Dense {
        count: u32,
        dtype: DenseDtype,
        /// An fp8 field's f16 item scale, measured per item.
        item_scale: Option<Fp8>,
        divide_by: Option<Source>,
    },
}

/// Where the scale (or zero point) of an element `i` (component, group) is
/// read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Header slot `slot` (`each`: `slot + i`).
    Header { slot: u32, each: bool },
    /// A trained table: element 0, or element `i` (`each`).
    Table { table: usize, each: bool },
    /// The item's own f16 scales (or zero points): one per `group` elements,
    /// element `i / group`.
    Item { group: u32 },
}

/// An item's f16 scales (and zero points) of its coefficients, one per
/// `group` of them: `ops::half_scale(max |v|, coeff_max(bits))`, or with
/// zero points `ops::half_zero_point_scale(min, max, bits)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ItemScales {
    pub group: u32,
    pub zero_point: bool,
}
