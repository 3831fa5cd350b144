//! A codec's fields over a chunk of transformed items, as
//! `interp::encode` encodes them: codeword search (first strictly
//! better codeword wins, scores summed from 0 in coordinate order), radii,
//! page-scale maxima, and every slot element ORed into the chunk's image at
//! the bit the item schema gives it.

use super::super::abi::TableBuffer;
use super::super::builder::{Cmp, Kernel, Reg, F32, U32};
use super::emit::{
    assign_if, for_each, fp8_encode, from_order_key, half_scale, half_zero_point_scale, item_bit,
    magnitude_bits, order_key, quantize, quantize_unsigned, radius_code, scale_or_one, serial,
    split, write_bits, zero_point_scale, Ctx, KEY_INFINITY, KEY_NEG_INFINITY,
};
use super::plan::Plan;
use crate::ir::encode::{FieldEncode, Measured, ScaleRule, Source};
use crate::layout::{CodecLayout, DenseScale, FieldLayout, SlotRole};
use crate::lower::encode::lower_codec;
use crate::spec::{BitmapElem, CodewordKind, DenseDtype, Fp8};

/// Group sizes up to this keep their coordinates in registers and unroll
/// the codeword loop.
const UNROLL: u32 = 16;

/// The sum `Σ` starts from: `-0.0` (Rust's `Sum` of floats), so that the
/// first term passes unchanged.
const SUM_START: f32 = -0.0;

/// One codebook field's geometry.
struct Book {
    groups: u32,
    g: u32,
    entries: u32,
    /// First float of the field's table in the head's block.
    table: u32,
    per_group: bool,
    book_len: u32,
    codewords: CodewordKind,
}

fn book(codec: &CodecLayout, tables: &TableBuffer) -> Option<Book> {
    match *codec.body() {
        ref body @ FieldLayout::Codebook {
            groups,
            group_size,
            bits,
            codewords,
            per_group,
            table,
            ..
        } => Some(Book {
            groups,
            g: group_size,
            entries: 1 << bits,
            table: tables.offsets[table],
            per_group,
            book_len: body.book_len(),
            codewords,
        }),
        _ => None,
    }
}

impl Book {
    /// Float index (in the head's tables) of codeword 0 of group `j`.
    fn start(&self, k: &mut Kernel, j: Reg<U32>) -> Reg<U32> {
        if self.per_group {
            k.mad_lo(j, self.book_len, self.table)
        } else {
            k.mov(self.table)
        }
    }
}

/// Shared address of coordinate `t` of group `j` of item `item` of `x`.
fn coordinate(
    k: &mut Kernel,
    ctx: &Ctx,
    plan: &Plan,
    dims: u32,
    item: Reg<U32>,
    first: Reg<U32>,
) -> super::super::builder::Shared {
    let at = k.mad_lo(item, dims, first);
    ctx.shared_word(k, plan.x, at)
}

