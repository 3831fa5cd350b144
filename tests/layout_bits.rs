//! Exact bit layouts: hand-built tiny specs, hand-chosen vectors, and the exact
//! bytes `encode_page` writes (header, key stream, value stream), plus the
//! layout numbers (strides, header size, stream offsets, page size).
//!
//! Layout rules under test (see `compiler/src/layout.rs`, `compiler/src/page.rs`):
//! fields are packed in listed order, LSB-first little-endian; key and value
//! streams are separate, each starting on a 16-byte boundary; the header is
//! `u32 tier, u32 count, u32 flags, u32 reserved`, then one f32 per scale slot
//! (key codec's first), zero-padded to 16; a page is a multiple of 128 bytes.

mod common;

use half::f16;
use kvcc::compiler::layout::{FieldLayout, TierLayout};
use kvcc::compiler::Format;
use kvcc::runtime::encode::{decode_page, encode_page};

fn compile(src: &str) -> Format {
    Format::parse(src, "test.toml").unwrap_or_else(|e| panic!("spec does not compile: {e}\n{src}"))
}

/// Encodes `keys`/`values` (`[token][head_dim]`) into a fresh page of tier `tier`.
fn encode(
    format: &Format,
    tier: usize,
    tables: &[Vec<f32>],
    keys: &[f32],
    values: &[f32],
) -> Vec<u8> {
    let layout = format.layout(tier);
    // Pre-fill with garbage: the encoder must zero what it does not write.
    let mut page = vec![0xEEu8; layout.page_bytes as usize];
    encode_page(layout, tables, keys, values, &mut page).expect("encode_page");
    page
}

fn key_stream<'a>(layout: &TierLayout, page: &'a [u8]) -> &'a [u8] {
    let start = layout.key_stream_offset as usize;
    &page[start..start + (layout.items_per_page * layout.key.stride) as usize]
}

fn value_stream<'a>(layout: &TierLayout, page: &'a [u8]) -> &'a [u8] {
    let start = layout.value_stream_offset as usize;
    &page[start..start + (layout.items_per_page * layout.value.stride) as usize]
}

