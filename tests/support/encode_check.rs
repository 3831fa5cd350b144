//! GPU page-compress kernels against the CPU encoder, byte for byte: fresh
//! random K/V rounded to f16 (the source rows are f16), tables trained on
//! them, dense f16 source pages, every tier's pages encoded by one launch
//! per tier over every (kv head, page) job with destination pages in
//! scrambled order, each byte compared with `encode::encode_page`'s page.
// Each test that includes this module uses part of it.
#![allow(dead_code)]

use kvcc::compiler::back::interp::encode::ops::{f16_bits, f16_value};
use kvcc::compiler::layout::{Side, TierLayout};
use kvcc::compiler::Format;
use kvcc::runtime::cache;
use kvcc::runtime::cuda::{Gpu, PageEncoders};
use kvcc::runtime::encode::{encode_page, TrainOptions};

use super::common::SplitMix64;

/// Pages per kv head.
const PAGES: usize = 3;
/// Kv heads.
const KV_HEADS: usize = 3;

/// The dense f16 tier the encoders read rows from, for a format's geometry.
pub fn dense_source(format: &Format) -> Format {
    let text = format!(
        "name = \"source\"\nhead_dim = {}\n\n[page]\nitems = {}\n\n[[tier]]\nname = \"exact\"\n\
         key.field = [{{ kind = \"dense\", dtype = \"f16\" }}]\n\
         value.field = [{{ kind = \"dense\", dtype = \"f16\" }}]\n",
        format.head_dim(),
        format.spec().page.items
    );
    Format::parse(&text, "source.toml").expect("a dense spec")
}

/// `[kv_head][token][head_dim]` random values rounded to f16: mostly
/// uniform, some outlier channels, some exact zero rows and one all-zero
/// page (scales of 1, ties everywhere), some repeated rows.
fn random_rows(rng: &mut SplitMix64, tokens: usize, head_dim: usize, items: usize) -> Vec<f32> {
    let outliers: Vec<bool> = (0..head_dim).map(|_| rng.below(16) == 0).collect();
    let mut out = Vec::with_capacity(KV_HEADS * tokens * head_dim);
    for head in 0..KV_HEADS {
        for token in 0..tokens {
            let zero_page = head == KV_HEADS - 1 && token / items == 1;
            let pattern = rng.below(12);
            if zero_page || pattern == 0 {
                out.extend(std::iter::repeat_n(0.0, head_dim));
                continue;
            }
            if pattern == 1 && token > 0 {
                let previous = out.len() - head_dim;
                out.extend_from_within(previous..);
                continue;
            }
            for &outlier in &outliers {
                let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                let scale = if outlier { 12.0 } else { 1.5 };
                out.push(f16_value(f16_bits((2.0 * u - 1.0) * scale)));
            }
        }
    }
    out
}

/// Where byte `at` of a page of `layout` lies, for a mismatch report.
pub fn describe(layout: &TierLayout, at: usize) -> String {
    let at32 = at as u32;
    if at32 < 16 {
        return ["tier", "count", "flags", "reserved"][at / 4].to_string() + " header word";
    }
    if at32 < 16 + 4 * layout.header_slots {
        let slot = (at32 - 16) / 4;
        let run = layout
            .header_scales
            .iter()
            .find(|s| (s.first..s.first + s.count).contains(&slot))
            .expect("slots are covered");
        return format!(
            "header scale slot {slot} ({} field {}, scales {})",
            run.side.name(),
            run.field,
            run.scales.name()
        );
    }
    if at32 < layout.header_bytes {
        return "header padding".into();
    }
    for side in [Side::Key, Side::Value] {
        let codec = layout.codec(side);
        let start = layout.stream_offset(side);
        let end = start + layout.items_per_page * codec.stride;
        if (start..end).contains(&at32) {
            let item = (at32 - start) / codec.stride;
            let byte = (at32 - start) % codec.stride;
            let bits = 8 * byte..8 * byte + 8;
            let slots: Vec<String> = codec
                .slots
                .iter()
                .filter(|s| s.bits.offset < bits.end && s.bits.end() > bits.start)
                .map(|s| {
                    let first = bits.start.max(s.bits.offset);
                    format!(
                        "field {} {} element {}",
                        s.field,
                        s.role.name(),
                        (first - s.bits.offset) / s.bits.width
                    )
                })
                .collect();
            let slots = if slots.is_empty() {
                "item padding".to_string()
            } else {
                slots.join(", ")
            };
            return format!("{} item {item} byte {byte}: {slots}", side.name());
        }
    }
    "stream or page padding".into()
}

