//! Key codec -> query prologue (transform, LUTs) and per-item score ⟨q, k⟩.

use super::fields::{
    bitmap_element, bitmap_slot, codeword_start, coeff_code, coeff_coordinate, coeff_scale,
    dense_stored_scale, dense_table_scale, dense_value, item_scale, signed_value, slot_bits_at,
};
use super::transform::{array, dot, dot_with_table, elementwise, fwht, project, scaled_by_one};
use super::Tables;
use crate::ir::builder::ExprBuilder;
use crate::ir::{Arena, ArrayDecl, BinaryOp, Function, Handle, Kernel, KeyProgram, Stage};
use crate::layout::{CodecLayout, FieldLayout, SlotRole, TransformLayout};
use crate::spec::{CoeffScale, RadiusScale};

/// Query-side arrays the score reads.
struct QueryArrays {
    /// The transformed query (codec dims).
    transformed: Handle<ArrayDecl>,
    /// q·μ for a PCA transform.
    bias: Option<Handle<ArrayDecl>>,
    /// LUT[j * entries + i] = ⟨q'_j, c_i⟩ for a codebook body.
    lut: Option<Handle<ArrayDecl>>,
}

pub fn lower(
    codec: &CodecLayout,
    head_dim: u32,
    query: Handle<ArrayDecl>,
    arrays: &mut Arena<ArrayDecl>,
    tables: &Tables,
) -> KeyProgram {
    let mut stages = Vec::new();
    let n = codec.dims;
    let mut bias = None;
    let transformed = match codec.transform {
        TransformLayout::Identity => query,
        TransformLayout::Hadamard | TransformLayout::Srht { .. } => {
            let signs = match codec.transform {
                TransformLayout::Srht { signs, .. } => Some(tables.get(signs)),
                _ => None,
            };
            let out = array(arrays, "key.query".into(), n);
            let scratch = [
                array(arrays, "key.hadamard0".into(), n),
                array(arrays, "key.hadamard1".into(), n),
            ];
            stages.extend(fwht(n, query, out, scratch, signs, None));
            out
        }
        TransformLayout::Pca { rank, basis, mean } => {
            let out = array(arrays, "key.query".into(), rank);
            stages.push(project(head_dim, rank, tables.get(basis), query, out));
            let b = array(arrays, "key.bias".into(), 1);
            stages.push(dot_with_table(head_dim, tables.get(mean), query, b));
            bias = Some(b);
            out
        }
    };
    let mut lut = None;
    let body = codec.body();
    let transformed = match *body {
        FieldLayout::Dense { .. } if dense_table_scale(codec, tables).is_some() => {
            // A trained fp8 scale folds into the query once.
            let scaled = array(arrays, "key.query_scaled".into(), n);
            let table = dense_table_scale(codec, tables).expect("a table scale");
            stages.push(scaled_by_one(n, transformed, scaled, table));
            scaled
        }
        FieldLayout::Coeff {
            scale: CoeffScale::Component,
            zero_point: false,
            table,
            ..
        } => {
            // Trained per-component scales fold into the query once.
            let scaled = array(arrays, "key.query_scaled".into(), n);
            stages.push(elementwise(
                n,
                transformed,
                scaled,
                table.map(|t| tables.get(t)),
            ));
            scaled
        }
        FieldLayout::Codebook {
            groups,
            group_size,
            bits,
            table,
            ..
        } => {
            let entries = 1u32 << bits;
            let out = array(arrays, "key.lut".into(), groups * entries);
            let codebook = tables.get(table);
            stages.push(Stage::build(groups * entries, |b, it| {
                let j = b.div_u32(it, entries);
                let i = b.rem_u32(it, entries);
                let row = codeword_start(b, body, j, i);
                let first = b.mul_u32(j, group_size);
                let zero = b.f32(0.0);
                let value = dot(b, zero, group_size, |b, t| {
                    let at = b.add_u32(first, t);
                    let q = b.shared(transformed, at);
                    let cat = b.add_u32(row, t);
                    (q, b.table(codebook, cat))
                });
                vec![(out, it, value)]
            }));
            lut = Some(out);
            transformed
        }
        _ => transformed,
    };
    let query_arrays = QueryArrays {
        transformed,
        bias,
        lut,
    };
    KeyProgram {
        prologue: Kernel { stages },
        score: score(codec, &query_arrays, tables),
    }
}

