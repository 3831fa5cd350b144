//! Which value accumulates the tensor cores take: channel `c` as the value
//! item's element `c` (alone, or times the item's f16 scale, or per channel
//! group), and where each channel's code sits in a row.

use super::*;

/// A value channel `element(base + bits · channel)`, alone or times the
/// item's f16 scale.
#[derive(Debug, Clone, Copy)]
pub struct Channel {
    pub element: Element,
    /// Bit offset of channel 0 in a value row.
    pub base: u32,
    /// Bit offset of the value item's f16 scale.
    pub scale: Option<u32>,
    /// Per-group f16 scales (and zero points) in the item.
    pub groups: Option<ValueGroups>,
    /// Header slot of channel 0's page scale (channel `c`'s is `c` slots
    /// further): a tile's products sum apart, then take the scales.
    pub page_scale: Option<u32>,
}

/// Value channels in groups of `size`, each with its item's f16 scale and,
/// optionally, zero point: channel `c` is `code(c) · scale[c / size] +
/// zero[c / size]`, the groups' halves consecutive from bits `scale` and
/// `zero`. Weights times a group's scales are that group's B fragments
/// (its channel tiles lie inside it), and the zero points enter as one f32
/// sum per (head, group) of weights times zeros.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValueGroups {
    pub size: u32,
    pub scale: u32,
    pub zero: Option<u32>,
}

impl ValueGroups {
    /// Bits of a lane group's codes of one value group: `2 · size / 16`
    /// codes ([`MmaPlan::group_channels`] per group), consecutive.
    pub fn lane_bits(&self, element: Element) -> u32 {
        self.size * element.bits() / 8
    }

    /// Bytes of a lane group's codes of one value group (whole ones unless
    /// [`Self::windowed`]).
    pub fn lane_bytes(&self, element: Element) -> u32 {
        self.lane_bits(element) / 8
    }

    /// Whether a lane group's codes of a group are read as a 32-bit window
    /// at any bit (funnel-shifted from the one or two words holding them),
    /// where they are not one or two bytes of a word or whole words: 3-bit
    /// codes, whose lane groups start at every half byte.
    pub fn windowed(&self, element: Element) -> bool {
        let (bits, bytes) = (self.lane_bits(element), self.lane_bytes(element));
        !(bits.is_multiple_of(8) && (matches!(bytes, 1 | 2) || (bytes > 0 && bytes % 4 == 0)))
    }

    /// Whether the kernels take these groups: integer codes in whole
    /// channel tiles per group, groups in whole words from a word boundary
    /// of the row, a lane group's codes of a group one or two bytes of a
    /// word, whole words, or (windowed) at most 24 bits, so each code lies
    /// in the window's first three bytes; and the halves read as aligned
    /// pairs.
    pub(super) fn fits(&self, element: Element, dims: u32, base: u32, rows: &Stream) -> bool {
        // Read as aligned pairs of halves, or one.
        let halves = |bit: u32| match dims / self.size {
            1 => bit.is_multiple_of(16),
            groups => bit.is_multiple_of(32) && groups.is_multiple_of(2),
        };
        matches!(
            element,
            Element::Int {
                bits: 2 | 3 | 4 | 8,
                ..
            }
        ) && self.size.is_multiple_of(TILE)
            && dims.is_multiple_of(self.size)
            && (!self.windowed(element) || self.lane_bits(element) <= 24)
            && (self.size * element.bits()).is_multiple_of(32)
            && base.is_multiple_of(32)
            && rows.shared_stride.is_multiple_of(4)
            && halves(self.scale)
            && self.zero.is_none_or(halves)
    }
}

/// How channel `c` of a windowed lane group's `bits`-bit codes
/// ([`ValueGroups::windowed`]) becomes two tokens' f16 pair: the `prmt`
/// selector that takes bytes `b, b + 1` of the two tokens' windows into the
/// low and high halves, and the code's shift in each half (at most 7, so
/// shift + bits stays inside f16's 10-bit mantissa).
pub fn window_channel(c: u32, bits: u32) -> (u32, u32) {
    let bit = c * bits;
    let b = bit / 8;
    (
        b | (b + 1) << 4 | (4 + b) << 8 | (5 + b) << 12,
        code_shift(c, bits),
    )
}

/// The bit at which lane-group channel `c` of a value group (of the lane
/// group without groups) starts in the byte the fragment takes it from.
pub fn code_shift(c: u32, bits: u32) -> u32 {
    c * bits % 8
}

/// The bit at which a code found at bit `shift` enters the `mma` as an f16
/// subnormal ([`MmaPlan::subnormal_codes`]): codes below bit 4 move up 4
/// where they still fit the 10-bit mantissa. The tensor cores keep a
/// product's bits from the smallest normal exponent down, so a subnormal's
/// leading zeros cost precision: H200, 2-bit codes at bit 0 summed 1.6e-5
/// off, at bit 6 as exactly as normal f16s.
pub fn subnormal_shift(shift: u32, bits: u32) -> u32 {
    match shift < SUBNORMAL_LIFT && shift + SUBNORMAL_LIFT + bits <= 10 {
        true => shift + SUBNORMAL_LIFT,
        false => shift,
    }
}

/// How far [`subnormal_shift`] moves low codes up.
pub const SUBNORMAL_LIFT: u32 = 4;

