//! Which key scores the tensor cores take: the score program as a dot
//! product of the query with (scaled, zero-pointed) key elements, and
//! bitmap bodies whose kept f16 groups the fragments gather.

use super::*;

/// Whether a byte holds whole elements: integers of 2, 4 or 8 bits (3-bit
/// codes straddle bytes: [`triplet_register`]).
pub(super) fn whole_bytes(element: Element) -> bool {
    match element {
        Element::Int { bits, .. } => 8 % bits == 0 && bits >= 2,
        Element::Half | Element::Fp8(_) => true,
    }
}

/// The codec's body when it is a bitmap of f16 groups covering its `dims`,
/// alone, with masks and groups the expansion reads as words or halves. The
/// bit positions are the item schema's: a mask slot, then the kept f16
/// elements, and no item scale.
pub(super) fn gather(codec: &CodecLayout, dims: u32, stream: &Stream) -> Option<Gather> {
    let [FieldLayout::Bitmap {
        groups,
        group_size,
        keep,
        ..
    }] = codec.fields[..]
    else {
        return None;
    };
    let [mask, elems] = codec.slots[..] else {
        return None;
    };
    let half = bitmap_elem_bits(BitmapElem::F16);
    if mask.role != SlotRole::MaskBit
        || elems.role != SlotRole::BitmapElement
        || elems.bits.width != half
    {
        return None;
    }
    let g = Gather {
        mask_bit: mask.bits.offset,
        groups,
        group_size,
        keep,
        elems_bit: elems.bits.offset,
    };
    let aligned = g.mask_bit.is_multiple_of(32)
        && stream.shared_stride.is_multiple_of(4)
        && (g.word_copies(stream.shared_stride)
            || (g.elems_bit.is_multiple_of(16) && stream.shared_stride.is_multiple_of(2)));
    (groups * group_size == dims && keep > 0 && aligned).then_some(g)
}

/// A key score over a gathered bitmap: the query array it reads (a PCA's
/// bias term would add to it, so PCA keys stay on their path).
pub(super) fn gathered_score(module: &Module, key: &Stream) -> Option<(MmaScore, Gather)> {
    let codec = &module.layout.key;
    if matches!(codec.transform, TransformLayout::Pca { .. }) {
        return None;
    }
    let g = gather(codec, codec.dims, key)?;
    let mut arrays = module.key.score.exprs.iter().filter_map(|(_, e)| match *e {
        Expr::Shared { array, .. } => Some(array),
        _ => None,
    });
    let query = arrays.next()?;
    arrays.all(|a| a == query).then_some((
        MmaScore {
            query,
            key: Element::Half,
            key_scale: None,
            key_zero: None,
            key_bias: None,
            key_dims: codec.dims,
            gathered_runs: None,
        },
        g,
    ))
}

/// The score as a chain of fmas from 0.0 whose term `i` multiplies query
/// element `i` with the key element at bit `bits · i` (times header slot
/// `slot0 + i`, plus header slot `zero0 + i`), every element once.
pub(super) fn dot_product(f: &Function) -> Option<MmaScore> {
    let exprs = &f.exprs;
    let mut cur = f.result?;
    // `chain + bias[0]`: a per-head term.
    let mut key_bias = None;
    if let Expr::Binary {
        op: BinaryOp::Add,
        left,
        right,
    } = *exprs.try_get(cur)?
    {
        let bias = |h: Handle<Expr>| match shared_read(f, h)? {
            (array, 0) => Some(array),
            _ => None,
        };
        let (chain, array) =
            (bias(right).map(|a| (left, a))).or_else(|| bias(left).map(|a| (right, a)))?;
        cur = chain;
        key_bias = Some(array);
    }
    type Shape = (Handle<ArrayDecl>, Element, Option<u32>, Option<u32>);
    let mut shape: Option<Shape> = None;
    let mut seen = Vec::new();
    let term = |h: Handle<Expr>| {
        (scaled_element(f, h).map(|(e, bit, slot)| (e, bit, slot, None)))
            .or_else(|| affine_element(f, h).map(|(e, bit, s, z)| (e, bit, Some(s), Some(z))))
    };
    loop {
        match *exprs.try_get(cur)? {
            Expr::Fma { a, b, c } => {
                let ((element, bit, slot, zero), (array, index)) =
                    term(a)
                        .zip(shared_read(f, b))
                        .or_else(|| term(b).zip(shared_read(f, a)))?;
                let first = |slot: Option<u32>| match slot {
                    Some(slot) => slot.checked_sub(index).map(Some),
                    None => Some(None),
                };
                let this = (array, element, first(slot)?, first(zero)?);
                if bit != element.bits() * index || *shape.get_or_insert(this) != this {
                    return None;
                }
                seen.push(index);
                cur = c;
            }
            Expr::Literal(Literal::F32(0.0)) => break,
            _ => return None,
        }
    }
    let (query, element, scale, zero) = shape?;
    let dims = seen.len() as u32;
    seen.sort_unstable();
    (seen.iter().copied().eq(0..dims)).then_some(MmaScore {
        query,
        key: element,
        key_scale: scale,
        key_zero: zero,
        key_bias,
        key_dims: dims,
        gathered_runs: None,
    })
}

