//! `kv_format!` against its two sources of truth, for every spec in `specs/`:
//! the compiler (layout constants, PTX as `ptx::write` writes it for
//! `generated/`) and the runtime (pages byte-identical to the generic
//! `encode_page`, decoded vectors bit-identical to the reference
//! `decode_page`, the same input errors, the same cache through
//! `PagedCache::append_sequence_with`).

mod common;

use std::collections::BTreeMap;

use common::{data, fresh_seed};
use kvcc::compiler::back::ptx::{self, Options};
use kvcc::compiler::layout::TierLayout;
use kvcc::compiler::target::Target;
use kvcc::compiler::Format;
use kvcc::kv_format;
use kvcc::runtime::cache::{self, PagedCache};
use kvcc::runtime::encode::{decode_page, encode_page, EncodeError, TrainOptions};

kv_format!("specs/dense_f16.toml");
kv_format!("specs/spherical.toml");
kv_format!("specs/kivi.toml");
kv_format!("specs/subspace.toml");
kv_format!("specs/shard.toml");
kv_format!("specs/mosaic.toml");
kv_format!("specs/fp8.toml");
kv_format!("specs/kivi2.toml");

type EncodeFn = fn(&TierLayout, &[Vec<f32>], &[f32], &[f32], &mut [u8]) -> Result<(), EncodeError>;
type DecodeFn = fn(&TierLayout, &[Vec<f32>], &[u8]) -> (Vec<f32>, Vec<f32>);

/// What these tests read of one generated module.
struct Generated {
    spec_file: &'static str,
    spec: &'static str,
    format: &'static Format,
    encode: EncodeFn,
    decode: DecodeFn,
    merge_ptx: fn(Target) -> &'static str,
    /// Per tier, by index.
    tiers: Vec<TierConsts>,
}

/// A tier module's constants and PTX.
struct TierConsts {
    index: usize,
    name: &'static str,
    page_bytes: usize,
    header_slots: usize,
    header_bytes: usize,
    key_stream_offset: usize,
    value_stream_offset: usize,
    key: (usize, u32, usize),
    value: (usize, u32, usize),
    table_lens: Vec<usize>,
    ptx: fn(Target) -> &'static str,
}

macro_rules! generated {
    ($m:ident: $($tier:ident),+) => {
        Generated {
            spec_file: $m::SPEC_FILE,
            spec: $m::SPEC,
            format: $m::format(),
            encode: $m::encode_page,
            decode: $m::decode_page,
            merge_ptx: $m::merge_ptx,
            tiers: vec![$(TierConsts {
                index: $m::$tier::INDEX,
                name: $m::$tier::NAME,
                page_bytes: $m::$tier::PAGE_BYTES,
                header_slots: $m::$tier::HEADER_SLOTS,
                header_bytes: $m::$tier::HEADER_BYTES,
                key_stream_offset: $m::$tier::KEY_STREAM_OFFSET,
                value_stream_offset: $m::$tier::VALUE_STREAM_OFFSET,
                key: ($m::$tier::key::DIMS, $m::$tier::key::BITS, $m::$tier::key::BYTES),
                value: ($m::$tier::value::DIMS, $m::$tier::value::BITS, $m::$tier::value::BYTES),
                table_lens: $m::$tier::TABLE_LENS.to_vec(),
                ptx: $m::$tier::ptx,
            }),+],
        }
    };
}

fn all() -> Vec<Generated> {
    vec![
        generated!(dense_f16: f16),
        generated!(spherical: high, mid, low),
        generated!(kivi: int8, int4),
        generated!(subspace: rank32),
        generated!(shard: pca64_vq),
        generated!(mosaic: keep25),
        generated!(fp8: e4m3),
        generated!(kivi2: int2, int3),
    ]
}

#[test]
fn every_spec_in_specs_is_generated_here() {
    let root = env!("CARGO_MANIFEST_DIR");
    let on_disk: Vec<String> = std::fs::read_dir(format!("{root}/specs"))
        .unwrap()
        .map(|e| format!("specs/{}", e.unwrap().file_name().to_string_lossy()))
        .filter(|name| name.ends_with(".toml"))
        .collect();
    let mut on_disk = on_disk;
    on_disk.sort();
    let mut generated: Vec<String> = all().iter().map(|g| g.spec_file.to_string()).collect();
    generated.sort();
    assert_eq!(generated, on_disk, "add a kv_format! call for every spec");
    for g in all() {
        let file = std::fs::read_to_string(format!("{root}/{}", g.spec_file)).unwrap();
        assert_eq!(g.spec, file, "{}: embedded text", g.spec_file);
        let compiled = Format::parse(&file, g.spec_file).unwrap();
        assert_eq!(g.format.spec(), compiled.spec(), "{}", g.spec_file);
    }
}

