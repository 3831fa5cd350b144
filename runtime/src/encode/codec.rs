//! Encoding one codec's items of a page (transformed vectors in, header scales
//! and packed item bits out), and the reference decoder back to coordinates.

use kvcc_compiler::back::interp::read_bits;
use kvcc_compiler::layout::{bitmap_elem_bits, coeff_max, CodecLayout, FieldLayout};
use kvcc_compiler::spec::{BitmapElem, CoeffScale, DenseDtype, RadiusScale};

use super::bits::write_bits;
use super::ops::{
    best_direction, bf16_bits, bf16_value, coeff_scale, energy, f16_bits, f16_value, half_scale,
    keep_largest, nearest, quantize, radius_code, radius_of, radius_value, scale_or_one, signed,
};

/// Encodes `items` (each `codec.dims` transformed coordinates) into `stream`
/// (`items.len() * stride` bytes), setting this codec's slots of `header_scales`.
pub fn encode_page(
    codec: &CodecLayout,
    tables: &[Vec<f32>],
    items: &[Vec<f32>],
    header_scales: &mut [f32],
    stream: &mut [u8],
) {
    let stride = codec.stride as usize;
    let codes: Vec<Vec<u32>> = match *codec.body() {
        FieldLayout::Codebook { .. } => items
            .iter()
            .map(|x| choose_codewords(codec, tables, x))
            .collect(),
        _ => Vec::new(),
    };
    set_page_scales(codec, tables, items, &codes, header_scales);
    for (i, x) in items.iter().enumerate() {
        let item = &mut stream[i * stride..(i + 1) * stride];
        item.fill(0);
        for field in &codec.fields {
            encode_field(
                field,
                codec,
                tables,
                x,
                codes.get(i).map(Vec::as_slice),
                header_scales,
                item,
            );
        }
    }
}

/// Codeword index per group: max dot product for unit directions, nearest for vectors.
fn choose_codewords(codec: &CodecLayout, tables: &[Vec<f32>], x: &[f32]) -> Vec<u32> {
    let FieldLayout::Codebook {
        groups,
        group_size,
        bits,
        codewords,
        per_group,
        table,
        ..
    } = *codec.body()
    else {
        unreachable!("called for codebook bodies")
    };
    let g = group_size as usize;
    let book_len = (1usize << bits) * g;
    (0..groups as usize)
        .map(|j| {
            let book = if per_group {
                &tables[table][j * book_len..(j + 1) * book_len]
            } else {
                &tables[table][..book_len]
            };
            let part = &x[j * g..(j + 1) * g];
            let index = match codewords {
                kvcc_compiler::spec::CodewordKind::Direction => best_direction(book, g, part),
                kvcc_compiler::spec::CodewordKind::Vector => nearest(book, g, part),
            };
            index as u32
        })
        .collect()
}

/// The codeword a group index selects.
fn codeword<'t>(
    codec: &CodecLayout,
    tables: &'t [Vec<f32>],
    group: usize,
    index: u32,
) -> &'t [f32] {
    let FieldLayout::Codebook {
        group_size,
        bits,
        per_group,
        table,
        ..
    } = *codec.body()
    else {
        unreachable!("called for codebook bodies")
    };
    let g = group_size as usize;
    let book = if per_group {
        group * (1usize << bits) * g
    } else {
        0
    };
    let start = book + index as usize * g;
    &tables[table][start..start + g]
}

