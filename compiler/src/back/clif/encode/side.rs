//! One side's stream and header scales, walking the codec's fields and item
//! schema as `interp::encode::encode_page` does: every item
//! transformed, codewords chosen, page scales measured, then every slot
//! element of every item ORed into the zeroed page image at the bit the
//! schema gives it.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{self, types, InstBuilder};

use super::num::Ix;
use super::Scratch;
use crate::back::clif::expr::{invariant, writable, Fx};
use crate::ir::encode::{FieldEncode, Measured, ScaleRule, Source};
use crate::layout::schema::MASK_WORD_BITS;
use crate::layout::DenseScale;
use crate::layout::{
    coeff_max, CodecLayout, FieldLayout, ItemSlot, SlotRole, TierLayout, TransformLayout,
    HEADER_FIXED_BYTES,
};
use crate::lower::encode::lower_codec;
use crate::spec::{BitmapElem, CodewordKind, DenseDtype};

/// Dot products of at most this many coordinates are unrolled.
const UNROLL: u32 = 16;

/// What the generated function was handed.
pub(super) struct Args {
    pub tables: ir::Value,
    pub scratch: ir::Value,
    pub count: ir::Value,
}

/// Base addresses (i64) of the scratch regions and the page image.
struct Regions {
    x: ir::Value,
    codes: ir::Value,
    aux: ir::Value,
    keys: ir::Value,
    kept: ir::Value,
    mask: ir::Value,
    pairs: ir::Value,
    image: ir::Value,
}

/// Per-item values a field computes before its slots are written.
#[derive(Default, Clone, Copy)]
struct ItemValues {
    /// The f32 value of the item's f16 scale (scaled bitmaps, fp8 dense
    /// fields with item scales; coeff fields keep theirs in `pairs`).
    scale: Option<ir::Value>,
}

pub(super) fn encode_side(
    fx: &mut Fx,
    layout: &TierLayout,
    codec: &CodecLayout,
    input: ir::Value,
    args: &Args,
    scratch: &Scratch,
) {
    let region = |fx: &mut Fx, offset: u32| fx.row(args.scratch, Ix::K(0), 0, offset);
    let r = Regions {
        x: region(fx, scratch.x),
        codes: region(fx, scratch.codes),
        aux: region(fx, scratch.aux),
        keys: region(fx, scratch.keys),
        kept: region(fx, scratch.kept),
        mask: region(fx, scratch.mask),
        pairs: region(fx, scratch.pairs),
        image: region(fx, scratch.image),
    };
    transform(fx, layout.head_dim, codec, input, args, &r);
    if let FieldLayout::Codebook { .. } = codec.body() {
        choose_codewords(fx, codec, args, &r);
        if codec.radius().is_some() {
            radii(fx, codec, args, &r);
        }
    }
    page_scales(fx, codec, args, &r);
    pack(fx, layout, codec, args, &r);
}

/// The pointer to table `t` of the head.
fn table(fx: &mut Fx, args: &Args, t: usize) -> ir::Value {
    fx.b.ins()
        .load(types::I64, invariant(), args.tables, 8 * t as i32)
}

/// Header scale slot `slot` (+ `ix`) of the page image.
fn header_scale(fx: &mut Fx, r: &Regions, slot: u32, ix: Ix) -> (ir::Value, Ix) {
    let base = fx.row(r.image, Ix::K(0), 0, HEADER_FIXED_BYTES + 4 * slot);
    (base, ix)
}

