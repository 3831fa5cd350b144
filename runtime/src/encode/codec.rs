//! Encoding one codec's items of a page (transformed vectors in, header scales
//! and packed item bits out), and the reference decoder back to coordinates.
//!
//! Each field turns an item into the element values of its slots; the item's
//! schema (`CodecLayout::slots`) alone says where those values go.

use kvcc_compiler::layout::bits::{read_bits, write_bits};
use kvcc_compiler::layout::{CodecLayout, DenseScale, FieldLayout, SlotRole};
use kvcc_compiler::spec::{CodewordKind, CoeffScale, RadiusScale};

use super::ops::{
    best_direction, bitmap_decode, bitmap_encode, coeff_item_scale, coeff_scale, dense_bits,
    dense_value, f16_bits, f16_value, fp8_scale, half_scale, half_zero_point_scale, max_abs,
    min_max, nearest, quantize, quantize_unsigned, radius_code, radius_of, radius_value,
    scale_or_one, signed, unsigned_value, zero_point_scale,
};

/// The element values of one item's slots, by role (a codec has one slot per role).
#[derive(Default)]
struct SlotValues(Vec<(SlotRole, Vec<u32>)>);

impl SlotValues {
    fn set(&mut self, role: SlotRole, values: Vec<u32>) {
        self.0.push((role, values));
    }

    fn get(&self, role: SlotRole) -> &[u32] {
        self.0
            .iter()
            .find(|(r, _)| *r == role)
            .map(|(_, v)| v.as_slice())
            .unwrap_or_else(|| panic!("no values for the {} slot", role.name()))
    }

    /// Writes every slot of the schema into `item`.
    fn write(&self, codec: &CodecLayout, item: &mut [u8]) {
        for slot in &codec.slots {
            for ((at, width), &v) in slot.elements().zip(self.get(slot.role)) {
                write_bits(item, at, width, v);
            }
        }
    }

    /// Reads every slot of the schema from `item`.
    fn read(codec: &CodecLayout, item: &[u8]) -> SlotValues {
        SlotValues(
            codec
                .slots
                .iter()
                .map(|slot| {
                    let values = slot.elements().map(|(at, w)| read_bits(item, at, w));
                    (slot.role, values.collect())
                })
                .collect(),
        )
    }
}

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
        let mut values = SlotValues::default();
        for field in &codec.fields {
            let codes = codes.get(i).map(Vec::as_slice);
            encode_field(field, codec, tables, x, codes, header_scales, &mut values);
        }
        values.write(codec, item);
    }
}

/// The codebook field's book for group `j`, and its codeword length.
fn book<'t>(codec: &CodecLayout, tables: &'t [Vec<f32>], j: usize) -> (&'t [f32], usize) {
    let body = codec.body();
    let FieldLayout::Codebook {
        group_size, table, ..
    } = *body
    else {
        unreachable!("called for codebook bodies")
    };
    let start = body.codeword_at(j as u32, 0) as usize;
    let len = body.book_len() as usize;
    (&tables[table][start..start + len], group_size as usize)
}

/// Codeword index per group: max dot product for unit directions, nearest for vectors.
fn choose_codewords(codec: &CodecLayout, tables: &[Vec<f32>], x: &[f32]) -> Vec<u32> {
    let FieldLayout::Codebook {
        groups, codewords, ..
    } = *codec.body()
    else {
        unreachable!("called for codebook bodies")
    };
    (0..groups as usize)
        .map(|j| {
            let (book, g) = book(codec, tables, j);
            let part = &x[j * g..(j + 1) * g];
            let index = match codewords {
                CodewordKind::Direction => best_direction(book, g, part),
                CodewordKind::Vector => nearest(book, g, part),
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
    let (book, g) = book(codec, tables, group);
    &book[index as usize * g..(index as usize + 1) * g]
}

/// The radius of each group of `x` along its chosen codeword.
fn radii<'a>(
    codec: &'a CodecLayout,
    tables: &'a [Vec<f32>],
    x: &'a [f32],
    codes: &'a [u32],
) -> impl Iterator<Item = f32> + 'a {
    let g = x.len() / codes.len();
    codes
        .iter()
        .enumerate()
        .map(move |(j, &k)| radius_of(&x[j * g..(j + 1) * g], codeword(codec, tables, j, k)))
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
                scale,
                slot,
                ..
            } => {
                let mut per_group = vec![0.0f32; groups as usize];
                for (x, idx) in items.iter().zip(codes) {
                    for (max, r) in per_group.iter_mut().zip(radii(codec, tables, x, idx)) {
                        *max = max.max(r);
                    }
                }
                match scale {
                    RadiusScale::Page => {
                        scales[slot as usize] = scale_or_one(max_abs(&per_group));
                    }
                    RadiusScale::PageGroup => {
                        for (s, m) in scales[slot as usize..].iter_mut().zip(&per_group) {
                            *s = scale_or_one(*m);
                        }
                    }
                }
            }
            FieldLayout::Coeff {
                count,
                bits,
                scale,
                zero_point,
                slot,
                zero_slot,
                ..
            } => {
                let mut set = |j: usize, values: &mut dyn Iterator<Item = &f32>| {
                    if zero_point {
                        let (lo, hi) = min_max(values);
                        let (s, z) = zero_point_scale(lo, hi, bits);
                        scales[slot as usize + j] = s;
                        scales[zero_slot as usize + j] = z;
                    } else {
                        scales[slot as usize + j] = coeff_scale(max_abs(values), bits);
                    }
                };
                match scale {
                    CoeffScale::Page => set(0, &mut items.iter().flatten()),
                    CoeffScale::PageComponent => {
                        for c in 0..count as usize {
                            set(c, &mut items.iter().map(|x| &x[c]));
                        }
                    }
                    CoeffScale::Item | CoeffScale::Group | CoeffScale::Component => {}
                }
            }
            FieldLayout::Dense {
                dtype,
                scale: Some(DenseScale::Header(slot)),
                ..
            } => {
                let format = dtype.fp8().expect("checked: only fp8 fields have scales");
                scales[slot as usize] = fp8_scale(max_abs(items.iter().flatten()), format);
            }
            _ => {}
        }
    }
}