fn set_page_scales(
    codec: &CodecLayout,
    tables: &[Vec<f32>],
    items: &[Vec<f32>],
    codes: &[Vec<u32>],
    scales: &mut [f32],
) {
    for field in &codec.fields {
        match *field {
            FieldLayout::Radius {
                groups,
                group_size,
                scale,
                slot,
                ..
            } => {
                let g = group_size as usize;
                let mut per_group = vec![0.0f32; groups as usize];
                for (x, idx) in items.iter().zip(codes) {
                    for (j, max) in per_group.iter_mut().enumerate() {
                        let r =
                            radius_of(&x[j * g..(j + 1) * g], codeword(codec, tables, j, idx[j]));
                        *max = max.max(r);
                    }
                }
                match scale {
                    RadiusScale::Page => {
                        scales[slot as usize] =
                            scale_or_one(per_group.iter().copied().fold(0.0, f32::max));
                    }
                    RadiusScale::PageGroup => {
                        for (j, m) in per_group.iter().enumerate() {
                            scales[slot as usize + j] = scale_or_one(*m);
                        }
                    }
                }
            }
            FieldLayout::Coeff {
                count,
                bits,
                scale,
                slot,
                ..
            } => match scale {
                CoeffScale::Page => {
                    let max = items.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
                    scales[slot as usize] = coeff_scale(max, bits);
                }
                CoeffScale::PageComponent => {
                    for c in 0..count as usize {
                        let max = items.iter().fold(0.0f32, |m, x| m.max(x[c].abs()));
                        scales[slot as usize + c] = coeff_scale(max, bits);
                    }
                }
                CoeffScale::Item | CoeffScale::Component => {}
            },
            _ => {}
        }
    }
}

