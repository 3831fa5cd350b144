//! The item bit order: item bit `i` is bit `i % 8` of byte `i / 8` (LSB-first,
//! little-endian). Every reader and writer of items goes through here or
//! through [`WordSplit`], which places an element in 64-bit words.

/// `width` bits (1..=32) at `offset` of `bytes`; bytes past the end read as zero.
pub fn read_bits(bytes: &[u8], offset: u32, width: u32) -> u32 {
    let first = (offset / 8) as usize;
    let shift = offset % 8;
    let mut word = 0u64;
    for k in 0..5 {
        word |= u64::from(bytes.get(first + k).copied().unwrap_or(0)) << (8 * k);
    }
    ((word >> shift) & ((1u64 << width) - 1)) as u32
}

/// Writes the low `width` bits (1..=32) of `value` at bit `offset` of `bytes`.
pub fn write_bits(bytes: &mut [u8], offset: u32, width: u32, value: u32) {
    let value = u64::from(value) & mask(width);
    for bit in 0..width {
        let at = offset + bit;
        let byte = &mut bytes[(at / 8) as usize];
        let flag = 1u8 << (at % 8);
        if (value >> bit) & 1 == 1 {
            *byte |= flag;
        } else {
            *byte &= !flag;
        }
    }
}

/// The low `width` bits set.
pub fn mask(width: u32) -> u64 {
    (1u64 << width) - 1
}

/// Where an element lies in an item read as little-endian 64-bit words: word
/// `word` from bit `shift`, spilling into the next word when it crosses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WordSplit {
    pub word: u32,
    pub shift: u32,
    pub width: u32,
}

impl WordSplit {
    pub fn new(offset: u32, width: u32) -> WordSplit {
        WordSplit {
            word: offset / 64,
            shift: offset % 64,
            width,
        }
    }

    /// Bits of the element in the next word: it is shifted right by
    /// `64 - shift` there (`None` when it fits in `word`).
    pub fn spill(&self) -> Option<u32> {
        (self.shift + self.width > 64).then(|| 64 - self.shift)
    }
}

/// 64-bit words an item of `bytes` bytes spans.
pub fn words(bytes: u32) -> u32 {
    bytes.div_ceil(8)
}

#[cfg(test)]
mod tests {
    use super::{read_bits, write_bits, WordSplit};

    #[test]
    fn bits_are_little_endian_lsb_first() {
        let bytes = [0b1010_1100u8, 0b0000_0011, 0xFF];
        assert_eq!(read_bits(&bytes, 0, 4), 0b1100);
        assert_eq!(read_bits(&bytes, 4, 6), 0b11_1010);
        assert_eq!(read_bits(&bytes, 0, 24), 0xFF03AC);
        assert_eq!(
            read_bits(&bytes, 20, 32),
            0xF,
            "bytes past the end read as zero"
        );
    }

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

    #[test]
    fn word_splits_spill_only_across_words() {
        assert_eq!(WordSplit::new(60, 4).spill(), None);
        assert_eq!(WordSplit::new(60, 8).spill(), Some(4));
        assert_eq!(WordSplit::new(130, 16).word, 2);
    }
}