fn score(codec: &CodecLayout, q: &QueryArrays, tables: &Tables) -> Function {
    let mut function = Function::default();
    let mut b = ExprBuilder::new(&mut function.exprs);
    let b = &mut b;
    let zero = b.f32(0.0);
    let mut logit = match *codec.body() {
        FieldLayout::Codebook { groups, bits, .. } => {
            let lut = q.lut.expect("codebook keys build a LUT");
            let entries = 1u32 << bits;
            let radius = codec.radius().cloned();
            let indices = codec.slot(SlotRole::CodebookIndex);
            let mut acc = zero;
            for j in 0..groups {
                let index = slot_bits_at(b, indices, j);
                let at = b.add_u32(index, j * entries);
                let dot = b.shared(lut, at);
                acc = match radius {
                    None => b.binary(BinaryOp::Add, acc, dot),
                    Some(FieldLayout::Radius { scale, slot, .. }) => {
                        let code = slot_bits_at(b, codec.slot(SlotRole::RadiusCode), j);
                        let mut r = b.to_float(code);
                        if scale == RadiusScale::PageGroup {
                            let s = b.header_scale_at(slot + j);
                            r = b.binary(BinaryOp::Multiply, r, s);
                        }
                        b.fma(r, dot, acc)
                    }
                    Some(_) => unreachable!("radius() returns a radius"),
                };
            }
            if let Some(FieldLayout::Radius {
                bits, scale, slot, ..
            }) = radius
            {
                // r = code * scale / (2^bits - 1): the shared factor once per item.
                let mut factor = b.f32(1.0 / ((1u32 << bits) - 1) as f32);
                if scale == RadiusScale::Page {
                    let s = b.header_scale_at(slot);
                    factor = b.binary(BinaryOp::Multiply, factor, s);
                }
                acc = b.binary(BinaryOp::Multiply, acc, factor);
            }
            acc
        }
        FieldLayout::Coeff {
            count,
            bits,
            scale: CoeffScale::Group,
            zero_point: false,
            group,
            ..
        } => {
            // Per group: the codes' dot product with the query, times the
            // group's scale once.
            let codes = codec.slot(SlotRole::Coefficient);
            let mut acc = zero;
            for j in 0..count / group {
                let mut part = zero;
                for c in j * group..(j + 1) * group {
                    let raw = slot_bits_at(b, codes, c);
                    let x = coeff_code(b, raw, bits, false);
                    let qc = b.shared_at(q.transformed, c);
                    part = b.fma(x, qc, part);
                }
                let c = b.u32(j * group);
                let s = coeff_scale(b, codec, c).expect("group scale");
                acc = b.fma(part, s, acc);
            }
            acc
        }
        FieldLayout::Coeff {
            count,
            zero_point: true,
            ..
        } => {
            let mut acc = zero;
            for c in 0..count {
                let c_literal = b.u32(c);
                let x = coeff_coordinate(b, codec, tables, c_literal);
                let qc = b.shared_at(q.transformed, c);
                acc = b.fma(x, qc, acc);
            }
            acc
        }
        FieldLayout::Coeff {
            count, bits, scale, ..
        } => {
            let codes = codec.slot(SlotRole::Coefficient);
            let mut acc = zero;
            for c in 0..count {
                let raw = slot_bits_at(b, codes, c);
                let mut x = signed_value(b, raw, bits);
                if scale == CoeffScale::PageComponent {
                    let c_literal = b.u32(c);
                    let s = coeff_scale(b, codec, c_literal).expect("page_component scale");
                    x = b.binary(BinaryOp::Multiply, x, s);
                }
                let qc = b.shared_at(q.transformed, c);
                acc = b.fma(x, qc, acc);
            }
            if matches!(scale, CoeffScale::Item | CoeffScale::Page) {
                let any = b.u32(0);
                let s = coeff_scale(b, codec, any).expect("item or page scale");
                acc = b.binary(BinaryOp::Multiply, acc, s);
            }
            acc
        }
        FieldLayout::Bitmap {
            groups,
            group_size,
            elem,
            ..
        } => {
            let mut acc = zero;
            for j in 0..groups {
                let group = b.u32(j);
                let (kept, slot) = bitmap_slot(b, codec, group);
                let mut part = zero;
                for t in 0..group_size {
                    let t_literal = b.u32(t);
                    let e = bitmap_element(b, codec, slot, t_literal);
                    let qc = b.shared_at(q.transformed, j * group_size + t);
                    part = b.fma(e, qc, part);
                }
                let contribution = b.select(kept, part, zero);
                acc = b.binary(BinaryOp::Add, acc, contribution);
            }
            if elem.scaled() {
                let s = item_scale(b, codec);
                acc = b.binary(BinaryOp::Multiply, acc, s);
            }
            acc
        }
        FieldLayout::Dense { count, dtype, .. } => {
            let values = codec.slot(SlotRole::DenseValue);
            let mut acc = zero;
            for c in 0..count {
                let raw = slot_bits_at(b, values, c);
                let x = dense_value(b, raw, dtype);
                let qc = b.shared_at(q.transformed, c);
                acc = b.fma(x, qc, acc);
            }
            // A page or item scale multiplies the dot product once.
            match dense_stored_scale(b, codec) {
                Some(s) => b.binary(BinaryOp::Multiply, acc, s),
                None => acc,
            }
        }
        FieldLayout::Radius { .. } => unreachable!("body() is never a radius"),
    };
    if let Some(bias) = q.bias {
        let mu = b.shared_at(bias, 0);
        logit = b.binary(BinaryOp::Add, logit, mu);
    }
    function.result = Some(logit);
    function
}