/// `transform::forward` of every item into `x` (`count` rows of `dims`).
fn transform(
    fx: &mut Fx,
    head_dim: u32,
    codec: &CodecLayout,
    input: ir::Value,
    args: &Args,
    r: &Regions,
) {
    let dims = codec.dims;
    let tables = match codec.transform {
        TransformLayout::Srht { signs, .. } => vec![table(fx, args, signs)],
        TransformLayout::Pca { basis, mean, .. } => {
            vec![table(fx, args, basis), table(fx, args, mean)]
        }
        _ => Vec::new(),
    };
    fx.loop_to(args.count, |fx, i| {
        let src = fx.row(input, Ix::V(i), 4 * head_dim, 0);
        let dst = fx.row(r.x, Ix::V(i), 4 * dims, 0);
        match codec.transform {
            TransformLayout::Identity => copy(fx, src, dst, dims, None),
            TransformLayout::Hadamard => {
                copy(fx, src, dst, dims, None);
                fwht(fx, dst, dims);
            }
            TransformLayout::Srht { .. } => {
                copy(fx, src, dst, dims, Some(tables[0]));
                fwht(fx, dst, dims);
            }
            TransformLayout::Pca { rank, .. } => {
                let (basis, mean) = (tables[0], tables[1]);
                // Component by component: each sum keeps `pca_forward`'s
                // order (from +0, `i` ascending) in a register.
                fx.each(rank, |fx, c| {
                    let zero = fx.f32c(0.0);
                    let sum = fx.var(types::F32, zero);
                    let column = fx.row(basis, c, 4, 0);
                    fx.each(head_dim, |fx, t| {
                        let x = fx.ldf(src, t);
                        let m = fx.ldf(mean, t);
                        let centered = fx.b.ins().fsub(x, m);
                        let b = fx.ldf_scaled(column, t, 4 * rank);
                        let p = fx.b.ins().fmul(b, centered);
                        let old = fx.get(sum);
                        let new = fx.b.ins().fadd(old, p);
                        fx.set(sum, new);
                    });
                    let s = fx.get(sum);
                    fx.st(dst, c, s);
                });
            }
        }
    });
}

/// `dst[c] = src[c]` (times `signs[c]` when given).
fn copy(fx: &mut Fx, src: ir::Value, dst: ir::Value, n: u32, signs: Option<ir::Value>) {
    fx.each(n, |fx, c| {
        let v = fx.ldf(src, c);
        let v = match signs {
            Some(s) => {
                let s = fx.ldf(s, c);
                fx.b.ins().fmul(v, s)
            }
            None => v,
        };
        fx.st(dst, c, v);
    });
}

/// `hadamard::fwht_normalized` in place on the `n` floats at `x`: Sylvester
/// butterflies stage by stage, then the `1/sqrt(n)` scale.
fn fwht(fx: &mut Fx, x: ir::Value, n: u32) {
    if n <= 1 {
        return;
    }
    for stage in 0..n.trailing_zeros() {
        let h = 1u32 << stage;
        fx.each(n / 2, |fx, p| {
            let p = fx.ix(p);
            let low = fx.b.ins().band_imm_u(p, i64::from(h - 1));
            let block = fx.b.ins().ushr_imm_u(p, i64::from(stage));
            let block = fx.b.ins().ishl_imm_u(block, i64::from(stage + 1));
            let lo = Ix::V(fx.b.ins().bor(low, block));
            let hi = fx.add_ix(lo, Ix::K(h));
            let u = fx.ldf(x, lo);
            let v = fx.ldf(x, hi);
            let sum = fx.b.ins().fadd(u, v);
            let difference = fx.b.ins().fsub(u, v);
            fx.st(x, lo, sum);
            fx.st(x, hi, difference);
        });
    }
    let scale = (1.0 / f64::from(n).sqrt()) as f32;
    fx.each(n, |fx, c| {
        let v = fx.ldf(x, c);
        let k = fx.f32c(scale);
        let v = fx.b.ins().fmul(v, k);
        fx.st(x, c, v);
    });
}

/// The codebook body's table pointer at group `j`'s book.
fn book(fx: &mut Fx, body: &FieldLayout, base: ir::Value, j: Ix) -> ir::Value {
    let FieldLayout::Codebook { per_group, .. } = *body else {
        unreachable!("called for codebook bodies")
    };
    if per_group {
        fx.row(base, j, 4 * body.book_len(), 0)
    } else {
        base
    }
}

/// One codebook group `j` of item `item`: its part of the rotated row, its
/// codebook, and the item's `groups`-wide code and aux rows.
struct Group {
    j: Ix,
    part: ir::Value,
    book: ir::Value,
    codes: ir::Value,
    aux: ir::Value,
}

