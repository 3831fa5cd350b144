//! Reading stored fields back as f32: the pieces score and accumulate share.

use crate::ir::builder::ExprBuilder;
use crate::ir::TableDecl;
use crate::ir::{BinaryOp, Expr, Handle, UnaryOp};
use crate::layout::schema::MASK_WORD_BITS;
use crate::layout::{BitRange, CodecLayout, DenseScale, FieldLayout, SlotRole};
use crate::spec::{BitmapElem, CoeffScale, DenseDtype};

use super::Tables;

/// Element `j` (a constant) of a slot: its raw bits.
pub fn slot_bits_at(b: &mut ExprBuilder, slot: BitRange, j: u32) -> Handle<Expr> {
    b.item_bits_at(slot.at(j), slot.width)
}

/// Element `j` (a u32 expression) of a slot: its raw bits.
pub fn slot_bits(b: &mut ExprBuilder, slot: BitRange, j: Handle<Expr>) -> Handle<Expr> {
    let scaled = b.mul_u32(j, slot.width);
    let at = b.add_u32(scaled, slot.offset);
    b.item_bits(at, slot.width)
}

/// Raw stored bits of a dense value as f32.
pub fn dense_value(b: &mut ExprBuilder, raw: Handle<Expr>, dtype: DenseDtype) -> Handle<Expr> {
    let op = match dtype {
        DenseDtype::F16 => UnaryOp::HalfToFloat,
        DenseDtype::Bf16 => UnaryOp::BfloatToFloat,
        DenseDtype::F32 => UnaryOp::BitsToFloat,
        DenseDtype::Fp8e4m3 | DenseDtype::Fp8e5m2 => {
            UnaryOp::Fp8ToFloat(dtype.fp8().expect("an fp8 dtype"))
        }
    };
    b.unary(op, raw)
}

/// The trained table of a dense field's scale (`tensor` or `head`), whose
/// element 0 multiplies every coordinate.
pub fn dense_table_scale(codec: &CodecLayout, tables: &Tables) -> Option<Handle<TableDecl>> {
    match *codec.body() {
        FieldLayout::Dense {
            scale: Some(DenseScale::Table(t)),
            ..
        } => Some(tables.get(t)),
        _ => None,
    }
}

/// A dense field's page or item scale (stored with the page or the item).
pub fn dense_stored_scale(b: &mut ExprBuilder, codec: &CodecLayout) -> Option<Handle<Expr>> {
    match *codec.body() {
        FieldLayout::Dense {
            scale: Some(DenseScale::Header(slot)),
            ..
        } => Some(b.header_scale_at(slot)),
        FieldLayout::Dense {
            scale: Some(DenseScale::Item(at)),
            ..
        } => {
            let raw = b.item_bits_at(at, 16);
            Some(b.unary(UnaryOp::HalfToFloat, raw))
        }
        _ => None,
    }
}

/// A coefficient code as f32: two's complement, or unsigned (zero point).
pub fn coeff_code(
    b: &mut ExprBuilder,
    raw: Handle<Expr>,
    bits: u32,
    zero_point: bool,
) -> Handle<Expr> {
    if zero_point {
        b.to_float(raw)
    } else {
        signed_value(b, raw, bits)
    }
}

/// The zero point of coordinate `c` (u32) of an asymmetric coeff field, or
/// `None` for symmetric codes.
pub fn coeff_zero(
    b: &mut ExprBuilder,
    codec: &CodecLayout,
    tables: &Tables,
    c: Handle<Expr>,
) -> Option<Handle<Expr>> {
    let FieldLayout::Coeff {
        scale,
        zero_point,
        group,
        zero_slot,
        zero_table,
        ..
    } = *codec.body()
    else {
        unreachable!("coeff_zero takes a coeff codec")
    };
    if !zero_point {
        return None;
    }
    Some(match scale {
        CoeffScale::Item | CoeffScale::Group => {
            let j = b.div_u32(c, group);
            let raw = slot_bits(b, codec.slot(SlotRole::ItemZero), j);
            b.unary(UnaryOp::HalfToFloat, raw)
        }
        CoeffScale::Page => b.header_scale_at(zero_slot),
        CoeffScale::PageComponent => {
            let at = b.add_u32(c, zero_slot);
            b.header_scale(at)
        }
        CoeffScale::Component => b.table(tables.get(zero_table.expect("component zero table")), c),
    })
}

/// Coordinate `c` (u32) of a coeff field with every scale and zero point read
/// where it is stored: `code · s (+ z)`, the zero point by one fma.
pub fn coeff_coordinate(
    b: &mut ExprBuilder,
    codec: &CodecLayout,
    tables: &Tables,
    c: Handle<Expr>,
) -> Handle<Expr> {
    let FieldLayout::Coeff {
        bits,
        scale,
        zero_point,
        table,
        ..
    } = *codec.body()
    else {
        unreachable!("coeff_coordinate takes a coeff codec")
    };
    let raw = slot_bits(b, codec.slot(SlotRole::Coefficient), c);
    let x = coeff_code(b, raw, bits, zero_point);
    let s = match scale {
        CoeffScale::Component => b.table(tables.get(table.expect("component scale table")), c),
        _ => coeff_scale(b, codec, c).expect("stored scale"),
    };
    match coeff_zero(b, codec, tables, c) {
        Some(z) => b.fma(x, s, z),
        None => b.binary(BinaryOp::Multiply, x, s),
    }
}

/// Raw `bits`-wide two's-complement bits as f32.
pub fn signed_value(b: &mut ExprBuilder, raw: Handle<Expr>, bits: u32) -> Handle<Expr> {
    let signed = b.unary(UnaryOp::SignExtend(bits as u8), raw);
    b.to_float(signed)
}