#[test]
fn layout_constants_are_the_compilers() {
    for g in all() {
        assert_eq!(g.tiers.len(), g.format.tiers().len(), "{}", g.format.name());
        for (t, c) in g.tiers.iter().enumerate() {
            let l = g.format.layout(t);
            let what = format!("{} tier {}", g.format.name(), l.name);
            assert_eq!((c.index, c.name), (t, l.name.as_str()), "{what}");
            assert_eq!(
                (
                    c.page_bytes,
                    c.header_slots,
                    c.header_bytes,
                    c.key_stream_offset,
                    c.value_stream_offset
                ),
                (
                    l.page_bytes as usize,
                    l.header_slots as usize,
                    l.header_bytes as usize,
                    l.key_stream_offset as usize,
                    l.value_stream_offset as usize
                ),
                "{what}"
            );
            for (side, codec) in [(c.key, &l.key), (c.value, &l.value)] {
                assert_eq!(
                    side,
                    (codec.dims as usize, codec.bits, codec.stride as usize),
                    "{what}"
                );
            }
            let lens: Vec<usize> = l.tables.iter().map(|t| t.len as usize).collect();
            assert_eq!(c.table_lens, lens, "{what}");
        }
    }
    // Field positions, against docs/spec-reference.md's worked example.
    use spherical::high::key::{codebook, radius};
    assert_eq!((radius::OFFSET, radius::BITS, radius::GROUPS), (0, 8, 8));
    assert_eq!((radius::SLOT, radius::SLOTS), (0, 1));
    assert_eq!(
        (codebook::OFFSET, codebook::BITS, codebook::BOOKS),
        (64, 6, 8)
    );
    assert_eq!(spherical::high::key::BYTES, 14);
    assert_eq!(spherical::low::key::BYTES, 6);
    assert_eq!(kivi::int4::value::coeff::ITEM_SCALE_OFFSET, 0);
    assert_eq!(kivi::int4::value::coeff::OFFSET, 16);
    assert_eq!(kivi::int8::key::coeff::SLOT, 0);
    assert_eq!(mosaic::keep25::key::bitmap::ELEMS_OFFSET, 64);
    assert_eq!(shard::pca64_vq::key::coeff::TABLE, 2);
    assert_eq!(dense_f16::f16::value::dense::BITS, 16);
}

#[test]
fn ptx_is_what_the_compiler_writes_for_generated() {
    for g in all() {
        for target in Target::ALL {
            let output = ptx::write(g.format, &Options::for_target(target)).unwrap();
            let mut want: BTreeMap<String, &str> = output
                .tiers
                .iter()
                .map(|t| (ptx::file_name(&t.tier, target), t.ptx.as_str()))
                .collect();
            want.insert(ptx::merge_file_name(target), output.merge.ptx.as_str());
            let mut got: BTreeMap<String, &str> = g
                .tiers
                .iter()
                .map(|t| (ptx::file_name(t.name, target), (t.ptx)(target)))
                .collect();
            got.insert(ptx::merge_file_name(target), (g.merge_ptx)(target));
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                want.keys().collect::<Vec<_>>()
            );
            for (file, text) in &want {
                assert!(
                    got[file] == *text,
                    "{}/{file}: kv_format! PTX differs from ptx::write",
                    g.format.name()
                );
            }
        }
    }
}

const TRAIN: TrainOptions = TrainOptions {
    seed: 7,
    max_samples: 1024,
    iterations: 3,
};

/// Rows `[from, to)` of `[token][d]` data, with rows in `zero` set to 0 (an
/// all-zero item exercises the scale fallbacks).
fn rows(data: &[f32], d: usize, from: usize, to: usize, zero: &[usize]) -> Vec<f32> {
    let mut out = data[from * d..to * d].to_vec();
    for &z in zero {
        if z < to - from {
            out[z * d..(z + 1) * d].fill(0.0);
        }
    }
    out
}

