//! Value codec -> per-item, per-channel accumulate and the inverse-transform epilogue.

use super::fields::{
    bitmap_element, bitmap_slot, codeword_start, coeff_coordinate, dense_stored_scale,
    dense_table_scale, dense_value, item_scale, slot_bits,
};
use super::transform::{array, elementwise, fwht, reconstruct, scaled_by_one};
use super::Tables;
use crate::ir::builder::ExprBuilder;
use crate::ir::{Arena, ArrayDecl, BinaryOp, Function, Input, Kernel, ValueProgram};
use crate::layout::{CodecLayout, FieldLayout, SlotRole, TransformLayout};
use crate::spec::RadiusScale;

pub fn lower(
    codec: &CodecLayout,
    head_dim: u32,
    arrays: &mut Arena<ArrayDecl>,
    tables: &Tables,
) -> ValueProgram {
    let n = codec.dims;
    let accumulator = array(arrays, "value.accumulator".into(), n);
    let output = array(arrays, "value.output".into(), head_dim);
    // A trained fp8 scale multiplies the accumulator once where nothing
    // transforms it; otherwise every coordinate as it is read.
    let table_scale = dense_table_scale(codec, tables);
    let epilogue_scale = table_scale.filter(|_| codec.transform == TransformLayout::Identity);
    let stages = match codec.transform {
        TransformLayout::Identity => vec![match epilogue_scale {
            Some(table) => scaled_by_one(n, accumulator, output, table),
            None => elementwise(n, accumulator, output, None),
        }],
        TransformLayout::Hadamard | TransformLayout::Srht { .. } => {
            let signs = match codec.transform {
                TransformLayout::Srht { signs, .. } => Some(tables.get(signs)),
                _ => None,
            };
            let scratch = [
                array(arrays, "value.hadamard0".into(), n),
                array(arrays, "value.hadamard1".into(), n),
            ];
            fwht(n, accumulator, output, scratch, None, signs)
        }
        TransformLayout::Pca { rank, basis, mean } => vec![reconstruct(
            head_dim,
            rank,
            tables.get(basis),
            tables.get(mean),
            accumulator,
            output,
        )],
    };
    ValueProgram {
        dims: n,
        accumulate: accumulate(codec, tables, epilogue_scale.is_none()),
        epilogue: Kernel { stages },
        accumulator,
        output,
    }
}

/// Coordinate `Input::Channel` of the stored value; `table_scale`: times a
/// dense field's trained scale too.
fn accumulate(codec: &CodecLayout, tables: &Tables, table_scale: bool) -> Function {
    let mut function = Function::default();
    let mut b = ExprBuilder::new(&mut function.exprs);
    let b = &mut b;
    let c = b.input(Input::Channel);
    let body = codec.body();
    let value = match *body {
        FieldLayout::Codebook {
            group_size, table, ..
        } => {
            let j = b.div_u32(c, group_size);
            let t = b.rem_u32(c, group_size);
            let index = slot_bits(b, codec.slot(SlotRole::CodebookIndex), j);
            let row = codeword_start(b, body, j, index);
            let at = b.add(row, t);
            let codeword = b.table(tables.get(table), at);
            match codec.radius().cloned() {
                None => codeword,
                Some(FieldLayout::Radius {
                    bits: r_bits,
                    scale,
                    slot,
                    ..
                }) => {
                    let code = slot_bits(b, codec.slot(SlotRole::RadiusCode), j);
                    let code = b.to_float(code);
                    let page_scale = match scale {
                        RadiusScale::Page => b.header_scale_at(slot),
                        RadiusScale::PageGroup => {
                            let at = b.add_u32(j, slot);
                            b.header_scale(at)
                        }
                    };
                    let unit = b.f32(1.0 / ((1u32 << r_bits) - 1) as f32);
                    let factor = b.binary(BinaryOp::Multiply, page_scale, unit);
                    let r = b.binary(BinaryOp::Multiply, code, factor);
                    b.binary(BinaryOp::Multiply, r, codeword)
                }
                Some(_) => unreachable!("radius() returns a radius"),
            }
        }
        FieldLayout::Coeff { .. } => coeff_coordinate(b, codec, tables, c),
        FieldLayout::Bitmap {
            group_size, elem, ..
        } => {
            let group = b.div_u32(c, group_size);
            let t = b.rem_u32(c, group_size);
            let (kept, slot) = bitmap_slot(b, codec, group);
            let mut e = bitmap_element(b, codec, slot, t);
            if elem.scaled() {
                let s = item_scale(b, codec);
                e = b.binary(BinaryOp::Multiply, e, s);
            }
            let zero = b.f32(0.0);
            b.select(kept, e, zero)
        }
        FieldLayout::Dense { dtype, .. } => {
            let raw = slot_bits(b, codec.slot(SlotRole::DenseValue), c);
            let x = dense_value(b, raw, dtype);
            let stored = dense_stored_scale(b, codec);
            let trained = dense_table_scale(codec, tables)
                .filter(|_| table_scale)
                .map(|t| b.table_at(t, 0));
            match stored.or(trained) {
                Some(s) => b.binary(BinaryOp::Multiply, x, s),
                None => x,
            }
        }
        FieldLayout::Radius { .. } => unreachable!("body() is never a radius"),
    };
    function.result = Some(value);
    function
}