/// Codeword indices (and, with a radius field, radii) of every group of the
/// chunk's items; ends with a barrier. Nothing for other bodies.
pub fn choose_codewords(
    k: &mut Kernel,
    ctx: &Ctx,
    plan: &Plan,
    codec: &CodecLayout,
    tables: &TableBuffer,
    count: Reg<U32>,
) {
    let Some(book) = book(codec, tables) else {
        return;
    };
    let (groups, g, dims) = (book.groups, book.g, codec.dims);
    let radius = codec.radius().is_some();
    k.comment(&format!(
        "{}: codeword search, {} groups of {g}, {} codewords",
        codec.side.name(),
        groups,
        book.entries
    ));
    let tasks = k.mul(count, groups);
    for_each(k, ctx, tasks, |k, w| {
        let (item, j) = split(k, w, groups);
        let first = k.mul(j, g);
        let x0 = coordinate(k, ctx, plan, dims, item, first);
        let xs: Vec<Reg<F32>> = if g <= UNROLL {
            (0..g)
                .map(|t| k.ld_shared(x0.plus(4 * i64::from(t))))
                .collect()
        } else {
            Vec::new()
        };
        let start = book.start(k, j);
        let (worst, better) = match book.codewords {
            CodewordKind::Direction => (f32::NEG_INFINITY, Cmp::Gt),
            CodewordKind::Vector => (f32::INFINITY, Cmp::Lt),
        };
        let best = k.mov(worst);
        let index = k.mov(0u32);
        let codewords = book.codewords;
        serial(k, book.entries, |k, e| {
            let cw = k.mad_lo(e, g, start);
            let c0 = ctx.table(k, 0, cw);
            let score = k.mov(0.0f32);
            let step = |k: &mut Kernel, x: Reg<F32>, c: Reg<F32>| {
                let term = match codewords {
                    CodewordKind::Direction => k.mul(x, c),
                    CodewordKind::Vector => {
                        let d = k.sub(x, c);
                        k.mul(d, d)
                    }
                };
                k.add_to(score, score, term);
            };
            if g <= UNROLL {
                for (t, &x) in xs.iter().enumerate() {
                    let c = k.ld_global_nc(c0.plus(4 * t as i64));
                    step(k, x, c);
                }
            } else {
                let cw = k.mov(cw);
                let xa = k.mov(x0.base);
                serial(k, g, |k, _| {
                    let x = k.ld_shared(super::super::builder::Shared::at(xa).plus(x0.offset));
                    let c = ctx.table_value(k, 0, cw);
                    step(k, x, c);
                    k.add_to(xa, xa, 4u32);
                    k.add_to(cw, cw, 1u32);
                });
            }
            let wins = k.setp(better, score, best);
            assign_if(k, best, score, wins);
            assign_if(k, index, e, wins);
        });
        let at = ctx.shared_word(k, plan.codes, w);
        k.st_shared(at, index);
        if radius {
            // radius_of: the least-squares length along the chosen codeword.
            let cw = k.mad_lo(index, g, start);
            let dot = k.mov(SUM_START);
            let norm = k.mov(SUM_START);
            let (cw, xa) = (k.mov(cw), k.mov(x0.base));
            serial(k, g, |k, _| {
                let x: Reg<F32> =
                    k.ld_shared(super::super::builder::Shared::at(xa).plus(x0.offset));
                let c = ctx.table_value(k, 0, cw);
                let xc = k.mul(x, c);
                k.add_to(dot, dot, xc);
                let cc = k.mul(c, c);
                k.add_to(norm, norm, cc);
                k.add_to(xa, xa, 4u32);
                k.add_to(cw, cw, 1u32);
            });
            let r = k.div_f32(dot, norm);
            let r = k.max(r, 0.0f32);
            let positive = k.setp(Cmp::Gt, norm, 0.0f32);
            let r = k.selp(r, 0.0f32, positive);
            let at = ctx.shared_word(k, plan.aux, w);
            k.st_shared(at, r);
        }
    });
    k.bar_sync();
}