/// `body` per (item, codebook group).
fn each_codebook_group(
    fx: &mut Fx,
    codec: &CodecLayout,
    args: &Args,
    r: &Regions,
    body: impl FnOnce(&mut Fx, Group),
) {
    let field = codec.body();
    let FieldLayout::Codebook {
        groups,
        group_size,
        table: t,
        ..
    } = *field
    else {
        unreachable!("called for codebook bodies")
    };
    let dims = codec.dims;
    let base = table(fx, args, t);
    fx.loop_to(args.count, |fx, i| {
        let x = fx.row(r.x, Ix::V(i), 4 * dims, 0);
        let codes = fx.row(r.codes, Ix::V(i), 4 * groups, 0);
        let aux = fx.row(r.aux, Ix::V(i), 4 * groups, 0);
        fx.each(groups, |fx, j| {
            let part = fx.row(x, j, 4 * group_size, 0);
            let book = book(fx, field, base, j);
            body(
                fx,
                Group {
                    j,
                    part,
                    book,
                    codes,
                    aux,
                },
            );
        });
    });
}

/// `codes[i][j]`: `kmeans::best_direction` or `nearest` per (item, group):
/// scores from 0 in coordinate order, the first strictly better wins.
fn choose_codewords(fx: &mut Fx, codec: &CodecLayout, args: &Args, r: &Regions) {
    let FieldLayout::Codebook {
        group_size: g,
        bits,
        codewords,
        ..
    } = *codec.body()
    else {
        unreachable!("called for codebook bodies")
    };
    each_codebook_group(fx, codec, args, r, |fx, group| {
        let Group {
            j,
            part,
            book,
            codes,
            ..
        } = group;
        let worst = match codewords {
            CodewordKind::Direction => f32::NEG_INFINITY,
            CodewordKind::Vector => f32::INFINITY,
        };
        let worst = fx.f32c(worst);
        let zero = fx.i32c(0);
        let best = fx.var(types::F32, worst);
        let index = fx.var(types::I32, zero);
        fx.each(1 << bits, |fx, k| {
            let word = fx.row(book, k, 4 * g, 0);
            let init = fx.f32c(0.0);
            let score = fx.var(types::F32, init);
            fx.each_unrolled(g, UNROLL, |fx, c| {
                let a = fx.ldf(part, c);
                let b = fx.ldf(word, c);
                let s = fx.get(score);
                let s = match codewords {
                    CodewordKind::Direction => {
                        let p = fx.b.ins().fmul(a, b);
                        fx.b.ins().fadd(s, p)
                    }
                    CodewordKind::Vector => {
                        let d = fx.b.ins().fsub(a, b);
                        let p = fx.b.ins().fmul(d, d);
                        fx.b.ins().fadd(s, p)
                    }
                };
                fx.set(score, s);
            });
            let s = fx.get(score);
            let old = fx.get(best);
            let cc = match codewords {
                CodewordKind::Direction => FloatCC::GreaterThan,
                CodewordKind::Vector => FloatCC::LessThan,
            };
            let win = fx.b.ins().fcmp(cc, s, old);
            let new = fx.b.ins().select(win, s, old);
            fx.set(best, new);
            let k = fx.ix(k);
            let old = fx.get(index);
            let new = fx.b.ins().select(win, k, old);
            fx.set(index, new);
        });
        let index = fx.get(index);
        fx.st(codes, j, index);
    });
}

