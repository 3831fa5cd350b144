//! Encoding one codec's items of a page (transformed vectors in, header scales
//! and packed item bits out), and the reference decoder back to coordinates.
//!
//! The codec's encode description (`lower::encode`) says what is measured
//! and where each scale comes from; each field turns an item into the
//! element values of its slots, and the item's schema (`CodecLayout::slots`)
//! alone says where those values go.

use crate::ir::encode::{CodecEncode, FieldEncode, ItemScales, Measured, ScaleRule, Source};
use crate::layout::bits::{read_bits, write_bits};
use crate::layout::{coeff_max, CodecLayout, FieldLayout, SlotRole};
use crate::lower::encode::lower_codec;
use crate::spec::CodewordKind;

use super::ops::{
    best_direction, bitmap_decode, bitmap_encode, dense_bits, dense_value, f16_bits, f16_value,
    half_scale, half_zero_point_scale, max_abs, min_max, nearest, quantize, quantize_unsigned,
    radius_code, radius_of, radius_value, scale_or_one, signed, unsigned_value, zero_point_scale,
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
    let encode = lower_codec(codec);
    let stride = codec.stride as usize;
    let codes: Vec<Vec<u32>> = match *codec.body() {
        FieldLayout::Codebook { .. } => items
            .iter()
            .map(|x| choose_codewords(codec, tables, x))
            .collect(),
        _ => Vec::new(),
    };
    set_page_scales(&encode, codec, tables, items, &codes, header_scales);
    for (i, x) in items.iter().enumerate() {
        let item = &mut stream[i * stride..(i + 1) * stride];
        item.fill(0);
        let mut values = SlotValues::default();
        for field in &encode.fields {
            let codes = codes.get(i).map(Vec::as_slice);
            let at = (codec, tables, &*header_scales);
            encode_field(field, at, x, codes, &mut values);
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

/// Sets every page scale of the codec: each statistic over the page, by its rule.
fn set_page_scales(
    encode: &CodecEncode,
    codec: &CodecLayout,
    tables: &[Vec<f32>],
    items: &[Vec<f32>],
    codes: &[Vec<u32>],
    scales: &mut [f32],
) {
    for page in &encode.page_scales {
        let measured: Vec<Vec<f32>> = match page.of {
            Measured::Radii { .. } => items
                .iter()
                .zip(codes)
                .map(|(x, idx)| radii(codec, tables, x, idx).collect())
                .collect(),
            Measured::Coordinates { dims } => {
                items.iter().map(|x| x[..dims as usize].to_vec()).collect()
            }
        };
        for j in 0..page.slots() as usize {
            let values = || -> Box<dyn Iterator<Item = &f32>> {
                match page.each {
                    false => Box::new(measured.iter().flatten()),
                    true => Box::new(measured.iter().map(move |v| &v[j])),
                }
            };
            let at = page.slot as usize + j;
            match page.rule {
                ScaleRule::Magnitude { q } => scales[at] = scale_or_one(max_abs(values()) / q),
                ScaleRule::Range { bits, zero_slot } => {
                    let (lo, hi) = min_max(values());
                    let (s, z) = zero_point_scale(lo, hi, bits);
                    scales[at] = s;
                    scales[zero_slot as usize + j] = z;
                }
            }
        }
    }
}

/// The scale (or zero point, `zero`) that `source` gives element `i`;
/// `item` holds the item's (or its groups') scales and zero points.
fn read_source(
    source: Source,
    tables: &[Vec<f32>],
    scales: &[f32],
    item: &[(f32, f32)],
    i: usize,
    zero: bool,
) -> f32 {
    match source {
        Source::Header { slot, each } => scales[slot as usize + if each { i } else { 0 }],
        Source::Table { table, each } => tables[table][if each { i } else { 0 }],
        Source::Item { group } => {
            let (s, z) = item[i / group as usize];
            if zero {
                z
            } else {
                s
            }
        }
    }
}

/// The scale and zero point (0 for symmetric codes) of coefficient `c`.
fn coeff_factor(
    (scale, zero): (Source, Option<Source>),
    tables: &[Vec<f32>],
    scales: &[f32],
    item: &[(f32, f32)],
    c: usize,
) -> (f32, f32) {
    let s = read_source(scale, tables, scales, item, c, false);
    let z = zero.map_or(0.0, |z| read_source(z, tables, scales, item, c, true));
    (s, z)
}

/// The f16 scales and zero points an item measures for its coefficients,
/// one per group of them.
fn item_scales(item: ItemScales, bits: u32, x: &[f32]) -> Vec<(f32, f32)> {
    x.chunks(item.group as usize)
        .map(|values| match item.zero_point {
            true => {
                let (lo, hi) = min_max(values);
                half_zero_point_scale(lo, hi, bits)
            }
            false => (half_scale(max_abs(values), coeff_max(bits) as f32), 0.0),
        })
        .collect()
}

/// What one item's field stores, with the codec's layout, tables and
/// (already set) header scales `at`.
fn encode_field(
    field: &FieldEncode,
    (codec, tables, scales): (&CodecLayout, &[Vec<f32>], &[f32]),
    x: &[f32],
    codes: Option<&[u32]>,
    out: &mut SlotValues,
) {
    match *field {
        FieldEncode::Radius { bits, scale, .. } => {
            let codes = codes.expect("radius pairs with a codebook");
            let radius = radii(codec, tables, x, codes).enumerate();
            let stored = radius.map(|(j, r)| {
                let s = read_source(scale, tables, scales, &[], j, false);
                radius_code(r, s, bits)
            });
            out.set(SlotRole::RadiusCode, stored.collect());
        }
        FieldEncode::Codebook { .. } => {
            let codes = codes.expect("codebook codes chosen");
            out.set(SlotRole::CodebookIndex, codes.to_vec());
        }
        FieldEncode::Coeff {
            bits,
            item,
            scale,
            zero,
            ..
        } => {
            let measured = item.map_or(Vec::new(), |item| item_scales(item, bits, x));
            if let Some(item) = item {
                let scales = measured.iter().map(|p| f16_bits(p.0));
                out.set(SlotRole::ItemScale, scales.collect());
                if item.zero_point {
                    let zeros = measured.iter().map(|p| f16_bits(p.1));
                    out.set(SlotRole::ItemZero, zeros.collect());
                }
            }
            let quantized = x.iter().enumerate().map(|(c, &v)| {
                let (s, z) = coeff_factor((scale, zero), tables, scales, &measured, c);
                match zero {
                    Some(_) => quantize_unsigned(v, s, z, bits),
                    None => quantize(v, s, bits),
                }
            });
            out.set(SlotRole::Coefficient, quantized.collect());
        }
        FieldEncode::Bitmap {
            groups,
            group_size,
            keep,
            elem,
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
        FieldEncode::Dense {
            dtype,
            item_scale,
            divide_by,
            ..
        } => {
            let item: Vec<(f32, f32)> = item_scale
                .map(|format| {
                    let s = half_scale(max_abs(x), format.max());
                    out.set(SlotRole::ItemScale, vec![f16_bits(s)]);
                    (s, 0.0)
                })
                .into_iter()
                .collect();
            let stored = x.iter().enumerate().map(|(c, &v)| match divide_by {
                None => dense_bits(dtype, v),
                Some(by) => dense_bits(dtype, v / read_source(by, tables, scales, &item, c, false)),
            });
            out.set(SlotRole::DenseValue, stored.collect());
        }
    }
}

/// Reference decoder: the coordinates (codec dims) an item's bits stand for
/// (`encode`: the codec's description, lowered once per page).
pub fn decode_item(
    codec: &CodecLayout,
    encode: &CodecEncode,
    tables: &[Vec<f32>],
    item: &[u8],
    scales: &[f32],
) -> Vec<f32> {
    let stored = SlotValues::read(codec, item);
    let mut x = vec![0.0f32; codec.dims as usize];
    let item_scale = || f16_value(stored.get(SlotRole::ItemScale)[0]);
    let radius = encode.radius();
    match *encode.body() {
        FieldEncode::Codebook { group_size, .. } => {
            let g = group_size as usize;
            for (j, &index) in stored.get(SlotRole::CodebookIndex).iter().enumerate() {
                let r = match radius {
                    Some((bits, scale)) => {
                        let code = stored.get(SlotRole::RadiusCode)[j];
                        let s = read_source(scale, tables, scales, &[], j, false);
                        radius_value(code, s, bits)
                    }
                    None => 1.0,
                };
                for (v, c) in x[j * g..(j + 1) * g]
                    .iter_mut()
                    .zip(codeword(codec, tables, j, index))
                {
                    *v = r * c;
                }
            }
        }
        FieldEncode::Coeff {
            bits,
            item,
            scale,
            zero,
            ..
        } => {
            let measured: Vec<(f32, f32)> = match item {
                None => Vec::new(),
                Some(item) => {
                    let s = stored.get(SlotRole::ItemScale).iter();
                    let z: Vec<u32> = match item.zero_point {
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
                let (s, z) = coeff_factor((scale, zero), tables, scales, &measured, c);
                *v = match zero {
                    Some(_) => unsigned_value(code, s, z),
                    None => signed(code, bits) * s,
                };
            }
        }
        FieldEncode::Bitmap {
            group_size, elem, ..
        } => {
            let scale = if elem.scaled() { item_scale() } else { 1.0 };
            let (mask, elems) = (
                stored.get(SlotRole::MaskBit),
                stored.get(SlotRole::BitmapElement),
            );
            bitmap_decode(mask, elems, group_size as usize, elem, scale, &mut x);
        }
        FieldEncode::Dense {
            dtype,
            item_scale: measured,
            divide_by,
            ..
        } => {
            let item: Vec<(f32, f32)> = measured.map(|_| (item_scale(), 0.0)).into_iter().collect();
            for (c, (v, &raw)) in x
                .iter_mut()
                .zip(stored.get(SlotRole::DenseValue))
                .enumerate()
            {
                *v = match divide_by {
                    Some(by) => {
                        dense_value(dtype, raw) * read_source(by, tables, scales, &item, c, false)
                    }
                    None => dense_value(dtype, raw),
                };
            }
        }
        FieldEncode::Radius { .. } => unreachable!("body() is never a radius"),
    }
    x
}