/// This chunk's share of the codec's page statistics
/// (`CodecEncode::page_scales`), reduced into the header-scale slots by
/// shared atomics: magnitudes as float bits, ranges as order keys (the
/// smallest as the largest inverted key, at the zero-point slots). The
/// caller synchronizes.
pub fn page_maxima(k: &mut Kernel, ctx: &Ctx, plan: &Plan, codec: &CodecLayout, count: Reg<U32>) {
    for page in &lower_codec(codec).page_scales {
        let (region, what) = match page.of {
            Measured::Radii { .. } => (plan.aux, "radius"),
            Measured::Coordinates { .. } => (plan.x, "coordinate"),
        };
        let n = page.of.count();
        let tasks = k.mul(count, n);
        // Slot index of task `w`'s statistic.
        let index = |k: &mut Kernel, w: Reg<U32>| match page.each {
            true => k.rem_u32(w, n),
            false => k.mov(0u32),
        };
        let side = codec.side.name();
        match page.rule {
            ScaleRule::Magnitude { .. } if !page.each => {
                k.comment(&format!("{side}: {what} page maximum"));
                let local = k.mov(0u32);
                for_each(k, ctx, tasks, |k, w| {
                    let at = ctx.shared_word(k, region, w);
                    let v = k.ld_shared(at);
                    let m = magnitude_bits(k, v);
                    let larger = k.max(local, m);
                    k.assign(local, larger);
                });
                let target = k.mov(page.slot);
                let at = ctx.shared_word(k, plan.scales, target);
                k.red_shared_max(at, local);
            }
            ScaleRule::Magnitude { .. } => {
                k.comment(&format!("{side}: {what} page maxima"));
                for_each(k, ctx, tasks, |k, w| {
                    let at = ctx.shared_word(k, region, w);
                    let v = k.ld_shared(at);
                    let m = magnitude_bits(k, v);
                    let j = index(k, w);
                    let target = k.add(j, page.slot);
                    let at = ctx.shared_word(k, plan.scales, target);
                    k.red_shared_max(at, m);
                });
            }
            ScaleRule::Range { zero_slot, .. } => {
                k.comment(&format!("{side}: {what} page ranges"));
                for_each(k, ctx, tasks, |k, w| {
                    let at = ctx.shared_word(k, region, w);
                    let v = k.ld_shared(at);
                    let key = order_key(k, v);
                    let inverted = k.xor(key, u32::MAX);
                    let j = index(k, w);
                    let target = k.add(j, page.slot);
                    let at = ctx.shared_word(k, plan.scales, target);
                    k.red_shared_max(at, key);
                    let target = k.add(j, zero_slot);
                    let at = ctx.shared_word(k, plan.scales, target);
                    k.red_shared_max(at, inverted);
                });
            }
        }
    }
}

/// Turns this codec's page statistics into its header scales by their
/// rules (`scale_or_one(max / q)`, `zero_point_scale`). The caller
/// synchronizes.
pub fn finish_scales(k: &mut Kernel, ctx: &Ctx, plan: &Plan, codec: &CodecLayout) {
    for page in &lower_codec(codec).page_scales {
        for_each(k, ctx, page.slots(), |k, w| {
            let target = k.add(w, page.slot);
            let at_scale = ctx.shared_word(k, plan.scales, target);
            match page.rule {
                ScaleRule::Magnitude { q } => {
                    let m: Reg<F32> = k.ld_shared(at_scale);
                    let m = match q {
                        1.0 => m,
                        q => k.div_f32(m, q),
                    };
                    let s = scale_or_one(k, m);
                    k.st_shared(at_scale, s);
                }
                ScaleRule::Range { bits, zero_slot } => {
                    let target = k.add(w, zero_slot);
                    let at_zero = ctx.shared_word(k, plan.scales, target);
                    let hi: Reg<U32> = k.ld_shared(at_scale);
                    let lo: Reg<U32> = k.ld_shared(at_zero);
                    let lo = k.xor(lo, u32::MAX);
                    let (hi, lo) = (from_order_key(k, hi), from_order_key(k, lo));
                    let (s, z) = zero_point_scale(k, lo, hi, bits);
                    k.st_shared(at_scale, s);
                    k.st_shared(at_zero, z);
                }
            }
        });
    }
}

