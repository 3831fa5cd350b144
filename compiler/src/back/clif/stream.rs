//! `ItemBits` -> loads from the page: LSB-first little-endian bits at any bit
//! offset, zero-extended, with no read outside the page.
//!
//! Every read stays inside the `readable` bytes that follow an item's start in
//! the page (the last item of a page may end at the end of the pool): a window
//! that would pass them is slid back, and the shift grows by the bytes it
//! moved. Constant offsets pick the narrowest window; across items (score
//! lanes) aligned 32-bit words are gathered once and shared by every field in
//! them; across channels (accumulate lanes) consecutive fields become one
//! widening vector load, and fields inside one 32-bit window a splat, a mask
//! and a multiply that aligns every lane for one shift.

use cranelift_codegen::ir::{self, types, InstBuilder};

use super::expr::{known_u32, stream, Fx, Val, LANES};
use crate::back::interp::eval::Value as Known;
use crate::ir::Scalar;

/// Where the items of the current lanes start.
#[derive(Debug, Clone, Copy)]
pub(super) enum Items {
    /// One item for every lane: its address (page + offset).
    One(ir::Value),
    /// Lane k reads the item at address `lanes[k]`.
    Lanes([ir::Value; LANES]),
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Stream {
    pub items: Items,
    /// Bytes that may be read from any item's start without leaving the page.
    pub readable: u32,
}

/// `width` bits at bit `offset` of the current item(s); `offset_max` is the
/// validator's bound on the offset, `byte_aligned` whether it is a multiple
/// of 8.
pub(super) fn item_bits(
    fx: &mut Fx,
    stream: &Stream,
    offset: Val,
    width: u8,
    offset_max: u64,
    byte_aligned: bool,
) -> Val {
    let width = u32::from(width);
    let dynamic = |fx: &mut Fx, item, at| {
        if byte_aligned {
            read_aligned(fx, item, at, width)
        } else {
            read_dynamic(fx, item, at, width, offset_max, stream.readable)
        }
    };
    match (stream.items, offset) {
        (Items::One(item), Val::Const(k)) => {
            Val::Uniform(read_fixed(fx, item, known_u32(k), width, stream.readable))
        }
        (Items::One(item), Val::Uniform(at)) => Val::Uniform(dynamic(fx, item, at)),
        (Items::One(item), Val::Lanes(ks)) => {
            let offsets = ks.map(known_u32);
            let fields = LaneFields {
                item,
                offsets,
                width,
                readable: stream.readable,
            };
            let v = consecutive(fx, fields)
                .or_else(|| window(fx, fields))
                .unwrap_or_else(|| {
                    fx.build(Scalar::U32, |fx, k| {
                        read_fixed(fx, item, offsets[k], width, stream.readable)
                    })
                });
            Val::Vector(v)
        }
        (Items::Lanes(items), Val::Const(k)) => {
            let bit = known_u32(k);
            let v = gathered(fx, items, bit, width, stream.readable).unwrap_or_else(|| {
                fx.build(Scalar::U32, |fx, k| {
                    read_fixed(fx, items[k], bit, width, stream.readable)
                })
            });
            Val::Vector(v)
        }
        (items, offset) => Val::Vector(fx.build(Scalar::U32, |fx, k| {
            let item = match items {
                Items::One(item) => item,
                Items::Lanes(items) => items[k],
            };
            let at = fx.lane(offset, k, Scalar::U32);
            dynamic(fx, item, at)
        })),
    }
}

/// `len` (1..=8) bytes at `item + start`, little-endian, as an i32 (len <= 4)
/// or i64.
fn load(fx: &mut Fx, item: ir::Value, start: u32, len: u32) -> ir::Value {
    let at = start as i32;
    let ins = fx.b.ins();
    match len {
        1 => ins.uload8(types::I32, stream(), item, at),
        2 => ins.uload16(types::I32, stream(), item, at),
        4 => ins.load(types::I32, stream(), item, at),
        8 => ins.load(types::I64, stream(), item, at),
        3 => {
            let low = ins.uload16(types::I32, stream(), item, at);
            let high = fx.b.ins().uload8(types::I32, stream(), item, at + 2);
            let high = fx.b.ins().ishl_imm_u(high, 16);
            fx.b.ins().bor(low, high)
        }
        _ => {
            let low = ins.load(types::I32, stream(), item, at);
            let low = fx.b.ins().uextend(types::I64, low);
            let high = load(fx, item, start + 4, len - 4);
            let high = fx.b.ins().uextend(types::I64, high);
            let high = fx.b.ins().ishl_imm_u(high, 32);
            fx.b.ins().bor(low, high)
        }
    }
}

/// Bits `shift..shift + width` of `raw` (an i32 or i64 holding `bytes` loaded
/// bytes) as an i32.
fn extract(fx: &mut Fx, raw: ir::Value, bytes: u32, shift: u32, width: u32) -> ir::Value {
    let mut v = raw;
    if shift > 0 {
        v = fx.b.ins().ushr_imm_u(v, i64::from(shift));
    }
    if bytes > 4 {
        v = fx.b.ins().ireduce(types::I32, v);
    }
    if 8 * bytes - shift > width {
        v = fx.b.ins().band_imm_u(v, i64::from(mask(width)));
    }
    v
}

fn mask(width: u32) -> u32 {
    u32::MAX >> (32 - width)
}

/// The `(start, len)` byte window holding `need` bytes from `byte`, inside
/// `readable`: a whole power-of-two load where there is room, slid back if
/// it would pass the end.
fn fixed_window(byte: u32, need: u32, readable: u32) -> (u32, u32) {
    let wide = need.next_power_of_two();
    if wide <= readable {
        (byte.min(readable - wide), wide)
    } else {
        (byte, need)
    }
}

fn read_fixed(fx: &mut Fx, item: ir::Value, bit: u32, width: u32, readable: u32) -> ir::Value {
    let (byte, shift) = (bit / 8, bit % 8);
    let (start, len) = fixed_window(byte, (shift + width).div_ceil(8), readable);
    let raw = load(fx, item, start, len);
    extract(fx, raw, len, shift + 8 * (byte - start), width)
}

/// A field at a runtime bit offset that is a multiple of 8: exactly its own
/// bytes, which are inside the item.
fn read_aligned(fx: &mut Fx, item: ir::Value, at: ir::Value, width: u32) -> ir::Value {
    let byte = fx.b.ins().ushr_imm_u(at, 3);
    let byte = fx.b.ins().uextend(types::I64, byte);
    let address = fx.b.ins().iadd(item, byte);
    let len = width.div_ceil(8);
    let raw = load(fx, address, 0, len);
    extract(fx, raw, len, 0, width)
}

fn read_dynamic(
    fx: &mut Fx,
    item: ir::Value,
    at: ir::Value,
    width: u32,
    offset_max: u64,
    readable: u32,
) -> ir::Value {
    // Up to 7 bits of shift in the first byte.
    let need = (7 + width).div_ceil(8);
    let wide = need.next_power_of_two();
    let byte = fx.b.ins().ushr_imm_u(at, 3);
    let byte = fx.b.ins().uextend(types::I64, byte);
    let shift = fx.b.ins().band_imm_u(at, 7);
    let (raw, shift, bytes) = if offset_max / 8 + u64::from(wide) <= u64::from(readable) {
        let address = fx.b.ins().iadd(item, byte);
        (load(fx, address, 0, wide), shift, wide)
    } else if wide <= readable {
        let last = fx.b.ins().iconst(types::I64, i64::from(readable - wide));
        let start = fx.b.ins().umin(byte, last);
        let address = fx.b.ins().iadd(item, start);
        let raw = load(fx, address, 0, wide);
        let moved = fx.b.ins().isub(byte, start);
        let moved = fx.b.ins().ireduce(types::I32, moved);
        let moved = fx.b.ins().ishl_imm_u(moved, 3);
        (raw, fx.b.ins().iadd(shift, moved), wide)
    } else {
        // An item shorter than one load: byte by byte, each clamped into it
        // (bytes past the field are masked off).
        let last = fx.b.ins().iconst(types::I64, i64::from(readable - 1));
        let mut raw = fx.b.ins().iconst(types::I64, 0);
        for j in 0..need {
            let at = fx.b.ins().iadd_imm_u(byte, i64::from(j));
            let at = fx.b.ins().umin(at, last);
            let address = fx.b.ins().iadd(item, at);
            let b = fx.b.ins().uload8(types::I64, stream(), address, 0);
            let b = fx.b.ins().ishl_imm_u(b, i64::from(8 * j));
            raw = fx.b.ins().bor(raw, b);
        }
        (raw, shift, 8)
    };
    let v = if bytes > 4 {
        let shift = fx.b.ins().uextend(types::I64, shift);
        let v = fx.b.ins().ushr(raw, shift);
        fx.b.ins().ireduce(types::I32, v)
    } else {
        fx.b.ins().ushr(raw, shift)
    };
    fx.b.ins().band_imm_u(v, i64::from(mask(width)))
}

/// Score lanes: the aligned 32-bit word holding the field, gathered across
/// the lanes' items once per loop body and shared by every field in it. Where
/// the word's 16-byte chunk is readable, the four lanes' chunks are loaded
/// whole and transposed (4 loads and 8 unpacks give 4 words); otherwise the
/// word is inserted lane by lane.
fn gathered(
    fx: &mut Fx,
    items: [ir::Value; LANES],
    bit: u32,
    width: u32,
    readable: u32,
) -> Option<ir::Value> {
    let word = bit / 32 * 4;
    let shift = bit % 32;
    if shift + width > 32 || word + 4 > readable {
        return None;
    }
    if !fx.cached.words.contains_key(&word) {
        let chunk = word / 16 * 16;
        if chunk + 16 <= readable {
            let rows = items.map(|item| {
                let v = fx.b.ins().load(types::I32X4, stream(), item, chunk as i32);
                bytes(fx, v)
            });
            let [w0, w1, w2, w3] = transpose(fx, rows);
            for (k, w) in [w0, w1, w2, w3].into_iter().enumerate() {
                let w = fx.b.ins().bitcast(types::I32X4, little(), w);
                fx.cached.words.insert(chunk + 4 * k as u32, w);
            }
        } else {
            // f32 lanes: x64 inserts a lane straight from memory (insertps).
            let v = fx.build(Scalar::F32, |fx, k| {
                fx.b.ins().load(types::F32, stream(), items[k], word as i32)
            });
            let v = fx.b.ins().bitcast(types::I32X4, little(), v);
            fx.cached.words.insert(word, v);
        }
    }
    let mut v = fx.cached.words[&word];
    if shift > 0 {
        let amount = fx.iconst(shift);
        v = fx.b.ins().ushr(v, amount);
    }
    if shift + width < 32 {
        let m = fx.vector(Val::Const(Known::U32(mask(width))), Scalar::U32);
        let masked = fx.b.ins().band(v, m);
        fx.low_bits.insert(masked, (v, width));
        v = masked;
    }
    Some(v)
}

fn little() -> ir::MemFlagsData {
    ir::MemFlagsData::new().with_endianness(ir::Endianness::Little)
}

fn bytes(fx: &mut Fx, v: ir::Value) -> ir::Value {
    fx.b.ins().bitcast(types::I8X16, little(), v)
}

/// Rows of four 32-bit words -> columns, with x64's unpack shuffles.
fn transpose(fx: &mut Fx, [r0, r1, r2, r3]: [ir::Value; 4]) -> [ir::Value; 4] {
    // Byte masks (little-endian u128) of punpckldq, punpckhdq, punpcklqdq, punpckhqdq.
    const LOW32: u128 = 0x1716_1514_0706_0504_1312_1110_0302_0100;
    const HIGH32: u128 = 0x1f1e_1d1c_0f0e_0d0c_1b1a_1918_0b0a_0908;
    const LOW64: u128 = 0x1716_1514_1312_1110_0706_0504_0302_0100;
    const HIGH64: u128 = 0x1f1e_1d1c_1b1a_1918_0f0e_0d0c_0b0a_0908;
    let mut shuffle = |a, b, mask: u128| {
        let mask =
            fx.b.func
                .dfg
                .immediates
                .push(mask.to_le_bytes().to_vec().into());
        fx.b.ins().shuffle(a, b, mask)
    };
    let (t0, t1) = (shuffle(r0, r1, LOW32), shuffle(r2, r3, LOW32));
    let (t2, t3) = (shuffle(r0, r1, HIGH32), shuffle(r2, r3, HIGH32));
    [
        shuffle(t0, t1, LOW64),
        shuffle(t0, t1, HIGH64),
        shuffle(t2, t3, LOW64),
        shuffle(t2, t3, HIGH64),
    ]
}

/// One field per accumulate lane: `width` bits at `offsets` of the item at
/// `item`, of which `readable` bytes may be loaded.
#[derive(Clone, Copy)]
struct LaneFields {
    item: ir::Value,
    offsets: [u32; LANES],
    width: u32,
    readable: u32,
}

/// Accumulate lanes: fields `o, o+w, o+2w, o+3w` of a byte-aligned 8-, 16- or
/// 32-bit width as one widening load.
fn consecutive(fx: &mut Fx, fields: LaneFields) -> Option<ir::Value> {
    let LaneFields {
        item,
        offsets,
        width,
        readable,
    } = fields;
    let first = offsets[0];
    let consecutive = offsets
        .iter()
        .enumerate()
        .all(|(k, &o)| o == first + k as u32 * width);
    let byte = first / 8;
    if !consecutive || !first.is_multiple_of(8) || byte + LANES as u32 * width / 8 > readable {
        return None;
    }
    let at = byte as i32;
    let ins = fx.b.ins();
    Some(match width {
        8 => {
            let word = ins.load(types::I32, stream(), item, at);
            let v = fx.b.ins().scalar_to_vector(types::I32X4, word);
            let v = bytes(fx, v);
            let v = fx.b.ins().uwiden_low(v);
            fx.b.ins().uwiden_low(v)
        }
        16 => ins.uload16x4(stream(), item, at),
        32 => ins.load(types::I32X4, stream(), item, at),
        _ => return None,
    })
}

/// Accumulate lanes: fields inside one 32-bit window: one load, splat, keep
/// each lane's field, multiply each up to the highest lane's position, and
/// one shift down.
fn window(fx: &mut Fx, fields: LaneFields) -> Option<ir::Value> {
    let (offsets, width) = (fields.offsets, fields.width);
    let low = *offsets.iter().min()?;
    let high = *offsets.iter().max()? + width;
    let byte = low / 8;
    let need = (high - 8 * byte).div_ceil(8);
    if need > 4 {
        return None;
    }
    let (start, len) = fixed_window(byte, need, fields.readable);
    let shifts = offsets.map(|o| o - 8 * start);
    let top = *shifts.iter().max()?;
    if top + width > 32 {
        return None;
    }
    let raw = load(fx, fields.item, start, len);
    let v = fx.vector(Val::Uniform(raw), Scalar::U32);
    let u32s = |xs: [u32; LANES]| Val::Lanes(xs.map(Known::U32));
    let masks = fx.vector(u32s(shifts.map(|s| mask(width) << s)), Scalar::U32);
    let v = fx.b.ins().band(v, masks);
    let factors = fx.vector(u32s(shifts.map(|s| 1 << (top - s))), Scalar::U32);
    let v = fx.b.ins().imul(v, factors);
    let top = fx.iconst(top);
    Some(fx.b.ins().ushr(v, top))
}