/// The scale that multiplies coefficient `c` of a coeff field, and its zero
/// point (0 for symmetric codes); `item` holds the item's (or its groups')
/// scales and zero points.
fn coeff_factor(
    field: &FieldLayout,
    tables: &[Vec<f32>],
    scales: &[f32],
    item: &[(f32, f32)],
    c: usize,
) -> (f32, f32) {
    let FieldLayout::Coeff {
        scale,
        zero_point,
        group,
        slot,
        zero_slot,
        table,
        zero_table,
        ..
    } = *field
    else {
        unreachable!("called for coeff fields")
    };
    // Header zero-point slots exist only with zero points.
    let header = |at: u32| if zero_point { scales[at as usize] } else { 0.0 };
    match scale {
        CoeffScale::Item | CoeffScale::Group => item[c / group as usize],
        CoeffScale::Page => (scales[slot as usize], header(zero_slot)),
        CoeffScale::PageComponent => (scales[slot as usize + c], header(zero_slot + c as u32)),
        CoeffScale::Component => (
            tables[table.expect("component table")][c],
            zero_table.map_or(0.0, |t| tables[t][c]),
        ),
    }
}

/// The item's (or its channel groups') scales and zero points of a coeff
/// field stored in the item.
fn item_scales(field: &FieldLayout, x: &[f32]) -> Vec<(f32, f32)> {
    let FieldLayout::Coeff {
        bits,
        scale,
        zero_point,
        group,
        ..
    } = *field
    else {
        unreachable!("called for coeff fields")
    };
    if !scale.in_item() {
        return Vec::new();
    }
    x.chunks(group as usize)
        .map(|values| match zero_point {
            true => {
                let (lo, hi) = min_max(values);
                half_zero_point_scale(lo, hi, bits)
            }
            false => (coeff_item_scale(values, bits), 0.0),
        })
        .collect()
}

/// The scale of a dense field's fp8 elements (1 without one).
fn dense_factor(field: &FieldLayout, tables: &[Vec<f32>], scales: &[f32], item: f32) -> f32 {
    match *field {
        FieldLayout::Dense { scale, .. } => match scale {
            None => 1.0,
            Some(DenseScale::Table(t)) => tables[t][0],
            Some(DenseScale::Header(slot)) => scales[slot as usize],
            Some(DenseScale::Item(_)) => item,
        },
        _ => unreachable!("called for dense fields"),
    }
}

/// The header scale of group `j` of a radius field.
fn radius_scale(field: &FieldLayout, scales: &[f32], j: usize) -> f32 {
    let FieldLayout::Radius { scale, slot, .. } = *field else {
        unreachable!("called for radius fields")
    };
    match scale {
        RadiusScale::Page => scales[slot as usize],
        RadiusScale::PageGroup => scales[slot as usize + j],
    }
}