/// `aux[i][j]`: `ops::radius_of` each group along its chosen codeword.
fn radii(fx: &mut Fx, codec: &CodecLayout, args: &Args, r: &Regions) {
    let FieldLayout::Codebook { group_size: g, .. } = *codec.body() else {
        unreachable!("called for codebook bodies")
    };
    each_codebook_group(fx, codec, args, r, |fx, group| {
        let Group {
            j,
            part,
            book,
            codes,
            aux,
        } = group;
        let k = fx.ldi(codes, j);
        let word = fx.row(book, Ix::V(k), 4 * g, 0);
        // Rust's `Sum` starts from -0.0.
        let init = fx.f32c(-0.0);
        let dot = fx.var(types::F32, init);
        let norm = fx.var(types::F32, init);
        fx.each_unrolled(g, UNROLL, |fx, c| {
            let a = fx.ldf(part, c);
            let b = fx.ldf(word, c);
            let p = fx.b.ins().fmul(a, b);
            let s = fx.get(dot);
            let s = fx.b.ins().fadd(s, p);
            fx.set(dot, s);
            let q = fx.b.ins().fmul(b, b);
            let s = fx.get(norm);
            let s = fx.b.ins().fadd(s, q);
            fx.set(norm, s);
        });
        let (dot, norm) = (fx.get(dot), fx.get(norm));
        let zero = fx.f32c(0.0);
        let ratio = fx.b.ins().fdiv(dot, norm);
        let ratio = fx.rust_max(ratio, zero);
        let positive = fx.b.ins().fcmp(FloatCC::GreaterThan, norm, zero);
        let radius = fx.b.ins().select(positive, ratio, zero);
        fx.st(aux, j, radius);
    });
}

/// The codec's page scales (`CodecEncode::page_scales`): each statistic over
/// the page's radii or coordinates, turned into its header slots by its rule.
fn page_scales(fx: &mut Fx, codec: &CodecLayout, args: &Args, r: &Regions) {
    for page in &lower_codec(codec).page_scales {
        let (base, row) = match page.of {
            Measured::Radii { groups } => (r.aux, 4 * groups),
            Measured::Coordinates { .. } => (r.x, 4 * codec.dims),
        };
        let n = page.of.count();
        // The statistic of component `j` (`None`: of every component) into slot index `at`.
        let set = |fx: &mut Fx, j: Option<Ix>, at: Ix| match page.rule {
            ScaleRule::Magnitude { q } => {
                let zero = fx.f32c(0.0);
                let max = fx.var(types::F32, zero);
                each_measured(fx, args, (base, row, n), j, |fx, v| {
                    let a = fx.b.ins().fabs(v);
                    let m = fx.get(max);
                    let m = fx.rust_max(m, a);
                    fx.set(max, m);
                });
                let m = fx.get(max);
                let m = match q {
                    1.0 => m,
                    q => {
                        let q = fx.f32c(q);
                        fx.b.ins().fdiv(m, q)
                    }
                };
                let s = fx.scale_or_one(m);
                let (base, ix) = header_scale(fx, r, page.slot, at);
                fx.st(base, ix, s);
            }
            ScaleRule::Range { bits, zero_slot } => {
                // `min_max` (total order) then `zero_point_scale`.
                let range = MinMax::new(fx);
                each_measured(fx, args, (base, row, n), j, |fx, v| range.add(fx, v));
                let (lo, hi) = range.finish(fx);
                let (s, z) = fx.zero_point_scale(lo, hi, bits);
                let (base, ix) = header_scale(fx, r, page.slot, at);
                fx.st(base, ix, s);
                let (base, ix) = header_scale(fx, r, zero_slot, at);
                fx.st(base, ix, z);
            }
        };
        match page.each {
            false => set(fx, None, Ix::K(0)),
            true => fx.each(n, |fx, j| set(fx, Some(j), j)),
        }
    }
}

/// Calls `f` on component `j` (`None`: on each of the first `n`) of every
/// item's row of `row` bytes from `base`.
fn each_measured(
    fx: &mut Fx,
    args: &Args,
    (base, row, n): (ir::Value, u32, u32),
    j: Option<Ix>,
    mut f: impl FnMut(&mut Fx, ir::Value),
) {
    fx.loop_to(args.count, |fx, i| {
        let at = fx.row(base, Ix::V(i), row, 0);
        match j {
            Some(j) => {
                let v = fx.ldf(at, j);
                f(fx, v);
            }
            None => fx.each(n, |fx, c| {
                let v = fx.ldf(at, c);
                f(fx, v);
            }),
        }
    });
}