/// ORs every slot of the chunk's items into the (zeroed) image; ends with a
/// barrier.
pub fn pack_items(
    k: &mut Kernel,
    ctx: &Ctx,
    plan: &Plan,
    codec: &CodecLayout,
    tables: &TableBuffer,
    count: Reg<U32>,
) {
    let (dims, stride, side) = (codec.dims, codec.stride, codec.side.name());
    let encode = lower_codec(codec);
    for (field, encoded) in codec.fields.iter().zip(&encode.fields) {
        // Where each scale and zero point comes from.
        let (scale_source, zero_source) = match *encoded {
            FieldEncode::Radius { scale, .. } => (Some(scale), None),
            FieldEncode::Coeff { scale, zero, .. } => (Some(scale), zero),
            FieldEncode::Dense { divide_by, .. } => (divide_by, None),
            _ => (None, None),
        };
        match *field {
            FieldLayout::Radius { groups, bits, .. } => {
                k.comment(&format!("{side}: radius codes"));
                let range = codec.slot(SlotRole::RadiusCode);
                let tasks = k.mul(count, groups);
                for_each(k, ctx, tasks, |k, w| {
                    let (item, j) = split(k, w, groups);
                    let at = ctx.shared_word(k, plan.aux, w);
                    let r = k.ld_shared(at);
                    let scale = scale_source.expect("radius scale");
                    let s = read_source(k, (ctx, plan, tables), scale, (item, j), false);
                    let code = radius_code(k, r, s, bits);
                    let bit = k.mad_lo(j, range.width, range.offset);
                    let bit = item_bit(k, item, stride, bit);
                    write_bits(k, ctx, plan.image, bit, range.width, code);
                });
            }
            FieldLayout::Codebook { groups, .. } => {
                k.comment(&format!("{side}: codeword indices"));
                let range = codec.slot(SlotRole::CodebookIndex);
                let tasks = k.mul(count, groups);
                for_each(k, ctx, tasks, |k, w| {
                    let (item, j) = split(k, w, groups);
                    let at = ctx.shared_word(k, plan.codes, w);
                    let code = k.ld_shared(at);
                    let bit = k.mad_lo(j, range.width, range.offset);
                    let bit = item_bit(k, item, stride, bit);
                    write_bits(k, ctx, plan.image, bit, range.width, code);
                });
            }
            FieldLayout::Coeff {
                item_scale,
                item_zero,
                bits,
                zero_point,
                group,
                ..
            } => {
                let groups = dims / group;
                if let Some(offset) = item_scale {
                    k.comment(&format!("{side}: f16 item scales"));
                    let tasks = k.mul(count, groups);
                    for_each(k, ctx, tasks, |k, w| {
                        let (item, j) = split(k, w, groups);
                        let first = k.mul(item, dims);
                        let first = k.mad_lo(j, group, first);
                        // Smallest and largest order keys, or the largest magnitude.
                        let lo = k.mov(KEY_INFINITY);
                        let hi = k.mov(KEY_NEG_INFINITY);
                        let m = k.mov(0.0f32);
                        serial(k, group, |k, c| {
                            let i = k.add(first, c);
                            let at = ctx.shared_word(k, plan.x, i);
                            let v: Reg<F32> = k.ld_shared(at);
                            if zero_point {
                                let key = order_key(k, v);
                                let smaller = k.min(lo, key);
                                k.assign(lo, smaller);
                                let larger = k.max(hi, key);
                                k.assign(hi, larger);
                            } else {
                                let a = k.abs_f32(v);
                                let larger = k.max(m, a);
                                k.assign(m, larger);
                            }
                        });
                        let at = k.mad_lo(item, plan.item_groups, j);
                        let (s, s_bits) = if zero_point {
                            let (lo, hi) = (from_order_key(k, lo), from_order_key(k, hi));
                            let (s, s_bits, z, z_bits) = half_zero_point_scale(k, lo, hi, bits);
                            let zero_at = ctx.shared_word(k, plan.item_zeros, at);
                            k.st_shared(zero_at, z);
                            let offset = item_zero.expect("zero points stored");
                            let bit = k.mad_lo(j, 16u32, offset);
                            let bit = item_bit(k, item, stride, bit);
                            write_bits(k, ctx, plan.image, bit, 16, z_bits);
                            (s, s_bits)
                        } else {
                            half_scale(k, m, super::emit::coeff_max(bits) as f32)
                        };
                        let scale_at = ctx.shared_word(k, plan.item_scales, at);
                        k.st_shared(scale_at, s);
                        let bit = k.mad_lo(j, 16u32, offset);
                        let bit = item_bit(k, item, stride, bit);
                        write_bits(k, ctx, plan.image, bit, 16, s_bits);
                    });
                    k.bar_sync();
                }
                k.comment(&format!("{side}: coefficients"));
                let role = SlotRole::Coefficient;
                write_components(k, (ctx, plan, codec), count, role, |k, (item, c), v| {
                    let at = (ctx, plan, tables);
                    let zero = zero_source.map(|z| read_source(k, at, z, (item, c), true));
                    let scale = scale_source.expect("coefficient scale");
                    let factor = read_source(k, at, scale, (item, c), false);
                    match zero {
                        Some(z) => quantize_unsigned(k, v, factor, z, bits),
                        None => quantize(k, v, factor, bits),
                    }
                });
            }
            FieldLayout::Bitmap {
                groups,
                group_size: g,
                keep,
                elem,
                item_scale,
                ..
            } => bitmap(
                k,
                ctx,
                plan,
                codec,
                count,
                Bitmap {
                    groups,
                    g,
                    keep,
                    elem,
                    item_scale,
                },
            ),
            FieldLayout::Dense { dtype, scale, .. } => {
                if let (Some(DenseScale::Item(offset)), Some(format)) = (scale, dtype.fp8()) {
                    k.comment(&format!("{side}: f16 item scales of fp8 values"));
                    for_each(k, ctx, count, |k, item| {
                        let m = k.mov(0.0f32);
                        let row = k.mul(item, dims);
                        serial(k, dims, |k, c| {
                            let i = k.add(row, c);
                            let at = ctx.shared_word(k, plan.x, i);
                            let v: Reg<F32> = k.ld_shared(at);
                            let a = k.abs_f32(v);
                            let larger = k.max(m, a);
                            k.assign(m, larger);
                        });
                        // Where `Source::Item` reads it: the item's first scale.
                        let first = k.mul(item, plan.item_groups);
                        let q = format.max();
                        store_item_scale(k, ctx, plan, stride, first, item, m, q, offset);
                    });
                    k.bar_sync();
                }
                k.comment(&format!("{side}: dense values"));
                let role = SlotRole::DenseValue;
                write_components(k, (ctx, plan, codec), count, role, |k, (item, c), v| {
                    let v = match scale_source {
                        Some(by) => {
                            let s = read_source(k, (ctx, plan, tables), by, (item, c), false);
                            k.div_f32(v, s)
                        }
                        None => v,
                    };
                    match dtype {
                        DenseDtype::F16 => {
                            let h = k.f32_to_f16(v);
                            k.widen16(h)
                        }
                        DenseDtype::Bf16 => {
                            let h = k.f32_to_bf16(v);
                            k.widen16(h)
                        }
                        DenseDtype::F32 => k.bitcast(v),
                        DenseDtype::Fp8e4m3 => fp8_encode(k, Fp8::E4m3, v),
                        DenseDtype::Fp8e5m2 => fp8_encode(k, Fp8::E5m2, v),
                    }
                });
            }
        }
    }
    k.bar_sync();
}

