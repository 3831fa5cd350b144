//! The item layout of a codec as constants: per field, its bit positions,
//! sizes, header slot and table (`pub mod key { pub mod codebook { ... } }`).

use kvcc_compiler::layout::{bitmap_elem_bits, FieldLayout, TierLayout};
use kvcc_compiler::spec::{CoeffScale, RadiusScale};
use proc_macro2::TokenStream;
use quote::{format_ident, quote};

/// One `pub const NAME: u32 | usize` of a field module, with its doc line.
struct Const {
    name: &'static str,
    doc: Option<String>,
    value: TokenStream,
}

/// A bit offset or width (`u32`, as the layout's).
fn bits(name: &'static str, doc: &str, value: u32) -> Const {
    Const {
        name,
        doc: Some(doc.to_string()),
        value: quote!(u32 = #value),
    }
}

/// `OFFSET` and `BITS` of a run of equal elements (each a `what`).
fn run(what: &str, offset: u32, width: u32) -> [Const; 2] {
    [
        bits(
            "OFFSET",
            &format!("Bit offset of the first {what} in the item."),
            offset,
        ),
        bits("BITS", &format!("Bits per {what}."), width),
    ]
}

/// A count or index (`usize`).
fn count(name: &'static str, doc: Option<&str>, value: u32) -> Const {
    let value = value as usize;
    Const {
        name,
        doc: doc.map(str::to_string),
        value: quote!(usize = #value),
    }
}

/// `pub mod <kind> { ... }`: bit positions and sizes of one field.
pub fn field_constants(field: &FieldLayout, layout: &TierLayout) -> TokenStream {
    let table = |t: usize| {
        let table = &layout.tables[t];
        let doc = format!(
            "Index of the `{}` table ({} values) in the tier's tables.",
            table.name, table.len
        );
        Const {
            name: "TABLE",
            doc: Some(doc),
            value: quote!(usize = #t),
        }
    };
    let item_scale = |at: Option<u32>, doc: &str| at.map(|at| bits("ITEM_SCALE_OFFSET", doc, at));
    let (kind, doc, consts): (&str, &str, Vec<Const>) = match *field {
        FieldLayout::Radius {
            offset,
            groups,
            group_size,
            bits: width,
            scale,
            slot,
        } => (
            "radius",
            "The radius field: `GROUPS` unsigned codes of `BITS` bits.",
            run("code", offset, width)
                .into_iter()
                .chain([
                    count("GROUPS", None, groups),
                    count("GROUP_SIZE", None, group_size),
                    count(
                        "SLOT",
                        Some("First page-header scale slot of the field."),
                        slot,
                    ),
                    count(
                        "SLOTS",
                        Some("Header scale slots of the field (1, or one per group)."),
                        match scale {
                            RadiusScale::Page => 1,
                            RadiusScale::PageGroup => groups,
                        },
                    ),
                ])
                .collect(),
        ),
        FieldLayout::Codebook {
            offset,
            groups,
            group_size,
            bits: width,
            per_group,
            table: t,
            ..
        } => (
            "codebook",
            "The codebook field: `GROUPS` indices of `BITS` bits.",
            run("index", offset, width)
                .into_iter()
                .chain([
                    count("GROUPS", None, groups),
                    count(
                        "GROUP_SIZE",
                        Some("Coordinates per group (codeword length)."),
                        group_size,
                    ),
                    count("ENTRIES", Some("Codewords per codebook."), 1 << width),
                    count(
                        "BOOKS",
                        Some("Codebooks (one per group, or one shared)."),
                        if per_group { groups } else { 1 },
                    ),
                    table(t),
                ])
                .collect(),
        ),
        FieldLayout::Coeff {
            item_scale: at,
            item_zero,
            offset,
            count: n,
            bits: width,
            slot,
            zero_slot,
            table: t,
            zero_table,
            scale,
            zero_point,
            group,
        } => {
            let mut consts: Vec<Const> = run("code", offset, width)
                .into_iter()
                .chain([count("COUNT", None, n)])
                .collect();
            consts.extend(item_scale(at, "Bit offset of the item's first f16 scale."));
            if scale == CoeffScale::Group {
                consts.push(count("GROUP", Some("Channels per f16 item scale."), group));
            }
            if let Some(z) = item_zero {
                consts.push(bits(
                    "ITEM_ZERO_OFFSET",
                    "Bit offset of the item's first f16 zero point.",
                    z,
                ));
            }
            if matches!(scale, CoeffScale::Page | CoeffScale::PageComponent) {
                let doc = "First page-header scale slot of the field.";
                consts.push(count("SLOT", Some(doc), slot));
                if zero_point {
                    let doc = "First page-header zero-point slot of the field.";
                    consts.push(count("ZERO_SLOT", Some(doc), zero_slot));
                }
            }
            consts.extend(t.map(table));
            if let Some(z) = zero_table {
                let doc = "Index of the trained zero-point table.";
                consts.push(count("ZERO_TABLE", Some(doc), z as u32));
            }
            (
                "coeff",
                match zero_point {
                    true => {
                        "The coeff field: `COUNT` unsigned codes of `BITS` bits with zero points."
                    }
                    false => "The coeff field: `COUNT` signed codes of `BITS` bits.",
                },
                consts,
            )
        }
        FieldLayout::Bitmap {
            mask_offset,
            groups,
            group_size,
            keep,
            elem,
            item_scale: at,
            elems_offset,
        } => {
            let mut consts = vec![
                bits(
                    "MASK_OFFSET",
                    "Bit offset of the mask (bit `g` set: group `g` is kept).",
                    mask_offset,
                ),
                count("GROUPS", None, groups),
                count("GROUP_SIZE", Some("Elements per group."), group_size),
                count("KEEP", Some("Groups stored per item."), keep),
            ];
            consts.extend(item_scale(
                at,
                "Bit offset of the item's f16 scale (int8 elements).",
            ));
            consts.push(bits(
                "ELEMS_OFFSET",
                "Bit offset of the first kept element.",
                elems_offset,
            ));
            consts.push(bits(
                "ELEM_BITS",
                "Bits per element.",
                bitmap_elem_bits(elem),
            ));
            (
                "bitmap",
                "The bitmap field: a mask of `GROUPS` bits, then `KEEP` kept groups.",
                consts,
            )
        }
        FieldLayout::Dense {
            offset,
            count: n,
            dtype,
            ..
        } => (
            "dense",
            "The dense field: `COUNT` values of `BITS` bits.",
            run("value", offset, dtype.bits())
                .into_iter()
                .chain([count("COUNT", None, n)])
                .collect(),
        ),
    };
    let kind = format_ident!("{}", kind);
    let consts = consts.iter().map(|c| {
        let name = format_ident!("{}", c.name);
        let value = &c.value;
        let doc = c.doc.as_ref().map(|d| quote!(#[doc = #d]));
        quote!(#doc pub const #name: #value;)
    });
    quote! {
        #[doc = #doc]
        pub mod #kind {
            #(#consts)*
        }
    }
}