fn encode_field(
    field: &FieldLayout,
    codec: &CodecLayout,
    tables: &[Vec<f32>],
    x: &[f32],
    codes: Option<&[u32]>,
    scales: &[f32],
    item: &mut [u8],
) {
    match *field {
        FieldLayout::Radius {
            offset,
            groups,
            group_size,
            bits,
            scale,
            slot,
        } => {
            let codes = codes.expect("radius pairs with a codebook");
            let g = group_size as usize;
            for j in 0..groups as usize {
                let r = radius_of(&x[j * g..(j + 1) * g], codeword(codec, tables, j, codes[j]));
                let s = match scale {
                    RadiusScale::Page => scales[slot as usize],
                    RadiusScale::PageGroup => scales[slot as usize + j],
                };
                write_bits(
                    item,
                    offset + j as u32 * bits,
                    bits,
                    radius_code(r, s, bits),
                );
            }
        }
        FieldLayout::Codebook { offset, bits, .. } => {
            for (j, &index) in codes.expect("codebook codes chosen").iter().enumerate() {
                write_bits(item, offset + j as u32 * bits, bits, index);
            }
        }
        FieldLayout::Coeff {
            item_scale,
            offset,
            count,
            bits,
            scale,
            slot,
            table,
        } => {
            let item_s = item_scale.map(|at| {
                let max = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let s = half_scale(max, coeff_max(bits) as f32);
                write_bits(item, at, 16, f16_bits(s));
                s
            });
            for c in 0..count as usize {
                let s = match scale {
                    CoeffScale::Item => item_s.expect("item scale written"),
                    CoeffScale::Page => scales[slot as usize],
                    CoeffScale::PageComponent => scales[slot as usize + c],
                    CoeffScale::Component => tables[table.expect("component table")][c],
                };
                write_bits(
                    item,
                    offset + c as u32 * bits,
                    bits,
                    quantize(x[c], s, bits),
                );
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
            let g = group_size as usize;
            let energies: Vec<f32> = x.chunks_exact(g).map(energy).collect();
            let mut order = vec![0; groups as usize];
            let kept = keep_largest(&energies, keep as usize, &mut order);
            for &j in kept {
                write_bits(item, mask_offset + j as u32, 1, 1);
            }
            let elem_bits = bitmap_elem_bits(elem);
            let int8_scale = item_scale.map(|at| {
                let max = kept
                    .iter()
                    .flat_map(|&j| &x[j * g..(j + 1) * g])
                    .fold(0.0f32, |m, v| m.max(v.abs()));
                let s = half_scale(max, coeff_max(8) as f32);
                write_bits(item, at, 16, f16_bits(s));
                s
            });
            for (slot, &j) in kept.iter().enumerate() {
                for t in 0..g {
                    let v = x[j * g + t];
                    let bits = match elem {
                        BitmapElem::F16 => f16_bits(v),
                        BitmapElem::Int8 => quantize(v, int8_scale.expect("int8 scale"), 8),
                    };
                    write_bits(
                        item,
                        elems_offset + (slot * g + t) as u32 * elem_bits,
                        elem_bits,
                        bits,
                    );
                }
            }
        }
        FieldLayout::Dense {
            offset,
            count,
            dtype,
        } => {
            for (c, &v) in x.iter().enumerate().take(count as usize) {
                let (bits, width) = match dtype {
                    DenseDtype::F16 => (f16_bits(v), 16),
                    DenseDtype::Bf16 => (bf16_bits(v), 16),
                    DenseDtype::F32 => (v.to_bits(), 32),
                };
                write_bits(item, offset + c as u32 * width, width, bits);
            }
        }
    }
}

/// Reference decoder: the coordinates (codec dims) an item's bits stand for.
pub fn decode_item(
    codec: &CodecLayout,
    tables: &[Vec<f32>],
    item: &[u8],
    scales: &[f32],
) -> Vec<f32> {
    let n = codec.dims as usize;
    let mut x = vec![0.0f32; n];
    match *codec.body() {
        FieldLayout::Codebook {
            offset,
            groups,
            group_size,
            bits,
            ..
        } => {
            let g = group_size as usize;
            for j in 0..groups as usize {
                let index = read_bits(item, offset + j as u32 * bits, bits);
                let r = match codec.radius() {
                    Some(&FieldLayout::Radius {
                        offset,
                        bits,
                        scale,
                        slot,
                        ..
                    }) => {
                        let s = match scale {
                            RadiusScale::Page => scales[slot as usize],
                            RadiusScale::PageGroup => scales[slot as usize + j],
                        };
                        radius_value(read_bits(item, offset + j as u32 * bits, bits), s, bits)
                    }
                    _ => 1.0,
                };
                for (t, c) in codeword(codec, tables, j, index).iter().enumerate() {
                    x[j * g + t] = r * c;
                }
            }
        }
        FieldLayout::Coeff {
            item_scale,
            offset,
            count,
            bits,
            scale,
            slot,
            table,
        } => {
            for (c, value) in x.iter_mut().enumerate().take(count as usize) {
                let s = match scale {
                    CoeffScale::Item => {
                        f16_value(read_bits(item, item_scale.expect("item scale"), 16))
                    }
                    CoeffScale::Page => scales[slot as usize],
                    CoeffScale::PageComponent => scales[slot as usize + c],
                    CoeffScale::Component => tables[table.expect("component table")][c],
                };
                *value = signed(read_bits(item, offset + c as u32 * bits, bits), bits) * s;
            }
        }
        FieldLayout::Bitmap {
            mask_offset,
            groups,
            group_size,
            elem,
            item_scale,
            elems_offset,
            ..
        } => {
            let g = group_size as usize;
            let elem_bits = bitmap_elem_bits(elem);
            let scale = item_scale.map(|at| f16_value(read_bits(item, at, 16)));
            let mut slot = 0usize;
            for j in 0..groups as usize {
                if read_bits(item, mask_offset + j as u32, 1) == 1 {
                    for t in 0..g {
                        let raw = read_bits(
                            item,
                            elems_offset + (slot * g + t) as u32 * elem_bits,
                            elem_bits,
                        );
                        x[j * g + t] = match elem {
                            BitmapElem::F16 => f16_value(raw),
                            BitmapElem::Int8 => signed(raw, 8) * scale.expect("int8 scale"),
                        };
                    }
                    slot += 1;
                }
            }
        }
        FieldLayout::Dense {
            offset,
            count,
            dtype,
        } => {
            for (c, value) in x.iter_mut().enumerate().take(count as usize) {
                let width = dtype.bits();
                let raw = read_bits(item, offset + c as u32 * width, width);
                *value = match dtype {
                    DenseDtype::F16 => f16_value(raw),
                    DenseDtype::Bf16 => bf16_value(raw),
                    DenseDtype::F32 => f32::from_bits(raw),
                };
            }
        }
        FieldLayout::Radius { .. } => unreachable!("body() is never a radius"),
    }
    x
}