/// The exact header bytes: tier, count, flags 0, reserved 0, the f32 slots,
/// zeros up to `header_bytes`.
fn expected_header(layout: &TierLayout, count: u32, slots: &[f32]) -> Vec<u8> {
    let mut h = Vec::new();
    h.extend_from_slice(&layout.index.to_le_bytes());
    h.extend_from_slice(&count.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    for s in slots {
        h.extend_from_slice(&s.to_le_bytes());
    }
    h.resize(layout.header_bytes as usize, 0);
    h
}

fn f16_bytes(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect()
}

/// Checks the generic layout arithmetic of every tier of a format.
fn assert_layout_rules(format: &Format) {
    for t in 0..format.tiers().len() {
        let l = format.layout(t);
        let what = format!("{} tier {t}", format.name());
        assert_eq!(
            l.key.stride,
            l.key.bits.div_ceil(8),
            "{what}: key stride = ceil(bits/8)"
        );
        assert_eq!(
            l.value.stride,
            l.value.bits.div_ceil(8),
            "{what}: value stride = ceil(bits/8)"
        );
        assert_eq!(
            l.header_bytes,
            (16 + 4 * l.header_slots).div_ceil(16) * 16,
            "{what}: header bytes"
        );
        assert_eq!(
            l.key_stream_offset, l.header_bytes,
            "{what}: key stream follows the header"
        );
        assert_eq!(l.key_stream_offset % 16, 0, "{what}: key stream aligned");
        assert_eq!(
            l.value_stream_offset % 16,
            0,
            "{what}: value stream aligned"
        );
        assert_eq!(
            l.value_stream_offset,
            l.key_stream_offset + (l.items_per_page * l.key.stride).div_ceil(16) * 16,
            "{what}: value stream offset"
        );
        assert_eq!(l.page_bytes % 128, 0, "{what}: page bytes multiple of 128");
        assert!(
            l.page_bytes >= l.value_stream_offset + l.items_per_page * l.value.stride,
            "{what}: page holds both streams"
        );
        assert!(
            l.page_bytes - (l.value_stream_offset + l.items_per_page * l.value.stride) < 128,
            "{what}: page minimal"
        );
    }
}

const DENSE: &str = r#"
name = "dense8"
head_dim = 8
[page]
items = 4
[[tier]]
name = "f16"
key.field = [{ kind = "dense", dtype = "f16" }]
value.field = [{ kind = "dense", dtype = "f16" }]
"#;

#[test]
fn dense_f16_is_little_endian_f16_in_order() {
    let format = compile(DENSE);
    let l = format.layout(0);
    assert_layout_rules(&format);
    assert_eq!((l.key.bits, l.key.stride, l.value.stride), (128, 16, 16));
    assert_eq!((l.header_slots, l.header_bytes), (0, 16));
    assert_eq!((l.key_stream_offset, l.value_stream_offset), (16, 80));
    assert_eq!(l.page_bytes, 256, "16 + 64 + 64 = 144 -> 256");
    assert_eq!(l.tables.len(), 0);

    // 3 tokens: a partial page; the 4th slot of each stream stays zero.
    let keys: Vec<f32> = (0..24).map(|i| i as f32 * 0.25 - 3.0).collect();
    let values: Vec<f32> = (0..24).map(|i| 1.0 / (i as f32 + 1.0)).collect();
    let page = encode(&format, 0, &[], &keys, &values);
    assert_eq!(&page[..16], &expected_header(l, 3, &[])[..], "header");
    assert_eq!(
        &page[..16],
        &[0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        "header bytes literally"
    );
    let mut want_k = f16_bytes(&keys);
    want_k.resize(64, 0);
    assert_eq!(key_stream(l, &page), &want_k[..], "key stream");
    let mut want_v = f16_bytes(&values);
    want_v.resize(64, 0);
    assert_eq!(value_stream(l, &page), &want_v[..], "value stream");
    // A couple of bytes spelled out: -3.0 = 0xC200, -2.75 = 0xC180; 1.0 = 0x3C00, 0.5 = 0x3800.
    assert_eq!(&page[16..20], &[0x00, 0xC2, 0x80, 0xC1]);
    assert_eq!(&page[80..84], &[0x00, 0x3C, 0x00, 0x38]);
    // Everything after the value stream is padding zeros.
    assert!(
        page[144..].iter().all(|&b| b == 0),
        "padding after the value stream"
    );
}

const COEFF: &str = r#"
name = "coeff8"
head_dim = 8
[page]
items = 4
[[tier]]
name = "q"
key.field = [{ kind = "coeff", bits = 4, scale = "page" }]
value.field = [{ kind = "coeff", bits = 8, scale = "item" }]
"#;

#[test]
fn coeff_int4_page_scale_and_int8_item_scale() {
    let format = compile(COEFF);
    let l = format.layout(0);
    assert_layout_rules(&format);
    // Key: 8 x 4 bits; value: 16-bit f16 item scale, then 8 x 8 bits.
    assert_eq!((l.key.bits, l.key.stride), (32, 4));
    assert_eq!((l.value.bits, l.value.stride), (80, 10));
    assert!(matches!(
        l.value.fields[0],
        FieldLayout::Coeff {
            item_scale: Some(0),
            offset: 16,
            count: 8,
            bits: 8,
            ..
        }
    ));
    assert_eq!((l.header_slots, l.header_bytes), (1, 32));
    assert_eq!(
        (l.key_stream_offset, l.value_stream_offset),
        (32, 48),
        "4 x 4 = 16 key bytes"
    );
    assert_eq!(l.page_bytes, 128, "48 + 40 = 88 -> 128");

    // Page max |x| = 14 -> scale 2; codes round(x/2) (half away from zero), in [-7, 7].
    #[rustfmt::skip]
    let keys = [
        2.0, -2.0, 14.0, -14.0, 0.0, 6.0, -6.0, 4.0,
        3.0, -3.0, 0.9, -1.1, 13.0, 7.0, -5.0, 8.0,
    ];
    // Token 0: max 127 -> scale 1; token 1: max 63.5 -> scale 0.5.
    #[rustfmt::skip]
    let values = [
        1.0, -1.0, 127.0, -127.0, 0.0, 64.0, -127.0, 2.4,
        0.5, -0.5, 63.5, -63.5, 0.0, 10.0, -0.26, 0.74,
    ];
    let page = encode(&format, 0, &[], &keys, &values);
    assert_eq!(
        &page[..32],
        &expected_header(l, 2, &[2.0])[..],
        "header: one f32 slot = max|x|/7 = 2.0"
    );
    assert_eq!(&page[16..20], &2.0f32.to_le_bytes());

    // Token 0 codes: 1, -1, 7, -7, 0, 3, -3, 2 -> nibbles 1 F 7 9 0 3 D 2 (LSB nibble first).
    // Token 1 codes: round(1.5)=2, -2, round(.45)=0, round(-.55)=-1, round(6.5)=7, round(3.5)=4, round(-2.5)=-3, 4
    //   -> nibbles 2 E 0 F 7 4 D 4.
    #[rustfmt::skip]
    let want_k = [
        0xF1, 0x97, 0x30, 0x2D,
        0xE2, 0xF0, 0x47, 0x4D,
        0, 0, 0, 0, 0, 0, 0, 0,
    ];
    assert_eq!(key_stream(l, &page), &want_k, "int4 key stream");

    // Token 0: scale f16 1.0 = 0x3C00, codes 1, -1, 127, -127, 0, 64, -127, round(2.4)=2.
    // Token 1: scale f16 0.5 = 0x3800, codes 1, -1, 127, -127, 0, 20, round(-0.52)=-1, round(1.48)=1.
    #[rustfmt::skip]
    let want_v = [
        0x00, 0x3C, 0x01, 0xFF, 0x7F, 0x81, 0x00, 0x40, 0x81, 0x02,
        0x00, 0x38, 0x01, 0xFF, 0x7F, 0x81, 0x00, 0x14, 0xFF, 0x01,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    ];
    assert_eq!(
        value_stream(l, &page),
        &want_v,
        "int8 item-scale value stream"
    );

    // The reference decoder reads the same bits back.
    let (k, v) = decode_page(l, &[], &page);
    assert_eq!(&k[..8], &[2.0, -2.0, 14.0, -14.0, 0.0, 6.0, -6.0, 4.0]);
    assert_eq!(&v[..8], &[1.0, -1.0, 127.0, -127.0, 0.0, 64.0, -127.0, 2.0]);
    assert_eq!(&v[8..], &[0.5, -0.5, 63.5, -63.5, 0.0, 10.0, -0.5, 0.5]);
}

#[test]
fn all_zero_items_get_unit_scales() {
    // An all-zero item gets scale 1.0 (never 0) and zero codes.
    let format = compile(COEFF);
    let l = format.layout(0);
    let keys = [0.0f32; 8];
    let values = [0.0f32; 8];
    let page = encode(&format, 0, &[], &keys, &values);
    assert_eq!(
        &page[..32],
        &expected_header(l, 1, &[1.0])[..],
        "all-zero page: scale 1.0, not 0"
    );
    assert_eq!(
        &value_stream(l, &page)[..10],
        &[0x00, 0x3C, 0, 0, 0, 0, 0, 0, 0, 0]
    );
}

/// Radius (3 bits) then direction codebook indices (5 bits), group size 4,
/// head_dim 16: 4 groups -> 12 radius bits at 0..12, 20 index bits at 12..32;
/// codes straddle byte boundaries (radius 2 at bits 6..9, index 0 at 12..17, ...).
const RADIUS: &str = r#"
name = "radius16"
head_dim = 16
[page]
items = 4
[[tier]]
name = "r"
key.field = [
  { kind = "radius", group_size = 4, bits = 3, scale = "page" },
  { kind = "codebook", group_size = 4, bits = 5, codewords = "direction", dtype = "f32" },
]
value.field = [{ kind = "dense", dtype = "f16" }]

[[tier]]
name = "rg"
key.field = [
  { kind = "radius", group_size = 4, bits = 3, scale = "page_group" },
  { kind = "codebook", group_size = 4, bits = 5, codewords = "direction", dtype = "f32" },
]
value.field = [{ kind = "dense", dtype = "f16" }]
"#;

/// 32 distinct unit directions of 4 values: 0..8 are ±e_k (exact), the rest
/// are (a, b, c, d) / norm with small distinct integers.
fn direction_codebook() -> Vec<f32> {
    let mut book = Vec::new();
    for i in 0..8 {
        let mut v = [0.0f32; 4];
        v[i / 2] = if i % 2 == 0 { 1.0 } else { -1.0 };
        book.extend(v);
    }
    for i in 8..32 {
        let raw = [
            (i % 3) as f32 + 1.0,
            -((i % 5) as f32) + 2.0,
            (i % 7) as f32 - 3.0,
            (i / 8) as f32,
        ];
        let norm = raw.iter().map(|v| v * v).sum::<f32>().sqrt();
        book.extend(raw.map(|v| v / norm));
    }
    book
}

/// Packs `(width, value)` fields LSB-first into `bytes` bytes: an independent
/// little-endian bit packer for the expected streams.
fn pack(fields: &[(u32, u64)], bytes: usize) -> Vec<u8> {
    let mut acc: u128 = 0;
    let mut at = 0;
    for &(width, value) in fields {
        assert!(value < 1 << width);
        acc |= u128::from(value) << at;
        at += width;
    }
    assert!(at as usize <= bytes * 8);
    acc.to_le_bytes()[..bytes].to_vec()
}

#[test]
fn radius_then_direction_indices_straddle_bytes() {
    let format = compile(RADIUS);
    assert_layout_rules(&format);
    for tier in 0..2 {
        let l = format.layout(tier);
        assert_eq!((l.key.bits, l.key.stride), (32, 4));
        assert!(matches!(
            l.key.fields[0],
            FieldLayout::Radius {
                offset: 0,
                groups: 4,
                bits: 3,
                slot: 0,
                ..
            }
        ));
        assert!(matches!(
            l.key.fields[1],
            FieldLayout::Codebook {
                offset: 12,
                groups: 4,
                bits: 5,
                table: 0,
                ..
            }
        ));
        assert_eq!(l.tables.len(), 1);
        assert_eq!(l.tables[0].len, 32 * 4, "one shared book of 32 x 4");
        assert_eq!(l.value.stride, 32);
    }
    assert_eq!(
        (format.layout(0).header_slots, format.layout(0).header_bytes),
        (1, 32)
    );
    assert_eq!(
        (format.layout(1).header_slots, format.layout(1).header_bytes),
        (4, 32)
    );
    assert_eq!(format.layout(0).value_stream_offset, 32 + 16);
    assert_eq!(format.layout(0).page_bytes, 256, "48 + 4 x 32 = 176 -> 256");

    let book = direction_codebook();
    let tables = vec![book.clone()];
    // Token t, group j: radius r[t][j] times codeword idx[t][j]; page max radius 7.
    let radii = [[7.0f32, 3.0, 0.0, 5.0], [1.0, 2.0, 6.0, 4.0]];
    let index = [[0u32, 5, 0, 31], [17, 6, 9, 22]];
    let mut keys = Vec::new();
    for t in 0..2 {
        for j in 0..4 {
            let i = index[t][j] as usize;
            keys.extend(book[i * 4..(i + 1) * 4].iter().map(|c| radii[t][j] * c));
        }
    }
    let values: Vec<f32> = (0..32).map(|i| i as f32).collect();

    // Tier "r" (page scale): slot 0 = 7.0, radius codes = round(r / 7 * 7) = r.
    let l = format.layout(0);
    let page = encode(&format, 0, &tables, &keys, &values);
    assert_eq!(&page[..32], &expected_header(l, 2, &[7.0])[..], "header");
    let item = |t: usize, radius_codes: [u64; 4]| {
        let mut fields: Vec<(u32, u64)> = radius_codes.iter().map(|&c| (3, c)).collect();
        fields.extend(index[t].iter().map(|&i| (5, u64::from(i))));
        pack(&fields, 4)
    };
    let want0 = item(0, [7, 3, 0, 5]);
    let want1 = item(1, [1, 2, 6, 4]);
    // Spelled out for token 0: radii 7, 3, 0, 5 at bits 0..3, 3..6, 6..9 (straddles),
    // 9..12 -> bits 0-4, 9, 11 set; indices 0, 5, 0, 31 at bits 12..17 (straddles),
    // 17..22, 22..27 (straddles), 27..32 -> bits 17, 19, 27-31 set.
    assert_eq!(want0, vec![0x1F, 0x0A, 0x0A, 0xF8]);
    let ks = key_stream(l, &page);
    assert_eq!(&ks[0..4], &want0[..], "token 0 key item");
    assert_eq!(&ks[4..8], &want1[..], "token 1 key item");
    assert!(ks[8..].iter().all(|&b| b == 0));
    let mut want_v = f16_bytes(&values);
    want_v.resize(4 * 32, 0);
    assert_eq!(value_stream(l, &page), &want_v[..]);

    // Tier "rg" (page_group scale): slot j = max radius of group j over the page;
    // code = round(r / s_j * 7).
    let l = format.layout(1);
    let page = encode(&format, 1, &tables, &keys, &values);
    let scales = [7.0f32, 3.0, 6.0, 5.0];
    let header = &page[..32];
    assert_eq!(&header[..16], &expected_header(l, 2, &[])[..16]);
    for (j, want) in scales.iter().enumerate() {
        let got = f32::from_le_bytes(header[16 + 4 * j..20 + 4 * j].try_into().unwrap());
        assert!(
            (got - want).abs() <= 1e-5 * want,
            "slot {j}: {got} vs {want}"
        );
    }
    let code = |r: f32, s: f32| u64::from((r / s * 7.0).round() as u32);
    let ks = key_stream(l, &page);
    for t in 0..2 {
        let codes: [u64; 4] = std::array::from_fn(|j| code(radii[t][j], scales[j]));
        assert_eq!(
            &ks[4 * t..4 * t + 4],
            &item(t, codes)[..],
            "page_group token {t}"
        );
    }
}

const BITMAP: &str = r#"
name = "bitmap8"
head_dim = 8
[page]
items = 4
[[tier]]
name = "b"
key.field = [{ kind = "bitmap", group_size = 2, keep = 2, elem = "f16" }]
value.field = [{ kind = "bitmap", group_size = 2, keep = 2, elem = "f16" }]
[[tier]]
name = "b8"
key.field = [{ kind = "bitmap", group_size = 1, keep = 2, elem = "int8" }]
value.field = [{ kind = "dense", dtype = "f16" }]
"#;

#[test]
fn bitmap_mask_then_kept_groups_in_ascending_order() {
    let format = compile(BITMAP);
    let l = format.layout(0);
    assert_layout_rules(&format);
    // 4 mask bits + 2 groups x 2 elems x 16 bits = 68 bits -> 9 bytes.
    assert_eq!((l.key.bits, l.key.stride, l.value.stride), (68, 9, 9));
    assert!(matches!(
        l.key.fields[0],
        FieldLayout::Bitmap {
            mask_offset: 0,
            groups: 4,
            elems_offset: 4,
            item_scale: None,
            ..
        }
    ));
    assert_eq!(
        (l.key_stream_offset, l.value_stream_offset),
        (16, 16 + 48),
        "36 key bytes -> 48"
    );
    assert_eq!(l.page_bytes, 128, "64 + 36 = 100 -> 128");

    // Group energies 0.5, 9, 0, 6.25: keep groups 1 and 3, stored 1 then 3.
    let k0 = [0.5f32, 0.5, 3.0, 0.0, 0.0, 0.0, -2.0, 1.5];
    // Energies 4, 4, 4, 1: ties keep the lower index -> groups 0, 1.
    let k1 = [2.0f32, 0.0, 0.0, -2.0, 0.0, 2.0, 1.0, 0.0];
    // Largest groups listed in descending order in memory: 3 then 0 -> stored 0 then 3.
    let v0 = [-4.0f32, 0.25, 0.0, 0.0, 0.5, 0.0, 8.0, -0.125];
    let v1 = [0.0f32; 8];
    let keys: Vec<f32> = k0.iter().chain(&k1).copied().collect();
    let values: Vec<f32> = v0.iter().chain(&v1).copied().collect();
    let page = encode(&format, 0, &[], &keys, &values);
    assert_eq!(&page[..16], &expected_header(l, 2, &[])[..]);

    let h = |v: f32| u64::from(f16::from_f32(v).to_bits());
    let item = |mask: u64, elems: [f32; 4]| {
        let mut fields = vec![(4, mask)];
        fields.extend(elems.iter().map(|&e| (16, h(e))));
        pack(&fields, 9)
    };
    let want_k0 = item(0b1010, [3.0, 0.0, -2.0, 1.5]);
    // Hand-packed: mask 0xA, then 0x4200, 0x0000, 0xC000, 0x3E00 at bits 4, 20, 36, 52.
    assert_eq!(
        want_k0,
        vec![0x0A, 0x20, 0x04, 0x00, 0x00, 0x00, 0x0C, 0xE0, 0x03]
    );
    let ks = key_stream(l, &page);
    assert_eq!(&ks[0..9], &want_k0[..], "token 0");
    assert_eq!(
        &ks[9..18],
        &item(0b0011, [2.0, 0.0, 0.0, -2.0])[..],
        "token 1 (ties -> lower groups)"
    );
    assert!(ks[18..].iter().all(|&b| b == 0));
    let vs = value_stream(l, &page);
    assert_eq!(
        &vs[0..9],
        &item(0b1001, [-4.0, 0.25, 8.0, -0.125])[..],
        "value token 0"
    );
    // All-zero vector: every energy ties at 0 -> groups 0 and 1.
    assert_eq!(&vs[9..18], &item(0b0011, [0.0; 4])[..], "value token 1");
}

#[test]
fn header_tier_index_and_padding() {
    // Tier 2 of 3: the header's first word is 2; 5 slots pad 36 -> 48 bytes.
    let src = r#"
name = "tiers"
head_dim = 8
[page]
items = 4
[[tier]]
name = "a"
key.field = [{ kind = "dense", dtype = "f32" }]
value.field = [{ kind = "dense", dtype = "bf16" }]
[[tier]]
name = "b"
key.field = [{ kind = "coeff", bits = 8, scale = "page" }]
value.field = [{ kind = "coeff", bits = 8, scale = "page" }]
[[tier]]
name = "c"
key.field = [{ kind = "coeff", bits = 4, scale = "page" }]
value.field = [{ kind = "coeff", bits = 8, scale = "page_component" }]
"#;
    // The value codec of tier c has 8 slots (one per component) after the key's 1.
    let format = compile(src);
    assert_layout_rules(&format);
    let l = format.layout(2);
    assert_eq!(
        (l.header_slots, l.header_bytes),
        (9, 64),
        "16 + 36 = 52 -> 64"
    );
    let l0 = format.layout(0);
    assert_eq!((l0.key.stride, l0.value.stride), (32, 16));
    assert_eq!(
        (l0.key_stream_offset, l0.value_stream_offset, l0.page_bytes),
        (16, 16 + 128, 256)
    );

    let keys = [7.0f32, -7.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0];
    let values = [1.0f32, 2.0, 3.0, 4.0, -5.0, 6.0, 7.0, 127.0];
    let page = encode(&format, 2, &[], &keys, &values);
    let mut slots = vec![1.0f32];
    slots.extend(values.iter().map(|v| v.abs() / 127.0));
    assert_eq!(&page[..64], &expected_header(l, 1, &slots)[..]);
    assert_eq!(&page[..4], &[2, 0, 0, 0], "tier word");
    // Every value code is +-127 with a per-component scale.
    assert_eq!(
        &value_stream(l, &page)[..8],
        &[127, 127, 127, 127, 0x81, 127, 127, 127]
    );

    // Tier a: f32 keys and bf16 values, little-endian.
    let page = encode(&format, 0, &[], &keys, &values);
    let want_k: Vec<u8> = keys.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(&key_stream(l0, &page)[..32], &want_k[..]);
    let want_v: Vec<u8> = values
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    assert_eq!(&value_stream(l0, &page)[..16], &want_v[..]);
}

#[test]
fn bundled_layout_numbers() {
    let formats = common::bundled();
    for format in &formats {
        assert_layout_rules(format);
    }
    let by_name = |name: &str| {
        formats
            .iter()
            .find(|f| f.name() == name)
            .unwrap_or_else(|| panic!("{name} bundled"))
    };
    let spherical = by_name("spherical");
    let strides: Vec<u32> = (0..3).map(|t| spherical.layout(t).key.stride).collect();
    assert_eq!(
        strides,
        vec![14, 12, 6],
        "Spherical KV Table B.1 key bytes (high/mid/low)"
    );
    let bits: Vec<u32> = (0..3).map(|t| spherical.layout(t).key.bits).collect();
    assert_eq!(bits, vec![112, 96, 44]);
    for t in 0..3 {
        let l = spherical.layout(t);
        assert_eq!(l.value.stride, 256);
        assert_eq!((l.header_slots, l.header_bytes), (1, 32));
    }
    // high: 32 + 64 x 14 = 928, + 64 x 256 = 17312 -> 17408.
    assert_eq!(spherical.layout(0).value_stream_offset, 928);
    assert_eq!(spherical.layout(0).page_bytes, 17408);
    // low: 32 + 64 x 6 = 416, + 16384 = 16800 -> 16896.
    assert_eq!(spherical.layout(2).value_stream_offset, 416);
    assert_eq!(spherical.layout(2).page_bytes, 16896);

    let dense = by_name("dense_f16");
    let l = dense.layout(0);
    assert_eq!(
        (l.key.stride, l.value.stride),
        (256, 256),
        "dense f16 at d = 128: 256 + 256 bytes"
    );
    assert_eq!(
        (l.header_bytes, l.key_stream_offset, l.value_stream_offset),
        (16, 16, 16 + 64 * 256)
    );
    assert_eq!(l.page_bytes, (16 + 2 * 64 * 256u32).div_ceil(128) * 128);

    let kivi = by_name("kivi");
    // int8: keys 128 B with 128 page_component slots; values 2 + 128 B.
    assert_eq!(
        (kivi.layout(0).key.stride, kivi.layout(0).value.stride),
        (128, 130)
    );
    assert_eq!(
        (kivi.layout(1).key.stride, kivi.layout(1).value.stride),
        (64, 66)
    );
    assert_eq!(kivi.layout(0).header_bytes, 16 + 4 * 128);

    let mosaic = by_name("mosaic");
    // 64 mask bits + 16 pairs x 2 x 16 bits = 576 bits = 72 B.
    assert_eq!(
        (mosaic.layout(0).key.stride, mosaic.layout(0).value.stride),
        (72, 72)
    );

    let shard = by_name("shard");
    // PCA rank 64 int4 = 32 B; VQ 32 groups x 8 bits = 32 B.
    assert_eq!(
        (shard.layout(0).key.stride, shard.layout(0).value.stride),
        (32, 32)
    );

    let subspace = by_name("subspace");
    assert_eq!(
        (
            subspace.layout(0).key.stride,
            subspace.layout(0).value.stride
        ),
        (32, 32)
    );
    assert_eq!(subspace.layout(0).header_bytes, 16 + 4 * 64);
}

#[test]
fn bitmap_int8_mask_then_item_scale_then_codes() {
    let format = compile(BITMAP);
    let l = format.layout(1);
    // 8 mask bits, 16-bit f16 scale, 2 x 8-bit codes = 40 bits.
    assert_eq!((l.key.bits, l.key.stride), (40, 5));
    assert!(matches!(
        l.key.fields[0],
        FieldLayout::Bitmap {
            mask_offset: 0,
            groups: 8,
            item_scale: Some(8),
            elems_offset: 24,
            ..
        }
    ));
    let keys = [0.0f32, -127.0, 0.0, 0.0, 63.5, 0.0, 0.0, 1.0];
    let values = [0.0f32; 8];
    let page = encode(&format, 1, &[], &keys, &values);
    assert_eq!(&page[..16], &expected_header(l, 1, &[])[..]);
    // Mask bits 1 and 4; scale max 127 / 127 = f16 1.0; codes -127, round(63.5) = 64.
    assert_eq!(&key_stream(l, &page)[..5], &[0x12, 0x00, 0x3C, 0x81, 0x40]);
}

const VQ: &str = r#"
name = "vq8"
head_dim = 8
[page]
items = 4
[[tier]]
name = "v"
key.field = [{ kind = "codebook", group_size = 4, bits = 2, codewords = "vector", per_group = true }]
value.field = [{ kind = "codebook", group_size = 2, bits = 3, codewords = "vector", dtype = "f32" }]
"#;

#[test]
fn vector_codebook_indices_per_group_books() {
    let format = compile(VQ);
    let l = format.layout(0);
    assert_layout_rules(&format);
    // Keys: 2 groups x 2 bits = 4 bits -> 1 byte; values: 4 groups x 3 bits = 12 bits -> 2 bytes.
    assert_eq!((l.key.stride, l.value.stride), (1, 2));
    assert_eq!((l.tables[0].len, l.tables[1].len), (2 * 4 * 4, 8 * 2));
    // Key books: book 0 entry e = (e, e, e, e); book 1 entry e = (-e, -e, -e, -e) (f16-exact).
    let mut key_books: Vec<f32> = (0..4).flat_map(|e| [e as f32; 4]).collect();
    key_books.extend((0..4).flat_map(|e| [-(e as f32); 4]));
    // Value book: entry e = (e, 10 e).
    let value_book: Vec<f32> = (0..8).flat_map(|e| [e as f32, 10.0 * e as f32]).collect();
    let tables = vec![key_books, value_book];
    // Group 0 = book 0 entry 3; group 1 = (2, 2, 2, 2) is nearest book 1's entry 0.
    let keys = [3.0f32, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0, 2.0];
    // Groups pick entries 7, 0, 5, 2 (the last one only nearly: 2.1, 19).
    let values = [7.0f32, 70.0, 0.0, 0.0, 5.0, 50.0, 2.1, 19.0];
    let page = encode(&format, 0, &tables, &keys, &values);
    assert_eq!(key_stream(l, &page)[0], 0b00_11, "indices 3 then 0");
    // 7 | 0 << 3 | 5 << 6 | 2 << 9 = 0x547.
    assert_eq!(&value_stream(l, &page)[..2], &[0x47, 0x05]);
    let (k, v) = decode_page(l, &tables, &page);
    assert_eq!(k, vec![3.0, 3.0, 3.0, 3.0, 0.0, 0.0, 0.0, 0.0]);
    assert_eq!(v, vec![7.0, 70.0, 0.0, 0.0, 5.0, 50.0, 2.0, 20.0]);
}