/// An element at a constant bit, alone or times a constant header slot.
pub(super) fn scaled_element(f: &Function, h: Handle<Expr>) -> Option<(Element, u32, Option<u32>)> {
    if let Some((element, bit)) = element_at(f, h) {
        return literal(f, bit).map(|bit| (element, bit, None));
    }
    let (x, y) = multiplied(f, h)?;
    let scaled = |e: Handle<Expr>, s: Handle<Expr>| {
        let (element, bit) = element_at(f, e)?;
        match *f.exprs.try_get(s)? {
            Expr::HeaderScale { slot } => {
                Some((element, literal(f, bit)?, Some(literal(f, slot)?)))
            }
            _ => None,
        }
    };
    scaled(x, y).or_else(|| scaled(y, x))
}

/// `fma(float(item_bits(o, w)), header_scale(s), header_scale(z))`, an
/// unsigned `w`-bit code (2 to 8 bits) with its page's scale and zero point:
/// the code, `o`, `s` and `z`.
pub(super) fn affine_element(f: &Function, h: Handle<Expr>) -> Option<(Element, u32, u32, u32)> {
    let Expr::Fma { a, b, c } = *f.exprs.try_get(h)? else {
        return None;
    };
    let Expr::Unary {
        op: UnaryOp::ToFloat,
        arg,
    } = *f.exprs.try_get(a)?
    else {
        return None;
    };
    let Expr::ItemBits { bit_offset, width } = *f.exprs.try_get(arg)? else {
        return None;
    };
    let slot = |h: Handle<Expr>| match *f.exprs.try_get(h)? {
        Expr::HeaderScale { slot } => literal(f, slot),
        _ => None,
    };
    let bits = u32::from(width);
    (2..=8).contains(&bits).then_some(())?;
    Some((
        Element::Int {
            bits,
            signed: false,
        },
        literal(f, bit_offset)?,
        slot(b)?,
        slot(c)?,
    ))
}

/// `half(item_bits(o, 16))`, `float(sign_extend(item_bits(o, w)))` for w
/// in {4, 8}, or `float(item_bits(o, w))` for w in {2, 3, 4, 8}: the
/// element and `o`.
pub(super) fn element_at(f: &Function, h: Handle<Expr>) -> Option<(Element, Handle<Expr>)> {
    let Expr::Unary { op, arg } = *f.exprs.try_get(h)? else {
        return None;
    };
    let bits = |h: Handle<Expr>| match *f.exprs.try_get(h)? {
        Expr::ItemBits { bit_offset, width } => Some((bit_offset, u32::from(width))),
        _ => None,
    };
    match op {
        UnaryOp::HalfToFloat => match bits(arg)? {
            (offset, 16) => Some((Element::Half, offset)),
            _ => None,
        },
        UnaryOp::Fp8ToFloat(format) => match bits(arg)? {
            (offset, 8) => Some((Element::Fp8(format), offset)),
            _ => None,
        },
        UnaryOp::ToFloat => {
            let (inner, signed) = match *f.exprs.try_get(arg)? {
                Expr::Unary {
                    op: UnaryOp::SignExtend(n),
                    arg,
                } => (arg, Some(u32::from(n))),
                _ => (arg, None),
            };
            let (offset, width) = bits(inner)?;
            // Unsigned 2- and 3-bit codes come with zero points (KIVI-2).
            let ok = match signed {
                Some(n) => matches!(width, 4 | 8) && n == width,
                None => matches!(width, 2 | 3 | 4 | 8),
            };
            ok.then_some((
                Element::Int {
                    bits: width,
                    signed: signed.is_some(),
                },
                offset,
            ))
        }
        _ => None,
    }
}

/// The operands of an f32 multiplication.
pub(super) fn multiplied(f: &Function, h: Handle<Expr>) -> Option<(Handle<Expr>, Handle<Expr>)> {
    match *f.exprs.try_get(h)? {
        Expr::Binary {
            op: BinaryOp::Multiply,
            left,
            right,
        } => Some((left, right)),
        _ => None,
    }
}

/// `array[index]` at a constant index.
pub(super) fn shared_read(f: &Function, h: Handle<Expr>) -> Option<(Handle<ArrayDecl>, u32)> {
    match *f.exprs.try_get(h)? {
        Expr::Shared { array, index } => Some((array, literal(f, index)?)),
        _ => None,
    }
}

pub(super) fn literal(f: &Function, h: Handle<Expr>) -> Option<u32> {
    match *f.exprs.try_get(h)? {
        Expr::Literal(Literal::U32(v)) => Some(v),
        _ => None,
    }
}