/// A two-tier spec of 40-item pages whose kernels, held to a small shared
/// memory budget ([`CHUNKED_SHARED_BYTES`]), encode each page in two chunks
/// (32 items, then 8), transforming twice for the page scales.
pub const CHUNKED_SPEC: &str = r#"
name = "chunked"
head_dim = 16
[page]
items = 40
[[tier]]
name = "a"
key.field = [{ kind = "coeff", bits = 8, scale = "page_component" }]
value.transform = { kind = "hadamard" }
value.field = [{ kind = "radius", group_size = 4, bits = 6, scale = "page_group" }, { kind = "codebook", group_size = 4, bits = 3, codewords = "direction" }]
[[tier]]
name = "b"
key.transform = { kind = "pca", rank = 8 }
key.field = [{ kind = "coeff", bits = 4, scale = "page" }]
value.transform = { kind = "srht", seed = 5 }
value.field = [{ kind = "bitmap", group_size = 2, keep = 3, elem = "int8" }]
"#;

/// Shared memory that holds 32 of [`CHUNKED_SPEC`]'s items at once, not 40.
pub const CHUNKED_SHARED_BYTES: u32 = 4600;

/// Encodes `format`'s pages on the GPU and on the CPU and compares them.
pub fn check_encoder(gpu: &Gpu, format: &Format, seed: u64, what: &str) {
    check_encoder_within(gpu, format, seed, what, gpu.target().max_shared_bytes());
}

/// [`check_encoder`] with kernels held to `shared_limit` bytes of shared memory.
pub fn check_encoder_within(gpu: &Gpu, format: &Format, seed: u64, what: &str, shared_limit: u32) {
    let head_dim = format.head_dim() as usize;
    let items = format.spec().page.items as usize;
    let tokens = PAGES * items;
    let mut rng = SplitMix64(seed);
    let keys = random_rows(&mut rng, tokens, head_dim, items);
    let values = random_rows(&mut rng, tokens, head_dim, items);
    let options = TrainOptions {
        seed,
        max_samples: 4096,
        iterations: 4,
    };
    let tables = cache::train(format, &keys, &values, KV_HEADS, &options).expect("train");
    let source = dense_source(format);
    let source_layout = source.layout(0);
    let src_bytes = source_layout.page_bytes as usize;
    let row = |data: &[f32], head: usize, page: usize| {
        let start = (head * tokens + page * items) * head_dim;
        data[start..start + items * head_dim].to_vec()
    };
    // Source page s = head * PAGES + page.
    let mut source_pool = vec![0u8; KV_HEADS * PAGES * src_bytes];
    for head in 0..KV_HEADS {
        for page in 0..PAGES {
            let s = head * PAGES + page;
            encode_page(
                source_layout,
                &[],
                &row(&keys, head, page),
                &row(&values, head, page),
                &mut source_pool[s * src_bytes..(s + 1) * src_bytes],
            )
            .expect("source page");
        }
    }
    let encoders = PageEncoders::load_within(gpu, format, source_layout, shared_limit)
        .unwrap_or_else(|e| panic!("{what}: loading the encoders: {e}"));
    let jobs_count = KV_HEADS * PAGES;
    // Destination page of job j: a scrambled order, one spare page between.
    let stride = 1 + 2 * rng.below(jobs_count);
    let stride = if gcd(stride, 2 * jobs_count) == 1 {
        stride
    } else {
        1
    };
    let pages = 2 * jobs_count;
    let dst = |j: usize| (j * stride + 3) % pages;
    let jobs: Vec<[u32; 3]> = (0..jobs_count)
        .map(|s| [s as u32, dst(s) as u32, (s / PAGES) as u32])
        .collect();
    for (tier, tier_tables) in tables.iter().enumerate() {
        let layout = format.layout(tier);
        let page_bytes = layout.page_bytes as usize;
        let got = encoders
            .encode_pages(gpu, tier, &source_pool, tier_tables, &jobs, pages)
            .unwrap_or_else(|e| panic!("{what}: tier {}: {e}", layout.name));
        let mut problems = Vec::new();
        for (s, job) in jobs.iter().enumerate() {
            let (head, page) = (s / PAGES, s % PAGES);
            let mut want = vec![0u8; page_bytes];
            encode_page(
                layout,
                &tier_tables[head],
                &row(&keys, head, page),
                &row(&values, head, page),
                &mut want,
            )
            .expect("CPU encode");
            let d = job[1] as usize;
            let have = &got[d * page_bytes..(d + 1) * page_bytes];
            for (at, (&g, &w)) in have.iter().zip(&want).enumerate() {
                if g != w && problems.len() < 12 {
                    problems.push(format!(
                        "kv head {head} page {page} (destination {d}) byte {at}: GPU {g:#04x}, CPU {w:#04x} — {}",
                        describe(layout, at)
                    ));
                }
            }
        }
        assert!(
            problems.is_empty(),
            "{what}: tier {} ({}): GPU pages differ from the CPU encoder's:\n{}",
            layout.name,
            tier,
            problems.join("\n")
        );
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