/// Every component `c` of every staged item: `code` of its value, written
/// at component `c` of the item's `role` slot.
fn write_components(
    k: &mut Kernel,
    (ctx, plan, codec): (&Ctx, &Plan, &CodecLayout),
    count: Reg<U32>,
    role: SlotRole,
    code: impl FnOnce(&mut Kernel, (Reg<U32>, Reg<U32>), Reg<F32>) -> Reg<U32>,
) {
    let (dims, range) = (codec.dims, codec.slot(role));
    let tasks = k.mul(count, dims);
    for_each(k, ctx, tasks, |k, w| {
        let (item, c) = split(k, w, dims);
        let at = ctx.shared_word(k, plan.x, w);
        let v = k.ld_shared(at);
        let code = code(k, (item, c), v);
        let bit = k.mad_lo(c, range.width, range.offset);
        let bit = item_bit(k, item, codec.stride, bit);
        write_bits(k, ctx, plan.image, bit, range.width, code);
    });
}

/// The scale (or, `zero`, the zero point) that `source` gives element `i`
/// (component or group) of item `item`.
fn read_source(
    k: &mut Kernel,
    (ctx, plan, tables): (&Ctx, &Plan, &TableBuffer),
    source: Source,
    (item, i): (Reg<U32>, Reg<U32>),
    zero: bool,
) -> Reg<F32> {
    match source {
        Source::Header { slot, each } => {
            let target = match each {
                true => k.add(i, slot),
                false => k.mov(slot),
            };
            let at = ctx.shared_word(k, plan.scales, target);
            k.ld_shared(at)
        }
        Source::Table { table, each } => {
            let index = match each {
                true => i,
                false => k.mov(0u32),
            };
            ctx.table_value(k, tables.offsets[table], index)
        }
        Source::Item { group } => {
            let j = k.div_u32(i, group);
            let at = k.mad_lo(item, plan.item_groups, j);
            let region = match zero {
                true => plan.item_zeros,
                false => plan.item_scales,
            };
            let at = ctx.shared_word(k, region, at);
            k.ld_shared(at)
        }
    }
}