/// Every item's slots, in schema order, ORed into the image.
fn pack(fx: &mut Fx, layout: &TierLayout, codec: &CodecLayout, args: &Args, r: &Regions) {
    let dims = codec.dims;
    let groups = super::groups(codec);
    let stream = layout.stream_offset(codec.side);
    let encode = lower_codec(codec);
    fx.loop_to(args.count, |fx, i| {
        let x = fx.row(r.x, Ix::V(i), 4 * dims, 0);
        let item = fx.row(r.image, Ix::V(i), codec.stride, stream);
        let codes = fx.row(r.codes, Ix::V(i), 4 * groups, 0);
        let aux = fx.row(r.aux, Ix::V(i), 4 * groups, 0);
        let values: Vec<ItemValues> = codec
            .fields
            .iter()
            .map(|field| prepare(fx, field, x, r))
            .collect();
        for slot in &codec.slots {
            let field = &codec.fields[slot.field];
            let item_scale = values[slot.field].scale;
            let at = Slot { item, slot };
            match slot.role {
                SlotRole::RadiusCode => {
                    let FieldEncode::Radius {
                        groups,
                        bits,
                        scale,
                    } = encode.fields[slot.field]
                    else {
                        unreachable!("radius codes belong to radius fields")
                    };
                    fx.each(groups, |fx, j| {
                        let radius = fx.ldf(aux, j);
                        let s = source_value(fx, args, r, scale, j, false);
                        let code = fx.radius_code(radius, s, bits);
                        at.put(fx, j, code);
                    });
                }
                SlotRole::CodebookIndex => fx.each(slot.bits.count, |fx, j| {
                    let code = fx.ldi(codes, j);
                    at.put(fx, j, code);
                }),
                SlotRole::Coefficient => {
                    let FieldEncode::Coeff {
                        count,
                        bits,
                        scale,
                        zero,
                        ..
                    } = encode.fields[slot.field]
                    else {
                        unreachable!("coefficients belong to coeff fields")
                    };
                    fx.each(count, |fx, c| {
                        let factor = source_value(fx, args, r, scale, c, false);
                        let v = fx.ldf(x, c);
                        let code = match zero {
                            Some(zero) => {
                                let zero = source_value(fx, args, r, zero, c, true);
                                fx.quantize_unsigned(v, factor, zero, bits)
                            }
                            None => fx.quantize(v, factor, bits),
                        };
                        at.put(fx, c, code);
                    });
                }
                SlotRole::ItemScale | SlotRole::ItemZero
                    if matches!(field, FieldLayout::Coeff { .. }) =>
                {
                    // The f16 (scale, zero) pairs `prepare` left in `pairs`:
                    // f16 values, so `f16_bits` gives their bits back.
                    let half = u32::from(slot.role == SlotRole::ItemZero);
                    fx.each(slot.element_count(), |fx, k| {
                        let at_pair = fx.affine(k, 2, half);
                        let v = fx.ldf(r.pairs, at_pair);
                        let bits = fx.f16_bits(v);
                        at.put(fx, k, bits);
                    });
                }
                SlotRole::ItemScale => {
                    let s = item_scale.expect("item scale computed");
                    let bits = fx.f16_bits(s);
                    at.put(fx, Ix::K(0), bits);
                }
                SlotRole::ItemZero => unreachable!("item zero points belong to coeff fields"),
                SlotRole::MaskBit => {
                    fx.each(slot.element_count(), |fx, w| {
                        let word = fx.ldi(r.mask, w);
                        at.put(fx, w, word);
                    });
                }
                SlotRole::BitmapElement => {
                    let FieldLayout::Bitmap {
                        group_size: g,
                        keep,
                        elem,
                        ..
                    } = *field
                    else {
                        unreachable!("kept elements belong to bitmap fields")
                    };
                    fx.each(keep, |fx, e| {
                        let j = fx.ldi(r.kept, e);
                        let group = fx.row(x, Ix::V(j), 4 * g, 0);
                        let first = fx.affine(e, g, 0);
                        fx.each_unrolled(g, UNROLL, |fx, t| {
                            let v = fx.ldf(group, t);
                            let stored = match (elem, elem.fp8()) {
                                (BitmapElem::F16, _) => fx.f16_bits(v),
                                (_, Some(format)) => {
                                    let s = item_scale.expect("fp8 scale computed");
                                    let v = fx.b.ins().fdiv(v, s);
                                    fx.fp8_encode(format, v)
                                }
                                (_, None) => {
                                    let s = item_scale.expect("int8 scale computed");
                                    fx.quantize(v, s, 8)
                                }
                            };
                            let n = fx.add_ix(first, t);
                            at.put(fx, n, stored);
                        });
                    });
                }
                SlotRole::DenseValue => {
                    let FieldEncode::Dense {
                        count,
                        dtype,
                        divide_by,
                        ..
                    } = encode.fields[slot.field]
                    else {
                        unreachable!("values belong to dense fields")
                    };
                    // One factor per field (`Source::Item` of a dense field
                    // is the item's one scale): values are divided by it.
                    let factor = divide_by.map(|by| source_value(fx, args, r, by, Ix::K(0), false));
                    fx.each(count, |fx, c| {
                        let v = fx.ldf(x, c);
                        let v = match factor {
                            Some(s) => fx.b.ins().fdiv(v, s),
                            None => v,
                        };
                        let stored = match dtype {
                            DenseDtype::F16 => fx.f16_bits(v),
                            DenseDtype::Bf16 => fx.bf16_bits(v),
                            DenseDtype::F32 => fx.float_bits(v),
                            DenseDtype::Fp8e4m3 => fx.fp8_encode(crate::spec::Fp8::E4m3, v),
                            DenseDtype::Fp8e5m2 => fx.fp8_encode(crate::spec::Fp8::E5m2, v),
                        };
                        at.put(fx, c, stored);
                    });
                }
            }
        }
    });
}

