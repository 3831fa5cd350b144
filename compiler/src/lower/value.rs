//! Value codec -> per-item, per-channel accumulate and the inverse-transform epilogue.

use super::fields::{
    bitmap_element, bitmap_slot, codeword_start, coeff_scale, dense_value, item_scale,
    signed_value, slot_bits,
};
use super::transform::{array, elementwise, fwht, reconstruct};
use super::Tables;
use crate::ir::builder::ExprBuilder;
use crate::ir::{Arena, ArrayDecl, BinaryOp, Function, Input, Kernel, ValueProgram};
use crate::layout::{CodecLayout, FieldLayout, SlotRole, TransformLayout};
use crate::spec::{BitmapElem, CoeffScale, RadiusScale};

pub fn lower(
    codec: &CodecLayout,
    head_dim: u32,
    arrays: &mut Arena<ArrayDecl>,
    tables: &Tables,
) -> ValueProgram {
    let n = codec.dims;
    let accumulator = array(arrays, "value.accumulator".into(), n);
    let output = array(arrays, "value.output".into(), head_dim);
    let stages = match codec.transform {
        TransformLayout::Identity => vec![elementwise(n, accumulator, output, None)],
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
        accumulate: accumulate(codec, tables),
        epilogue: Kernel { stages },
        accumulator,
        output,
    }
}

fn accumulate(codec: &CodecLayout, tables: &Tables) -> Function {
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
        FieldLayout::Coeff {
            bits, scale, table, ..
        } => {
            let raw = slot_bits(b, codec.slot(SlotRole::Coefficient), c);
            let x = signed_value(b, raw, bits);
            let s = match scale {
                CoeffScale::Component => {
                    b.table(tables.get(table.expect("component scale table")), c)
                }
                _ => coeff_scale(b, codec, c).expect("stored scale"),
            };
            b.binary(BinaryOp::Multiply, x, s)
        }
        FieldLayout::Bitmap {
            group_size, elem, ..
        } => {
            let group = b.div_u32(c, group_size);
            let t = b.rem_u32(c, group_size);
            let (kept, slot) = bitmap_slot(b, codec, group);
            let mut e = bitmap_element(b, codec, slot, t);
            if elem == BitmapElem::Int8 {
                let s = item_scale(b, codec);
                e = b.binary(BinaryOp::Multiply, e, s);
            }
            let zero = b.f32(0.0);
            b.select(kept, e, zero)
        }
        FieldLayout::Dense { dtype, .. } => {
            let raw = slot_bits(b, codec.slot(SlotRole::DenseValue), c);
            dense_value(b, raw, dtype)
        }
        FieldLayout::Radius { .. } => unreachable!("body() is never a radius"),
    };
    function.result = Some(value);
    function
}