fn encode_field(
    field: &FieldLayout,
    codec: &CodecLayout,
    tables: &[Vec<f32>],
    x: &[f32],
    codes: Option<&[u32]>,
    scales: &[f32],
    out: &mut SlotValues,
) {
    match *field {
        FieldLayout::Radius { bits, .. } => {
            let codes = codes.expect("radius pairs with a codebook");
            let radius = radii(codec, tables, x, codes).enumerate();
            let stored = radius.map(|(j, r)| radius_code(r, radius_scale(field, scales, j), bits));
            out.set(SlotRole::RadiusCode, stored.collect());
        }
        FieldLayout::Codebook { .. } => {
            let codes = codes.expect("codebook codes chosen");
            out.set(SlotRole::CodebookIndex, codes.to_vec());
        }
        FieldLayout::Coeff {
            bits, zero_point, ..
        } => {
            let item = item_scales(field, x);
            if !item.is_empty() {
                out.set(
                    SlotRole::ItemScale,
                    item.iter().map(|p| f16_bits(p.0)).collect(),
                );
                if zero_point {
                    out.set(
                        SlotRole::ItemZero,
                        item.iter().map(|p| f16_bits(p.1)).collect(),
                    );
                }
            }
            let quantized = x.iter().enumerate().map(|(c, &v)| {
                let (s, z) = coeff_factor(field, tables, scales, &item, c);
                match zero_point {
                    true => quantize_unsigned(v, s, z, bits),
                    false => quantize(v, s, bits),
                }
            });
            out.set(SlotRole::Coefficient, quantized.collect());
        }
        FieldLayout::Bitmap {
            groups,
            group_size,
            keep,
            elem,
            ..
        } => {
            let scratch = (
                &mut vec![0.0f32; groups as usize][..],
                &mut vec![0usize; groups as usize][..],
            );
            let mut mask = vec![0u32; groups.div_ceil(32) as usize];
            let mut elems = vec![0u32; (keep * group_size) as usize];
            let g = group_size as usize;
            if let Some(s) = bitmap_encode(x, g, elem, scratch, &mut mask, &mut elems) {
                out.set(SlotRole::ItemScale, vec![f16_bits(s)]);
            }
            out.set(SlotRole::MaskBit, mask);
            out.set(SlotRole::BitmapElement, elems);
        }
        FieldLayout::Dense { dtype, scale, .. } => {
            let item = match (scale, dtype.fp8()) {
                (Some(DenseScale::Item(_)), Some(format)) => {
                    let s = half_scale(max_abs(x), format.max());
                    out.set(SlotRole::ItemScale, vec![f16_bits(s)]);
                    s
                }
                _ => 1.0,
            };
            let stored: Vec<u32> = match scale {
                None => x.iter().map(|&v| dense_bits(dtype, v)).collect(),
                Some(_) => {
                    let s = dense_factor(field, tables, scales, item);
                    x.iter().map(|&v| dense_bits(dtype, v / s)).collect()
                }
            };
            out.set(SlotRole::DenseValue, stored);
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
    let stored = SlotValues::read(codec, item);
    let mut x = vec![0.0f32; codec.dims as usize];
    let item_scale = || f16_value(stored.get(SlotRole::ItemScale)[0]);
    match *codec.body() {
        FieldLayout::Codebook { group_size, .. } => {
            let g = group_size as usize;
            for (j, &index) in stored.get(SlotRole::CodebookIndex).iter().enumerate() {
                let r = match codec.radius() {
                    Some(radius @ &FieldLayout::Radius { bits, .. }) => {
                        let code = stored.get(SlotRole::RadiusCode)[j];
                        radius_value(code, radius_scale(radius, scales, j), bits)
                    }
                    _ => 1.0,
                };
                for (v, c) in x[j * g..(j + 1) * g]
                    .iter_mut()
                    .zip(codeword(codec, tables, j, index))
                {
                    *v = r * c;
                }
            }
        }
        ref field @ FieldLayout::Coeff {
            item_scale: at,
            bits,
            zero_point,
            ..
        } => {
            let item: Vec<(f32, f32)> = match at {
                None => Vec::new(),
                Some(_) => {
                    let s = stored.get(SlotRole::ItemScale).iter();
                    let z: Vec<u32> = match zero_point {
                        true => stored.get(SlotRole::ItemZero).to_vec(),
                        false => vec![0; s.len()],
                    };
                    s.zip(z)
                        .map(|(&s, z)| (f16_value(s), f16_value(z)))
                        .collect()
                }
            };
            for (c, (v, &code)) in x
                .iter_mut()
                .zip(stored.get(SlotRole::Coefficient))
                .enumerate()
            {
                let (s, z) = coeff_factor(field, tables, scales, &item, c);
                *v = match zero_point {
                    true => unsigned_value(code, s, z),
                    false => signed(code, bits) * s,
                };
            }
        }
        FieldLayout::Bitmap {
            group_size,
            elem,
            item_scale: at,
            ..
        } => {
            let scale = at.map_or(1.0, |_| item_scale());
            let (mask, elems) = (
                stored.get(SlotRole::MaskBit),
                stored.get(SlotRole::BitmapElement),
            );
            bitmap_decode(mask, elems, group_size as usize, elem, scale, &mut x);
        }
        ref field @ FieldLayout::Dense { dtype, scale, .. } => {
            let item = match scale {
                Some(DenseScale::Item(_)) => item_scale(),
                _ => 1.0,
            };
            let s = dense_factor(field, tables, scales, item);
            for (v, &raw) in x.iter_mut().zip(stored.get(SlotRole::DenseValue)) {
                *v = match scale {
                    Some(_) => dense_value(dtype, raw) * s,
                    None => dense_value(dtype, raw),
                };
            }
        }
        FieldLayout::Radius { .. } => unreachable!("body() is never a radius"),
    }
    x
}