/// The scale (or, `zero`, the zero point) that `source` gives element `i`:
/// a header slot, a table entry, or the item's (scale, zero) pairs that
/// `prepare` left in `pairs`.
fn source_value(
    fx: &mut Fx,
    args: &Args,
    r: &Regions,
    source: Source,
    i: Ix,
    zero: bool,
) -> ir::Value {
    let each = |each: bool| if each { i } else { Ix::K(0) };
    match source {
        Source::Header { slot, each: e } => {
            let (base, ix) = header_scale(fx, r, slot, each(e));
            fx.ldf(base, ix)
        }
        Source::Table { table: t, each: e } => {
            let t = table(fx, args, t);
            fx.ldf(t, each(e))
        }
        Source::Item { group } => {
            let k = match i {
                Ix::K(c) => Ix::K(c / group),
                Ix::V(c) => Ix::V(fx.b.ins().udiv_imm_u(c, i64::from(group))),
            };
            let at = fx.affine(k, 2, u32::from(zero));
            fx.ldf(r.pairs, at)
        }
    }
}

/// What a field needs per item before its slots are written: the f16 item
/// scale of coeff fields (`ops::coeff_item_scale`); for bitmaps, the kept
/// groups (`kept`, ascending), the mask words and the int8 scale
/// (`ops::bitmap_encode`).
fn prepare(fx: &mut Fx, field: &FieldLayout, x: ir::Value, r: &Regions) -> ItemValues {
    match *field {
        FieldLayout::Coeff {
            count,
            bits,
            scale,
            zero_point,
            group,
            ..
        } if scale.in_item() => {
            // `codec::item_scales`: one (scale, zero) per chunk of `group`.
            fx.each(count / group, |fx, k| {
                let chunk = fx.row(x, k, 4 * group, 0);
                let (s, z) = if zero_point {
                    let range = MinMax::new(fx);
                    fx.each(group, |fx, t| {
                        let v = fx.ldf(chunk, t);
                        range.add(fx, v);
                    });
                    let (lo, hi) = range.finish(fx);
                    fx.half_zero_point_scale(lo, hi, bits)
                } else {
                    let max = max_abs(fx, chunk, group);
                    let s = fx.half_scale(max, coeff_max(bits) as f32);
                    (s, fx.f32c(0.0))
                };
                let at = fx.affine(k, 2, 0);
                fx.st(r.pairs, at, s);
                let at = fx.affine(k, 2, 1);
                fx.st(r.pairs, at, z);
            });
            ItemValues::default()
        }
        FieldLayout::Dense {
            count,
            dtype,
            scale: Some(DenseScale::Item(_)),
            ..
        } => ItemValues {
            // Also pair 0, where `Source::Item` reads the item's scale.
            scale: dtype.fp8().map(|format| {
                let max = max_abs(fx, x, count);
                let s = fx.half_scale(max, format.max());
                fx.st(r.pairs, Ix::K(0), s);
                s
            }),
        },
        FieldLayout::Bitmap {
            groups,
            group_size: g,
            keep,
            elem,
            ..
        } => {
            // Energies as total-order keys.
            fx.each(groups, |fx, j| {
                let group = fx.row(x, j, 4 * g, 0);
                let init = fx.f32c(-0.0);
                let energy = fx.var(types::F32, init);
                fx.each_unrolled(g, UNROLL, |fx, t| {
                    let v = fx.ldf(group, t);
                    let sq = fx.b.ins().fmul(v, v);
                    let e = fx.get(energy);
                    let e = fx.b.ins().fadd(e, sq);
                    fx.set(energy, e);
                });
                let e = fx.get(energy);
                let key = fx.total_key(e);
                fx.st(r.keys, j, key);
            });
            let zero = fx.i32c(0);
            fx.each(groups.div_ceil(MASK_WORD_BITS), |fx, w| {
                fx.st(r.mask, w, zero)
            });
            // Group j is kept when fewer than `keep` groups rank before it
            // (larger energy, then lower index): the kept set of a stable
            // descending sort, as `ops::keep_largest`.
            let kept = fx.var(types::I32, zero);
            fx.each(groups, |fx, j| {
                let key = fx.ldi(r.keys, j);
                let zero = fx.i32c(0);
                let rank = fx.var(types::I32, zero);
                let jv = fx.ix(j);
                fx.each(groups, |fx, k| {
                    let other = fx.ldi(r.keys, k);
                    let kv = fx.ix(k);
                    let larger = fx.b.ins().icmp(IntCC::SignedGreaterThan, other, key);
                    let equal = fx.b.ins().icmp(IntCC::Equal, other, key);
                    let lower = fx.b.ins().icmp(IntCC::UnsignedLessThan, kv, jv);
                    let tie = fx.b.ins().band(equal, lower);
                    let before = fx.b.ins().bor(larger, tie);
                    let before = fx.b.ins().uextend(types::I32, before);
                    let n = fx.get(rank);
                    let n = fx.b.ins().iadd(n, before);
                    fx.set(rank, n);
                });
                let n = fx.get(rank);
                let is_kept =
                    fx.b.ins()
                        .icmp_imm_u(IntCC::UnsignedLessThan, n, i64::from(keep));
                let flag = fx.b.ins().uextend(types::I32, is_kept);
                // The kept list has one spare entry: at most `keep` groups
                // are kept, so position `kept` is always in range.
                let position = fx.get(kept);
                fx.st(r.kept, Ix::V(position), jv);
                let next = fx.b.ins().iadd(position, flag);
                fx.set(kept, next);
                let word = fx.b.ins().ushr_imm_u(jv, 5);
                let bit = fx.b.ins().band_imm_u(jv, 31);
                let bit = fx.b.ins().ishl(flag, bit);
                let old = fx.ldi(r.mask, Ix::V(word));
                let new = fx.b.ins().bor(old, bit);
                fx.st(r.mask, Ix::V(word), new);
            });
            let scale = elem.scaled().then(|| {
                let zero = fx.f32c(0.0);
                let max = fx.var(types::F32, zero);
                fx.each(keep, |fx, e| {
                    let j = fx.ldi(r.kept, e);
                    let group = fx.row(x, Ix::V(j), 4 * g, 0);
                    fx.each_unrolled(g, UNROLL, |fx, t| {
                        let v = fx.ldf(group, t);
                        let a = fx.b.ins().fabs(v);
                        let m = fx.get(max);
                        let m = fx.rust_max(m, a);
                        fx.set(max, m);
                    });
                });
                let m = fx.get(max);
                fx.half_scale(m, elem.code_max())
            });
            ItemValues { scale }
        }
        _ => ItemValues::default(),
    }
}

