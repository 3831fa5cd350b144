//! Encoding one codec's items of a page (transformed vectors in, header scales
//! and packed item bits out), and the reference decoder back to coordinates.

use half::{bf16, f16};
use kvcc_compiler::back::interp::read_bits;
use kvcc_compiler::layout::{bitmap_elem_bits, coeff_max, CodecLayout, FieldLayout};
use kvcc_compiler::spec::{BitmapElem, CoeffScale, DenseDtype, RadiusScale};

use super::bits::write_bits;
use crate::math::kmeans::{best_direction, nearest};

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

/// Length of the group's projection onto its (not exactly unit, once rounded
/// to f16) codeword: the least-squares radius, never negative.
fn radius_of(x: &[f32], c: &[f32]) -> f32 {
    let dot: f32 = x.iter().zip(c).map(|(a, b)| a * b).sum();
    let norm: f32 = c.iter().map(|v| v * v).sum();
    if norm > 0.0 {
        (dot / norm).max(0.0)
    } else {
        0.0
    }
}

fn set_page_scales(
    codec: &CodecLayout,
    tables: &[Vec<f32>],
    items: &[Vec<f32>],
    codes: &[Vec<u32>],
    scales: &mut [f32],
) {
    let nonzero = |s: f32| if s > 0.0 { s } else { 1.0 };
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
                            nonzero(per_group.iter().copied().fold(0.0, f32::max));
                    }
                    RadiusScale::PageGroup => {
                        for (j, m) in per_group.iter().enumerate() {
                            scales[slot as usize + j] = nonzero(*m);
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
            } => {
                let q = coeff_max(bits) as f32;
                match scale {
                    CoeffScale::Page => {
                        let max = items.iter().flatten().fold(0.0f32, |m, v| m.max(v.abs()));
                        scales[slot as usize] = nonzero(max / q);
                    }
                    CoeffScale::PageComponent => {
                        for c in 0..count as usize {
                            let max = items.iter().fold(0.0f32, |m, x| m.max(x[c].abs()));
                            scales[slot as usize + c] = nonzero(max / q);
                        }
                    }
                    CoeffScale::Item | CoeffScale::Component => {}
                }
            }
            _ => {}
        }
    }
}

/// An f16 scale as stored (rounded, kept finite and non-zero).
fn stored_half_scale(max_abs: f32, q: f32) -> f32 {
    let s = f16::from_f32((max_abs / q).min(f16::MAX.to_f32())).to_f32();
    if s > 0.0 {
        s
    } else {
        1.0
    }
}

fn quantize(x: f32, scale: f32, bits: u32) -> u32 {
    let q = coeff_max(bits);
    let code = (x / scale).round().clamp(-(q as f32), q as f32) as i32;
    (code as u32) & ((1u32 << bits) - 1)
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
            let levels = ((1u32 << bits) - 1) as f32;
            for j in 0..groups as usize {
                let r = radius_of(&x[j * g..(j + 1) * g], codeword(codec, tables, j, codes[j]));
                let s = match scale {
                    RadiusScale::Page => scales[slot as usize],
                    RadiusScale::PageGroup => scales[slot as usize + j],
                };
                let code = (r / s * levels).round().clamp(0.0, levels) as u32;
                write_bits(item, offset + j as u32 * bits, bits, code);
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
                let s = stored_half_scale(max, coeff_max(bits) as f32);
                write_bits(item, at, 16, u32::from(f16::from_f32(s).to_bits()));
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
            let mut order: Vec<usize> = (0..groups as usize).collect();
            let energy = |j: usize| x[j * g..(j + 1) * g].iter().map(|v| v * v).sum::<f32>();
            // Largest groups first; ties keep the lower index (stable sort).
            order.sort_by(|&a, &b| energy(b).total_cmp(&energy(a)));
            let mut kept: Vec<usize> = order[..keep as usize].to_vec();
            kept.sort_unstable();
            for &j in &kept {
                write_bits(item, mask_offset + j as u32, 1, 1);
            }
            let elem_bits = bitmap_elem_bits(elem);
            let int8_scale = item_scale.map(|at| {
                let max = kept
                    .iter()
                    .flat_map(|&j| &x[j * g..(j + 1) * g])
                    .fold(0.0f32, |m, v| m.max(v.abs()));
                let s = stored_half_scale(max, 127.0);
                write_bits(item, at, 16, u32::from(f16::from_f32(s).to_bits()));
                s
            });
            for (slot, &j) in kept.iter().enumerate() {
                for t in 0..g {
                    let v = x[j * g + t];
                    let bits = match elem {
                        BitmapElem::F16 => u32::from(f16::from_f32(v).to_bits()),
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
                    DenseDtype::F16 => (u32::from(f16::from_f32(v).to_bits()), 16),
                    DenseDtype::Bf16 => (u32::from(bf16::from_f32(v).to_bits()), 16),
                    DenseDtype::F32 => (v.to_bits(), 32),
                };
                write_bits(item, offset + c as u32 * width, width, bits);
            }
        }
    }
}

fn signed(bits: u32, width: u32) -> f32 {
    let unused = 32 - width;
    (((bits << unused) as i32) >> unused) as f32
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
                        read_bits(item, offset + j as u32 * bits, bits) as f32 * s
                            / ((1u32 << bits) - 1) as f32
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
                        f16::from_bits(read_bits(item, item_scale.expect("item scale"), 16) as u16)
                            .to_f32()
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
            let scale =
                item_scale.map(|at| f16::from_bits(read_bits(item, at, 16) as u16).to_f32());
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
                            BitmapElem::F16 => f16::from_bits(raw as u16).to_f32(),
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
                    DenseDtype::F16 => f16::from_bits(raw as u16).to_f32(),
                    DenseDtype::Bf16 => bf16::from_bits(raw as u16).to_f32(),
                    DenseDtype::F32 => f32::from_bits(raw),
                };
            }
        }
        FieldLayout::Radius { .. } => unreachable!("body() is never a radius"),
    }
    x
}
