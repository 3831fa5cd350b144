//! Writing fields into an item: the inverse of the IR's `ItemBits` read.

/// Writes the low `width` bits of `value` at bit `offset` of `bytes`,
/// LSB-first little-endian (the layout's bit order).
pub fn write_bits(bytes: &mut [u8], offset: u32, width: u32, value: u32) {
    let value = u64::from(value) & ((1u64 << width) - 1);
    for bit in 0..width {
        let at = offset + bit;
        let byte = &mut bytes[(at / 8) as usize];
        let mask = 1u8 << (at % 8);
        if (value >> bit) & 1 == 1 {
            *byte |= mask;
        } else {
            *byte &= !mask;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::write_bits;
    use kvcc_compiler::back::interp::read_bits;

    #[test]
    fn writes_read_back_at_every_offset_and_width() {
        for width in 1..=32u32 {
            for offset in 0..17u32 {
                let mut bytes = vec![0xA5u8; 8];
                let value = 0xDEAD_BEEFu32 & (u32::MAX >> (32 - width));
                write_bits(&mut bytes, offset, width, value);
                assert_eq!(
                    read_bits(&bytes, offset, width),
                    value,
                    "offset {offset} width {width}"
                );
                if offset > 0 {
                    assert_eq!(
                        read_bits(&bytes, 0, offset.min(8)),
                        0xA5 & ((1 << offset.min(8)) - 1)
                    );
                }
            }
        }
    }
}