/// `ops::min_max` as it runs: the smallest and largest values seen in
/// `f32::total_cmp` order, kept as total-order keys (the key of a key is
/// the float's bits again).
#[derive(Clone, Copy)]
struct MinMax {
    lo: cranelift_frontend::Variable,
    hi: cranelift_frontend::Variable,
}

impl MinMax {
    /// Starts at `(+inf, -inf)`.
    fn new(fx: &mut Fx) -> MinMax {
        let inf = fx.f32c(f32::INFINITY);
        let lo = fx.total_key(inf);
        let neg_inf = fx.f32c(f32::NEG_INFINITY);
        let hi = fx.total_key(neg_inf);
        MinMax {
            lo: fx.var(types::I32, lo),
            hi: fx.var(types::I32, hi),
        }
    }

    fn add(self, fx: &mut Fx, v: ir::Value) {
        let key = fx.total_key(v);
        let lo = fx.get(self.lo);
        let below = fx.b.ins().icmp(IntCC::SignedLessThan, key, lo);
        let lo = fx.b.ins().select(below, key, lo);
        fx.set(self.lo, lo);
        let hi = fx.get(self.hi);
        let above = fx.b.ins().icmp(IntCC::SignedGreaterThan, key, hi);
        let hi = fx.b.ins().select(above, key, hi);
        fx.set(self.hi, hi);
    }

