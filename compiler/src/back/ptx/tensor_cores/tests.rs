use super::*;

fn score_of(element: Element) -> MmaScore {
    score_with_dims(element, 128)
}

fn score_with_dims(element: Element, key_dims: u32) -> MmaScore {
    let mut arrays = crate::ir::Arena::default();
    MmaScore {
        query: arrays.append(ArrayDecl {
            name: "query".into(),
            len: key_dims,
        }),
        key: element,
        key_scale: None,
        key_zero: None,
        key_bias: None,
        key_dims,
        gathered_runs: None,
    }
}

/// The 16-byte bank group (of eight per 128-byte line) of `byte`.
fn bank_group(byte: u32) -> u32 {
    byte / CHUNK % (BANK_LINE / CHUNK)
}

#[test]
fn padded_rows_put_a_fragment_rows_lanes_and_a_copys_lanes_on_different_banks() {
    for bits in [2, 3, 4] {
        let mut score = score_of(unsigned(bits));
        score.key_scale = Some(0);
        assert!(score.padded_page_queries(), "{bits}-bit keys are padded");
        let (elements, padded) = (score.chunk_elements(), score.padded_chunk_bytes());
        let unpadded: Vec<u32> = (0..ROW_LANES)
            .map(|j| bank_group(4 * elements * j))
            .collect();
        assert!(
            unpadded.iter().all(|&b| b == unpadded[0]),
            "unpadded they conflict"
        );
        for v in 0..elements / 4 {
            let mut banks: Vec<u32> = (0..ROW_LANES)
                .map(|j| bank_group(j * padded + CHUNK * v))
                .collect();
            banks.sort();
            banks.dedup();
            assert_eq!(banks.len() as u32, ROW_LANES, "{bits}-bit vector {v}");
        }
        // A copy's lanes 8q..8q+8 write vectors 8q..8q+8 of the row.
        let per_chunk = elements / 4;
        for quarter in 0..score.key_dims / 4 / 8 {
            let mut banks: Vec<u32> = (8 * quarter..8 * quarter + 8)
                .map(|x| bank_group(x / per_chunk * padded + x % per_chunk * CHUNK))
                .collect();
            banks.sort();
            banks.dedup();
            assert_eq!(
                banks.len(),
                8,
                "{bits}-bit copy, lanes of quarter {quarter}"
            );
        }
    }
    // 8-element chunks (int8 coefficients of 32 dims) do not conflict unpadded.
    let mut narrow = score_with_dims(
        Element::Int {
            bits: 8,
            signed: true,
        },
        32,
    );
    narrow.key_scale = Some(0);
    assert!(!narrow.padded_page_queries());
}

fn unsigned(bits: u32) -> Element {
    Element::Int {
        bits,
        signed: false,
    }
}

/// KIVI's asymmetric keys are a dot product of the query with codes
/// times page scales plus page zero points, the zeros past the scales.
#[test]
fn asymmetric_page_keys_are_recognised() {
    let format = crate::Format::parse(
        include_str!("../../../../../specs/kivi2.toml"),
        "kivi2.toml",
    )
    .expect("the bundled spec");
    for (tier, bits) in format.tiers().iter().zip([2, 3]) {
        let module = tier.module();
        let score = dot_product(&module.key.score).expect("a dot product");
        let code = Element::Int {
            bits,
            signed: false,
        };
        assert_eq!(score.key, code);
        assert_eq!((score.key_scale, score.key_zero), (Some(0), Some(128)));
        assert_eq!(score.key_dims, 128);
    }
}