#[test]
fn pages_are_byte_identical_to_the_generic_encoder() {
    let seed = fresh_seed("kv_format pages");
    for g in all() {
        let d = g.format.head_dim() as usize;
        let items = g.format.spec().page.items as usize;
        let kv = data(g.format, seed, 1, 1, 2 * items);
        let tables = cache::train(g.format, &kv.keys, &kv.values, 1, &TRAIN).unwrap();
        // A full page, a partial one, one token, none, and pages with zero items.
        let cases: [(usize, usize, &[usize]); 6] = [
            (0, items, &[]),
            (items, items + items / 2 + 1, &[]),
            (3, 4, &[]),
            (0, 0, &[]),
            (items, 2 * items, &[0, 5]),
            (0, 1, &[0]),
        ];
        for t in 0..g.format.tiers().len() {
            let layout = g.format.layout(t);
            let tables = &tables[t][0];
            for &(from, to, zero) in &cases {
                let what = format!(
                    "{} tier {} tokens {from}..{to}",
                    g.format.name(),
                    layout.name
                );
                let keys = rows(&kv.keys, d, from, to, zero);
                let values = rows(&kv.values, d, from, to, zero);
                let mut want = vec![0x5Au8; layout.page_bytes as usize];
                encode_page(layout, tables, &keys, &values, &mut want).unwrap();
                // Stale bytes everywhere: the generated encoder writes all of the page.
                let mut got = vec![0xA5u8; layout.page_bytes as usize];
                (g.encode)(layout, tables, &keys, &values, &mut got).unwrap();
                if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
                    panic!(
                        "{what}: byte {at} is {:#04x}, the generic encoder writes {:#04x}",
                        got[at], want[at]
                    );
                }
                let (rk, rv) = decode_page(layout, tables, &want);
                let (gk, gv) = (g.decode)(layout, tables, &want);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&gk), bits(&rk), "{what}: decoded keys");
                assert_eq!(bits(&gv), bits(&rv), "{what}: decoded values");
            }
        }
    }
}

#[test]
fn input_errors_are_the_generic_encoders() {
    for g in all() {
        let layout = g.format.layout(0);
        let d = layout.head_dim as usize;
        let items = layout.items_per_page as usize;
        let tables: Vec<Vec<f32>> = layout
            .tables
            .iter()
            .map(|t| vec![0.5; t.len as usize])
            .collect();
        let mut inf = vec![0.0; 2 * d];
        inf[d + 3] = f32::INFINITY;
        let cases: [(Vec<f32>, Vec<f32>); 4] = [
            (vec![0.0; d + 1], vec![0.0; d]),
            (inf, vec![0.0; 2 * d]),
            (vec![0.0; d], vec![0.0; 2 * d]),
            (vec![0.0; (items + 1) * d], vec![0.0; (items + 1) * d]),
        ];
        for (keys, values) in cases {
            let mut page = vec![0u8; layout.page_bytes as usize];
            let want = encode_page(layout, &tables, &keys, &values, &mut page).unwrap_err();
            let got = (g.encode)(layout, &tables, &keys, &values, &mut page).unwrap_err();
            assert_eq!(got, want, "{}", g.format.name());
        }
    }
    let foreign = kivi::format().layout(0);
    let mut page = vec![0u8; foreign.page_bytes as usize];
    assert!(matches!(
        spherical::encode_page(foreign, &[], &[], &[], &mut page),
        Err(EncodeError::ForeignLayout { .. })
    ));
}

#[test]
fn caches_filled_through_the_generated_encoder_are_identical() {
    let seed = fresh_seed("kv_format cache");
    let format = spherical::format();
    let items = spherical::ITEMS_PER_PAGE;
    let kv = data(format, seed, 2, 4, 3 * items + 9);
    let tables = cache::train(format, &kv.keys, &kv.values, 2, &TRAIN).unwrap();
    let tier_of_page = |p: usize| p % spherical::TIERS.len();
    let mut generic = PagedCache::new(format, 2, tables.clone()).unwrap();
    generic
        .append_sequence(&kv.keys, &kv.values, tier_of_page)
        .unwrap();
    let mut specialized = PagedCache::new(format, 2, tables).unwrap();
    specialized
        .append_sequence_with(&kv.keys, &kv.values, tier_of_page, spherical::encode_page)
        .unwrap();
    let (a, b) = (generic.view(), specialized.view());
    assert_eq!(a.page_tables, b.page_tables);
    for (t, (a, b)) in a.tiers.iter().zip(&b.tiers).enumerate() {
        assert!(a.pool == b.pool, "tier {t}: pools differ");
    }
}