    /// `(lo, hi)` as f32.
    fn finish(self, fx: &mut Fx) -> (ir::Value, ir::Value) {
        let [lo, hi] = [self.lo, self.hi].map(|v| {
            let key = fx.get(v);
            let bits = fx.b.ins().sshr_imm_u(key, 31);
            let flip = fx.b.ins().ushr_imm_u(bits, 1);
            let bits = fx.b.ins().bxor(key, flip);
            fx.bits_float(bits)
        });
        (lo, hi)
    }
}

/// `ops::max_abs` of the `n` floats at `x`.
fn max_abs(fx: &mut Fx, x: ir::Value, n: u32) -> ir::Value {
    let zero = fx.f32c(0.0);
    let max = fx.var(types::F32, zero);
    fx.each(n, |fx, c| {
        let v = fx.ldf(x, c);
        let a = fx.b.ins().fabs(v);
        let m = fx.get(max);
        let m = fx.rust_max(m, a);
        fx.set(max, m);
    });
    fx.get(max)
}

/// One slot of the current item.
#[derive(Clone, Copy)]
struct Slot<'s> {
    item: ir::Value,
    slot: &'s ItemSlot,
}

impl Slot<'_> {
    /// ORs element `j`'s value (its low bits, as `bits::write_bits` keeps)
    /// into the zeroed image: an 8-byte read-modify-write from the element's
    /// first byte (the image has 8 spare bytes past the page).
    fn put(self, fx: &mut Fx, j: Ix, value: ir::Value) {
        let (step, width) = match self.slot.role {
            SlotRole::MaskBit => (MASK_WORD_BITS, MASK_WORD_BITS),
            _ => (self.slot.bits.width, self.slot.bits.width),
        };
        let value = if width < 32 {
            fx.b.ins().band_imm_u(value, (1i64 << width) - 1)
        } else {
            value
        };
        let wide = fx.b.ins().uextend(types::I64, value);
        let bit = fx.affine(j, step, self.slot.bits.offset);
        let (at, shifted) = match bit {
            Ix::K(bit) => {
                let shifted = fx.b.ins().ishl_imm_u(wide, i64::from(bit % 8));
                (fx.row(self.item, Ix::K(0), 0, bit / 8), shifted)
            }
            Ix::V(bit) => {
                let byte = fx.b.ins().ushr_imm_u(bit, 3);
                let shift = fx.b.ins().band_imm_u(bit, 7);
                let shift = fx.b.ins().uextend(types::I64, shift);
                let shifted = fx.b.ins().ishl(wide, shift);
                (fx.row(self.item, Ix::V(byte), 1, 0), shifted)
            }
        };
        let old = fx.b.ins().load(types::I64, writable(), at, 0);
        let new = fx.b.ins().bor(old, shifted);
        fx.b.ins().store(writable(), new, at, 0);
    }
}