/// The four lanes of a fragment row hold every key element exactly once,
/// whatever the element width (2-bit rows of 128 dims in 8-byte chunks,
/// of 256 in 16-byte ones), and gathered in one or two runs a lane.
#[test]
fn lanes_of_a_row_cover_every_key_element_once() {
    let gathered = |runs| MmaScore {
        gathered_runs: Some(runs),
        ..score_of(Element::Half)
    };
    for m in [
        score_of(Element::Half),
        score_with_dims(Element::Half, 48),
        score_of(Element::Int {
            bits: 8,
            signed: true,
        }),
        score_of(unsigned(4)),
        score_of(unsigned(2)),
        score_with_dims(unsigned(2), 256),
        score_of(unsigned(3)),
        score_with_dims(unsigned(3), 256),
        gathered(1),
        gathered(2),
    ] {
        let element = m.key;
        let mut seen = vec![0; m.key_dims as usize];
        for quad in 0..ROW_LANES {
            for r in 0..m.key_registers() {
                for e in 0..m.register_elements() {
                    seen[(m.key_element(r, e) + m.chunk_elements() * quad) as usize] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{element:?}: {seen:?}");
    }
}

/// A key row's bits as the IR reads them (element `i` of `bits` at bit
/// `bits · i`, little-endian bytes), split into 32-bit words, each made
/// into fragment registers by the kernel's `(word << shift) & mask`
/// (3-bit codes: each 12-byte chunk transposed and its registers'
/// parts shifted and masked): every register byte is 2^(8 − bits)
/// times the code of the element [`MmaScore::key_element`] names.
#[test]
fn code_registers_hold_the_elements_key_element_names() {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut random = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    fn permute(a: u32, b: u32, selector: u32) -> u32 {
        let bytes = [a.to_le_bytes(), b.to_le_bytes()].concat();
        (0..4).fold(0, |x, n| {
            x | u32::from(bytes[((selector >> (4 * n)) & 7) as usize]) << (8 * n)
        })
    }
    for (bits, dims) in [(2, 128), (2, 256), (3, 128), (3, 256), (4, 128), (8, 128)] {
        let m = score_with_dims(unsigned(bits), dims);
        let codes: Vec<u32> = (0..dims)
            .map(|_| (random() as u32) & ((1 << bits) - 1))
            .collect();
        let mut row = vec![0u8; m.row_bytes() as usize];
        for (i, &code) in codes.iter().enumerate() {
            let bit = bits as usize * i;
            let placed = code << (bit % 8);
            row[bit / 8] |= placed as u8;
            if placed > 0xFF {
                row[bit / 8 + 1] |= (placed >> 8) as u8;
            }
        }
        let chunk = m.chunk_bytes() as usize;
        for quad in 0..ROW_LANES {
            // The lane's chunks, quad + 4 · c, word by word.
            let chunks = (0..m.lane_chunks()).map(|c| {
                let at = chunk * (quad + ROW_LANES * c) as usize;
                row[at..at + chunk]
                    .chunks(4)
                    .map(|w| u32::from_le_bytes(w.try_into().unwrap()))
                    .collect::<Vec<_>>()
            });
            let registers = chunks.flat_map(|words| match bits {
                3 => {
                    let transposed = TRIPLET_SELECTORS.map(|(first, second)| {
                        permute(permute(words[0], words[1], first), words[2], second)
                    });
                    (0..8)
                        .map(|j| {
                            triplet_register(j).iter().fold(0, |x, &(b, shift, mask)| {
                                let w = transposed[b];
                                let w = match shift {
                                    s if s >= 0 => w << s,
                                    s => w >> -s,
                                };
                                x | (w & mask)
                            })
                        })
                        .collect::<Vec<_>>()
                }
                _ => (words.iter())
                    .flat_map(|&w| {
                        (0..8 / bits).map(move |j| {
                            let (shift, mask) = code_register(bits, j);
                            (w << shift) & mask
                        })
                    })
                    .collect(),
            });
            let mut count = 0;
            for (r, register) in registers.enumerate() {
                for e in 0..4 {
                    let dim = m.key_element(r as u32, e) + m.chunk_elements() * quad;
                    let byte = (register >> (8 * e)) & 0xFF;
                    assert_eq!(
                        byte,
                        codes[dim as usize] << (8 - bits),
                        "{bits}-bit, {dims} dims: lane {quad}, register {r}, byte {e}"
                    );
                }
                count += 1;
            }
            assert_eq!(count, m.key_registers(), "{bits}-bit, {dims} dims");
        }
    }
}

/// Asymmetric keys with values that qualify score on the tensor cores:
/// 2-bit codes in 8-byte chunks, 3-bit codes in 12-byte ones, the zero
/// points past the scales.
#[test]
fn plan_admits_asymmetric_keys_of_every_width() {
    let format = crate::Format::parse(
        include_str!("../../../../../tests/in/tensor-cores/asymmetric_keys.toml"),
        "asymmetric_keys.toml",
    )
    .expect("the test spec");
    let tile_items = 64;
    let mut served = Vec::new();
    for tier in format.tiers() {
        let module = tier.module();
        let layout = &module.layout;
        let mut key = Stream::new(layout.key_stream_offset, layout.key.stride, false);
        let mut value = Stream::new(layout.value_stream_offset, layout.value.stride, false);
        key.buffer_offset = layout.header_bytes;
        value.buffer_offset = key.buffer_offset + key.capacity(tile_items);
        let m = plan(module, 4, tile_items, &key, &value, true).expect("values qualify");
        served.push((m.score.as_ref()).map(|s| (s.key, s.key_scale, s.key_zero, s.chunk_bytes())));
    }
    assert_eq!(
        served,
        [
            Some((unsigned(2), Some(0), Some(128), 8)),
            Some((unsigned(4), Some(0), Some(128), 16)),
            Some((unsigned(8), Some(0), Some(128), 16)),
            Some((unsigned(3), Some(0), Some(128), 12)),
        ]
    );
}

/// Unsigned value codes enter the tensor cores as f16 subnormals;
/// signed (KIVI) and page-scaled (subspace) ones as 1024 + code.
#[test]
fn unsigned_value_codes_enter_as_subnormals() {
    let subnormal = |source: &str| -> Vec<bool> {
        let format = crate::Format::parse(source, "spec.toml").expect("the bundled spec");
        (format.tiers().iter())
            .map(|tier| {
                let module = tier.module();
                let layout = &module.layout;
                let mut key = Stream::new(layout.key_stream_offset, layout.key.stride, false);
                let mut value = Stream::new(layout.value_stream_offset, layout.value.stride, false);
                key.buffer_offset = layout.header_bytes;
                value.buffer_offset = key.buffer_offset + key.capacity(64);
                let m = plan(module, 4, 64, &key, &value, true).expect("values qualify");
                m.subnormal_codes()
            })
            .collect()
    };
    assert_eq!(
        subnormal(include_str!("../../../../../specs/kivi2.toml")),
        [true; 2]
    );
    assert_eq!(
        subnormal(include_str!("../../../../../specs/kivi.toml")),
        [false; 2]
    );
    assert_eq!(
        subnormal(include_str!("../../../../../specs/subspace.toml")),
        [false]
    );
}

/// Every code of a byte enters at bit 4 or above where it still fits
/// f16's 10-bit mantissa (8-bit codes fill it from bit 0), moved by 0 or 4.
#[test]
fn subnormal_codes_sit_high_in_the_mantissa() {
    for bits in [2, 3, 4, 8] {
        for c in 0..32 {
            let shift = code_shift(c, bits);
            let lifted = subnormal_shift(shift, bits);
            assert!(lifted + bits <= 10, "{bits}-bit channel {c} at {lifted}");
            assert!(
                lifted >= 4 || bits == 8,
                "{bits}-bit channel {c} at {lifted}"
            );
            assert!([0, SUBNORMAL_LIFT].contains(&(lifted - shift)));
        }
    }
}

/// Vector codebooks stored f16 are looked up by the fragment loads,
/// whatever their code width, codeword length or books, copied across
/// the banks where one load reads a codeword and the copies fit; f32
/// books (not exact f16 operands) leave the tier's values per thread.
#[test]
fn f16_codebook_values_are_looked_up() {
    let lookups = |source: &str| {
        let format = crate::Format::parse(source, "vq.toml").expect("the test spec");
        (format.tiers().iter())
            .map(|tier| {
                let module = tier.module();
                let layout = &module.layout;
                let tile_items = 64;
                let mut key = Stream::new(layout.key_stream_offset, layout.key.stride, false);
                let mut value = Stream::new(layout.value_stream_offset, layout.value.stride, false);
                key.buffer_offset = layout.header_bytes;
                value.buffer_offset = key.buffer_offset + key.capacity(tile_items);
                let m = plan(module, 4, tile_items, &key, &value, true)?;
                let l = m.value_rows.lookup?;
                assert_eq!(m.channel.element, Element::Half);
                assert!(!m.value_rows.staged && !m.value_rows.as_stored());
                assert_eq!(m.staging_bytes(tile_items), 0);
                Some((
                    (l.groups, l.group_size, l.bits, l.book_stride),
                    (l.lane_codes(), l.code_lanes(), l.bank_copies()),
                ))
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        lookups(include_str!(
            "../../../../../tests/in/tensor-cores/vq-values.toml"
        )),
        [
            // 16-byte codewords: a copy for each of a phase's 8 lanes.
            Some(((16, 8, 4, 16 * 8), (2, 1, 8))),
            // 4-byte codewords: 32 copies of 256 codewords fill the budget.
            Some(((64, 2, 8, 0), (8, 1, 32))),
            // 32-byte codewords take two loads: not copied.
            Some(((8, 16, 4, 0), (1, 1, 1))),
            // Two lane groups read halves of a 64-byte codeword.
            Some(((4, 32, 8, 0), (1, 2, 1))),
        ]
    );
    assert_eq!(
        lookups(include_str!("../../../../../specs/shard.toml")),
        [Some(((32, 4, 8, 0), (4, 1, 16)))]
    );
    let f32_books = "name = \"vq\"\nhead_dim = 128\n[page]\nitems = 64\n[[tier]]\nname = \"t\"\n\
         key.field = [{ kind = \"dense\", dtype = \"f16\" }]\n\
         value.field = [{ kind = \"codebook\", group_size = 4, bits = 8, codewords = \"vector\", dtype = \"f32\" }]\n";
    assert_eq!(lookups(f32_books), [None]);
}

/// A windowed lane group's codes (3-bit, 12 and 24 bits a lane group):
/// lane group `r`'s start at bit `r · lane_bits` of its group, one
/// funnel shift of the one or two words holding them brings them to bit
/// 0, and [`window_channel`]'s byte permute and shift give each channel
/// of two tokens in the halves.
#[test]
fn windowed_value_codes_reach_their_halves() {
    fn permute(a: u32, b: u32, selector: u32) -> u32 {
        let bytes = [a.to_le_bytes(), b.to_le_bytes()].concat();
        (0..4).fold(0, |x, n| {
            x | u32::from(bytes[((selector >> (4 * n)) & 7) as usize]) << (8 * n)
        })
    }
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut random = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 32) as u32
    };
    let element = unsigned(3);
    for size in [32, 64] {
        let groups = ValueGroups {
            size,
            scale: 0,
            zero: None,
        };
        assert!(groups.windowed(element));
        let lane_bits = groups.lane_bits(element);
        let per_group = lane_bits / 3;
        // Two tokens' codes of one group, packed little-endian into words.
        let codes: [Vec<u32>; 2] = [0, 1].map(|_| (0..size).map(|_| random() & 7).collect());
        let words = codes.clone().map(|codes| {
            let mut words = vec![0u32; (size * 3 / 32) as usize];
            for (i, &code) in codes.iter().enumerate() {
                let bit = 3 * i;
                let wide = u64::from(code) << (bit % 32);
                words[bit / 32] |= wide as u32;
                if wide >> 32 != 0 {
                    words[bit / 32 + 1] |= (wide >> 32) as u32;
                }
            }
            words
        });
        for row in 0..8 {
            let first = row * lane_bits;
            let (word, shift) = ((first / 32) as usize, first % 32);
            let next = usize::from(shift + lane_bits > 32);
            let window = |w: &Vec<u32>| {
                let wide = u64::from(w[word]) | u64::from(w[word + next]) << 32;
                (wide >> shift) as u32
            };
            let (first_token, second_token) = (window(&words[0]), window(&words[1]));
            for c in 0..per_group {
                let (selector, shift) = window_channel(c, 3);
                assert!(shift + 3 <= 10);
                let x = permute(first_token, second_token, selector);
                let channel = (per_group * row + c) as usize;
                assert_eq!(
                    [(x >> shift) & 7, (x >> (16 + shift)) & 7],
                    [codes[0][channel], codes[1][channel]],
                    "groups of {size}: lane group {row}, channel {c}"
                );
            }
        }
    }
}