/// `half_scale(m, q)` of item `item`: kept in shared `item_scales`, its f16
/// bits written at bit `offset` of the item.
#[allow(clippy::too_many_arguments)]
fn store_item_scale(
    k: &mut Kernel,
    ctx: &Ctx,
    plan: &Plan,
    stride: u32,
    at: Reg<U32>,
    item: Reg<U32>,
    m: Reg<F32>,
    q: f32,
    offset: u32,
) {
    let (s, bits) = half_scale(k, m, q);
    let at = ctx.shared_word(k, plan.item_scales, at);
    k.st_shared(at, s);
    let bit = k.mad_lo(item, 8 * stride, offset);
    write_bits(k, ctx, plan.image, bit, 16, bits);
}

struct Bitmap {
    groups: u32,
    g: u32,
    keep: u32,
    elem: BitmapElem,
    item_scale: Option<u32>,
}

/// `bitmap_encode`: group energies; the `keep` groups first in (larger
/// energy, lower index) order as mask bits; the int8 item scale over the
/// kept elements; the kept elements in group order.
fn bitmap(k: &mut Kernel, ctx: &Ctx, plan: &Plan, codec: &CodecLayout, count: Reg<U32>, b: Bitmap) {
    let (dims, stride, side) = (codec.dims, codec.stride, codec.side.name());
    let Bitmap {
        groups,
        g,
        keep,
        elem,
        item_scale,
    } = b;
    let tasks = k.mul(count, groups);
    k.comment(&format!("{side}: bitmap group energies"));
    for_each(k, ctx, tasks, |k, w| {
        let (item, j) = split(k, w, groups);
        let first = k.mul(j, g);
        let x0 = coordinate(k, ctx, plan, dims, item, first);
        let mut e = k.mov(SUM_START);
        for t in 0..g {
            let v: Reg<F32> = k.ld_shared(x0.plus(4 * i64::from(t)));
            let sq = k.mul(v, v);
            e = k.add(e, sq);
        }
        let at = ctx.shared_word(k, plan.aux, w);
        k.st_shared(at, e);
    });
    k.bar_sync();
    k.comment(&format!("{side}: bitmap kept groups (mask bits)"));
    let mask = codec.slot(SlotRole::MaskBit);
    for_each(k, ctx, tasks, |k, w| {
        let (item, j) = split(k, w, groups);
        let at = ctx.shared_word(k, plan.aux, w);
        // Energies are never negative: their bits order as total_cmp does.
        let mine: Reg<U32> = k.ld_shared(at);
        let row = k.mul(item, groups);
        let rank = k.mov(0u32);
        serial(k, groups, |k, i| {
            let other = k.add(row, i);
            let at = ctx.shared_word(k, plan.aux, other);
            let theirs: Reg<U32> = k.ld_shared(at);
            let before = k.setp(Cmp::Lt, i, j);
            let ge = k.setp(Cmp::Ge, theirs, mine);
            let gt = k.setp(Cmp::Gt, theirs, mine);
            let ahead_if_before = k.and_pred(before, ge);
            let ahead = k.or_pred(ahead_if_before, gt);
            let one = k.selp(1u32, 0u32, ahead);
            k.add_to(rank, rank, one);
        });
        let kept = k.setp(Cmp::Lt, rank, keep);
        let flag = k.selp(1u32, 0u32, kept);
        let at = ctx.shared_word(k, plan.codes, w);
        k.st_shared(at, flag);
        let bit = k.add(j, mask.offset);
        let bit = item_bit(k, item, stride, bit);
        write_bits(k, ctx, plan.image, bit, 1, flag);
    });
    k.bar_sync();
    if let Some(offset) = item_scale {
        k.comment(&format!("{side}: bitmap int8 item scales"));
        for_each(k, ctx, count, |k, item| {
            let m = k.mov(0.0f32);
            let row = k.mul(item, groups);
            serial(k, groups, |k, j| {
                let at = k.add(row, j);
                let at = ctx.shared_word(k, plan.codes, at);
                let flag: Reg<U32> = k.ld_shared(at);
                let kept = k.setp(Cmp::Ne, flag, 0u32);
                let first = k.mul(j, g);
                let x0 = coordinate(k, ctx, plan, dims, item, first);
                for t in 0..g {
                    let v: Reg<F32> = k.ld_shared(x0.plus(4 * i64::from(t)));
                    let a = k.abs_f32(v);
                    let larger = k.max(m, a);
                    assign_if(k, m, larger, kept);
                }
            });
            let q = elem.code_max();
            store_item_scale(k, ctx, plan, stride, item, item, m, q, offset);
        });
        k.bar_sync();
    }
    k.comment(&format!("{side}: bitmap kept elements"));
    let elems = codec.slot(SlotRole::BitmapElement);
    for_each(k, ctx, tasks, |k, w| {
        let (item, j) = split(k, w, groups);
        let at = ctx.shared_word(k, plan.codes, w);
        let flag: Reg<U32> = k.ld_shared(at);
        let dropped = k.setp(Cmp::Eq, flag, 0u32);
        let skip = k.label();
        k.bra_if(dropped, true, skip);
        let row = k.mul(item, groups);
        let position = k.mov(0u32);
        serial(k, j, |k, i| {
            let at = k.add(row, i);
            let at = ctx.shared_word(k, plan.codes, at);
            let earlier: Reg<U32> = k.ld_shared(at);
            k.add_to(position, position, earlier);
        });
        let scale: Option<Reg<F32>> = elem.scaled().then(|| {
            let at = ctx.shared_word(k, plan.item_scales, item);
            k.ld_shared(at)
        });
        let first = k.mul(j, g);
        let x0 = coordinate(k, ctx, plan, dims, item, first);
        let e0 = k.mul(position, g);
        for t in 0..g {
            let v: Reg<F32> = k.ld_shared(x0.plus(4 * i64::from(t)));
            let raw = match (scale, elem.fp8()) {
                (Some(s), Some(format)) => {
                    let v = k.div_f32(v, s);
                    fp8_encode(k, format, v)
                }
                (Some(s), None) => quantize(k, v, s, 8),
                (None, _) => {
                    let h = k.f32_to_f16(v);
                    k.widen16(h)
                }
            };
            let e = k.add(e0, t);
            let bit = k.mad_lo(e, elems.width, elems.offset);
            let bit = item_bit(k, item, stride, bit);
            write_bits(k, ctx, plan.image, bit, elems.width, raw);
        }
        k.place(skip);
    });
}