/// The codec's f16 item scale.
pub fn item_scale(b: &mut ExprBuilder, codec: &CodecLayout) -> Handle<Expr> {
    let raw = slot_bits_at(b, codec.slot(SlotRole::ItemScale), 0);
    b.unary(UnaryOp::HalfToFloat, raw)
}

/// A bitmap's kept element `t` of group slot `slot` (u32), as f32 (int8 not yet scaled).
pub fn bitmap_element(
    b: &mut ExprBuilder,
    codec: &CodecLayout,
    slot: Handle<Expr>,
    t: Handle<Expr>,
) -> Handle<Expr> {
    let FieldLayout::Bitmap {
        group_size, elem, ..
    } = *codec.body()
    else {
        unreachable!("bitmap_element takes a bitmap codec")
    };
    let first = b.mul_u32(slot, group_size);
    let index = b.add(first, t);
    let raw = slot_bits(b, codec.slot(SlotRole::BitmapElement), index);
    match elem {
        BitmapElem::F16 => dense_value(b, raw, DenseDtype::F16),
        BitmapElem::Int8 => signed_value(b, raw, 8),
        BitmapElem::Fp8e4m3 => dense_value(b, raw, DenseDtype::Fp8e4m3),
        BitmapElem::Fp8e5m2 => dense_value(b, raw, DenseDtype::Fp8e5m2),
    }
}

/// For bitmap group `group` (u32): whether it is kept, and the slot its elements
/// occupy among the kept groups (popcount of the mask below it, clamped so a
/// dropped group still addresses inside the item).
pub fn bitmap_slot(
    b: &mut ExprBuilder,
    codec: &CodecLayout,
    group: Handle<Expr>,
) -> (Handle<Expr>, Handle<Expr>) {
    let FieldLayout::Bitmap { keep, .. } = *codec.body() else {
        unreachable!("bitmap_slot takes a bitmap codec")
    };
    let word_index = b.div_u32(group, MASK_WORD_BITS);
    let bit = b.rem_u32(group, MASK_WORD_BITS);
    let mask_words: Vec<_> = codec
        .slots
        .iter()
        .find(|s| s.role == SlotRole::MaskBit)
        .expect("bitmap codecs have a mask")
        .elements()
        .map(|(at, width)| b.item_bits_at(at, width))
        .collect();
    // Multi-word masks: count the set bits of the words before this group's word,
    // and pick that word.
    let mut before = b.u32(0);
    let mut word = mask_words[0];
    for (w, &bits) in mask_words.iter().enumerate() {
        let w_literal = b.u32(w as u32);
        if w + 1 < mask_words.len() {
            let count = b.unary(UnaryOp::Popcount, bits);
            let is_before = b.binary(BinaryOp::Less, w_literal, word_index);
            let zero = b.u32(0);
            let counted = b.select(is_before, count, zero);
            before = b.add(before, counted);
        }
        if w > 0 {
            let is_this = b.binary(BinaryOp::Equal, w_literal, word_index);
            word = b.select(is_this, bits, word);
        }
    }
    let one = b.u32(1);
    let below = b.binary(BinaryOp::ShiftLeft, one, bit);
    let below = b.binary(BinaryOp::Subtract, below, one);
    let below = b.binary(BinaryOp::And, word, below);
    let within = b.unary(UnaryOp::Popcount, below);
    let prefix = b.add(before, within);
    let last = b.u32(keep - 1);
    let slot = b.binary(BinaryOp::Min, prefix, last);
    let shifted = b.binary(BinaryOp::ShiftRight, word, bit);
    let flag = b.binary(BinaryOp::And, shifted, one);
    let zero = b.u32(0);
    let kept = b.binary(BinaryOp::NotEqual, flag, zero);
    (kept, slot)
}

/// The coefficient scale factor that multiplies coordinate `c`, excluding the
/// `component` kind (folded into the query on the key side).
pub fn coeff_scale(
    b: &mut ExprBuilder,
    codec: &CodecLayout,
    c: Handle<Expr>,
) -> Option<Handle<Expr>> {
    let FieldLayout::Coeff {
        scale, slot, group, ..
    } = *codec.body()
    else {
        unreachable!("coeff_scale takes a coeff codec")
    };
    match scale {
        CoeffScale::Item => Some(item_scale(b, codec)),
        CoeffScale::Group => {
            let j = b.div_u32(c, group);
            let raw = slot_bits(b, codec.slot(SlotRole::ItemScale), j);
            Some(b.unary(UnaryOp::HalfToFloat, raw))
        }
        CoeffScale::Page => Some(b.header_scale_at(slot)),
        CoeffScale::PageComponent => {
            let at = b.add_u32(c, slot);
            Some(b.header_scale(at))
        }
        CoeffScale::Component => None,
    }
}

/// Index in the codebook table of codeword `index`'s first value for group
/// `group` (u32 values): books are `entries x group_size` values, one per group
/// or one shared by every group.
pub fn codeword_start(
    b: &mut ExprBuilder,
    field: &FieldLayout,
    group: Handle<Expr>,
    index: Handle<Expr>,
) -> Handle<Expr> {
    let FieldLayout::Codebook {
        group_size,
        per_group,
        ..
    } = *field
    else {
        unreachable!("codeword_start takes a codebook field")
    };
    let book = if per_group {
        b.mul_u32(group, field.book_len())
    } else {
        b.u32(0)
    };
    let word = b.mul_u32(index, group_size);
    b.add(book, word)
}
