//! The item layout of a codec as constants: per field, its bit positions,
//! sizes, header slot and table (`pub mod key { pub mod codebook { ... } }`).

use kvcc_compiler::layout::{bitmap_elem_bits, FieldLayout, TierLayout};
use kvcc_compiler::spec::{CoeffScale, RadiusScale};
use proc_macro2::TokenStream;
use quote::quote;

/// `pub mod <kind> { ... }`: bit positions and sizes of one field.
pub fn field_constants(field: &FieldLayout, layout: &TierLayout) -> TokenStream {
    let table_doc = |t: usize| {
        let table = &layout.tables[t];
        format!(
            "Index of the `{}` table ({} values) in the tier's tables.",
            table.name, table.len
        )
    };
    match *field {
        FieldLayout::Radius {
            offset,
            groups,
            group_size,
            bits,
            scale,
            slot,
        } => {
            let slots = match scale {
                RadiusScale::Page => 1,
                RadiusScale::PageGroup => groups as usize,
            };
            let (groups, group_size, slot) = (groups as usize, group_size as usize, slot as usize);
            quote! {
                /// The radius field: `GROUPS` unsigned codes of `BITS` bits.
                pub mod radius {
                    /// Bit offset of the first code in the item.
                    pub const OFFSET: u32 = #offset;
                    /// Bits per code.
                    pub const BITS: u32 = #bits;
                    pub const GROUPS: usize = #groups;
                    pub const GROUP_SIZE: usize = #group_size;
                    /// First page-header scale slot of the field.
                    pub const SLOT: usize = #slot;
                    /// Header scale slots of the field (1, or one per group).
                    pub const SLOTS: usize = #slots;
                }
            }
        }
        FieldLayout::Codebook {
            offset,
            groups,
            group_size,
            bits,
            per_group,
            table,
            ..
        } => {
            let books = if per_group { groups as usize } else { 1 };
            let entries = 1usize << bits;
            let (groups, group_size) = (groups as usize, group_size as usize);
            let doc = table_doc(table);
            quote! {
                /// The codebook field: `GROUPS` indices of `BITS` bits.
                pub mod codebook {
                    /// Bit offset of the first index in the item.
                    pub const OFFSET: u32 = #offset;
                    /// Bits per index.
                    pub const BITS: u32 = #bits;
                    pub const GROUPS: usize = #groups;
                    /// Coordinates per group (codeword length).
                    pub const GROUP_SIZE: usize = #group_size;
                    /// Codewords per codebook.
                    pub const ENTRIES: usize = #entries;
                    /// Codebooks (one per group, or one shared).
                    pub const BOOKS: usize = #books;
                    #[doc = #doc]
                    pub const TABLE: usize = #table;
                }
            }
        }
        FieldLayout::Coeff {
            item_scale,
            offset,
            count,
            bits,
            slot,
            table,
            scale,
        } => {
            let count = count as usize;
            let item_scale = item_scale.map(|at| {
                quote! {
                    /// Bit offset of the item's f16 scale.
                    pub const ITEM_SCALE_OFFSET: u32 = #at;
                }
            });
            let slot = matches!(scale, CoeffScale::Page | CoeffScale::PageComponent).then(|| {
                let slot = slot as usize;
                quote! {
                    /// First page-header scale slot of the field.
                    pub const SLOT: usize = #slot;
                }
            });
            let table = table.map(|t| {
                let doc = table_doc(t);
                quote! {
                    #[doc = #doc]
                    pub const TABLE: usize = #t;
                }
            });
            quote! {
                /// The coeff field: `COUNT` signed codes of `BITS` bits.
                pub mod coeff {
                    /// Bit offset of the first code in the item.
                    pub const OFFSET: u32 = #offset;
                    /// Bits per code.
                    pub const BITS: u32 = #bits;
                    pub const COUNT: usize = #count;
                    #item_scale
                    #slot
                    #table
                }
            }
        }
        FieldLayout::Bitmap {
            mask_offset,
            groups,
            group_size,
            keep,
            elem,
            item_scale,
            elems_offset,
        } => {
            let elem_bits = bitmap_elem_bits(elem);
            let (groups, group_size, keep) = (groups as usize, group_size as usize, keep as usize);
            let item_scale = item_scale.map(|at| {
                quote! {
                    /// Bit offset of the item's f16 scale (int8 elements).
                    pub const ITEM_SCALE_OFFSET: u32 = #at;
                }
            });
            quote! {
                /// The bitmap field: a mask of `GROUPS` bits, then `KEEP` kept groups.
                pub mod bitmap {
                    /// Bit offset of the mask (bit `g` set: group `g` is kept).
                    pub const MASK_OFFSET: u32 = #mask_offset;
                    pub const GROUPS: usize = #groups;
                    /// Elements per group.
                    pub const GROUP_SIZE: usize = #group_size;
                    /// Groups stored per item.
                    pub const KEEP: usize = #keep;
                    #item_scale
                    /// Bit offset of the first kept element.
                    pub const ELEMS_OFFSET: u32 = #elems_offset;
                    /// Bits per element.
                    pub const ELEM_BITS: u32 = #elem_bits;
                }
            }
        }
        FieldLayout::Dense {
            offset,
            count,
            dtype,
        } => {
            let (count, bits) = (count as usize, dtype.bits());
            quote! {
                /// The dense field: `COUNT` values of `BITS` bits.
                pub mod dense {
                    /// Bit offset of the first value in the item.
                    pub const OFFSET: u32 = #offset;
                    /// Bits per value.
                    pub const BITS: u32 = #bits;
                    pub const COUNT: usize = #count;
                }
            }
        }
    }
}