/// The element `h` reads when it is channel c's of a row of packed elements:
/// its kind and the bit offset of channel 0.
pub(super) fn channel_element(f: &Function, h: Handle<Expr>) -> Option<(Element, u32)> {
    let (element, offset) = element_at(f, h)?;
    match affine_in_channel(f, offset)? {
        (step, base) if step == element.bits() => Some((element, base)),
        _ => None,
    }
}

pub(super) fn scaled_channel(f: &Function) -> Option<Channel> {
    let result = f.result?;
    let channel = |h| channel_element(f, h);
    if let Some((element, base)) = channel(result) {
        return Some(Channel {
            element,
            base,
            scale: None,
            groups: None,
            page_scale: None,
        });
    }
    let (x, y) = multiplied(f, result)?;
    let scaled = |e: Handle<Expr>, s: Handle<Expr>| {
        let (element, base) = channel(e)?;
        let (Element::Half, offset) = element_at(f, s)? else {
            return None;
        };
        Some(Channel {
            element,
            base,
            scale: Some(literal(f, offset)?),
            groups: None,
            page_scale: None,
        })
    };
    let page_scaled = |e: Handle<Expr>, s: Handle<Expr>| {
        let (element, base) = channel(e)?;
        let Expr::HeaderScale { slot } = *f.exprs.try_get(s)? else {
            return None;
        };
        match affine_in_channel(f, slot)? {
            (1, slot0) => Some(Channel {
                element,
                base,
                scale: None,
                groups: None,
                page_scale: Some(slot0),
            }),
            _ => None,
        }
    };
    (scaled(x, y).or_else(|| scaled(y, x)))
        .or_else(|| page_scaled(x, y))
        .or_else(|| page_scaled(y, x))
}

/// `code(c) · scale[c / size] (+ zero[c / size])`, the scales and zeros
/// f16 item halves at `16 · (c / size)` past their first: [`ValueGroups`].
/// A constant scale (and zero) is one group of every channel.
pub(super) fn grouped_channel(f: &Function, dims: u32) -> Option<Channel> {
    let result = f.result?;
    let channel = |h| channel_element(f, h);
    // An f16 half at `16 · (c / size) + first`: `(size, first)`.
    let half = |h: Handle<Expr>| {
        let (Element::Half, offset) = element_at(f, h)? else {
            return None;
        };
        match affine_in_group(f, offset)? {
            (Some(size), 16, first) => Some((size, first)),
            (None, 0, first) => Some((dims, first)),
            _ => None,
        }
    };
    let (code, scale, zero) = match *f.exprs.try_get(result)? {
        Expr::Fma { a, b, c } => (a, b, Some(c)),
        _ => {
            let (x, y) = multiplied(f, result)?;
            (x, y, None)
        }
    };
    let ((element, base), (size, scale)) =
        (channel(code).zip(half(scale))).or_else(|| channel(scale).zip(half(code)))?;
    let zero = match zero {
        Some(z) => match half(z)? {
            (s, first) if s == size => Some(first),
            _ => return None,
        },
        None => None,
    };
    Some(Channel {
        element,
        base,
        scale: None,
        groups: Some(ValueGroups { size, scale, zero }),
        page_scale: None,
    })
}

/// `(size, a, b)` when the u32 expression is `a · (channel / size) + b`
/// (`size` None: no channel term).
pub(super) fn affine_in_group(f: &Function, h: Handle<Expr>) -> Option<(Option<u32>, u32, u32)> {
    match *f.exprs.try_get(h)? {
        Expr::Literal(Literal::U32(v)) => Some((None, 0, v)),
        Expr::Binary {
            op: BinaryOp::Divide,
            left,
            right,
        } => match (f.exprs.try_get(left)?, literal(f, right)?) {
            (Expr::Input(Input::Channel), size) if size > 0 => Some((Some(size), 1, 0)),
            _ => None,
        },
        Expr::Binary { op, left, right } => {
            let (l, r) = (affine_in_group(f, left)?, affine_in_group(f, right)?);
            let size = match (l.0, r.0) {
                (Some(a), Some(b)) if a != b => return None,
                (a, b) => a.or(b),
            };
            match op {
                BinaryOp::Add => Some((size, l.1.checked_add(r.1)?, l.2.checked_add(r.2)?)),
                BinaryOp::Multiply if l.1 == 0 => {
                    Some((size, r.1.checked_mul(l.2)?, r.2.checked_mul(l.2)?))
                }
                BinaryOp::Multiply if r.1 == 0 => {
                    Some((size, l.1.checked_mul(r.2)?, l.2.checked_mul(r.2)?))
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// `(a, b)` when the u32 expression is `a · channel + b`.
pub(super) fn affine_in_channel(f: &Function, h: Handle<Expr>) -> Option<(u32, u32)> {
    match *f.exprs.try_get(h)? {
        Expr::Input(Input::Channel) => Some((1, 0)),
        Expr::Literal(Literal::U32(v)) => Some((0, v)),
        Expr::Binary { op, left, right } => {
            let (l, r) = (affine_in_channel(f, left)?, affine_in_channel(f, right)?);
            match op {
                BinaryOp::Add => Some((l.0.checked_add(r.0)?, l.1.checked_add(r.1)?)),
                BinaryOp::Multiply if l.0 == 0 => {
                    Some((r.0.checked_mul(l.1)?, r.1.checked_mul(l.1)?))
                }
                BinaryOp::Multiply if r.0 == 0 => {
                    Some((l.0.checked_mul(r.1)?, l.1.checked_mul(r.1)?))
                }
                _ => None,
            }
        }
        _ => None,
    }
}
