//! Shared fixtures for the workspace integration tests.
#![allow(dead_code)]

use std::cell::RefCell;

use kvcc::compiler::layout::{FieldLayout, Side, TierLayout};
use kvcc::compiler::Format;
use kvcc::runtime::builtin::SPECS;
use kvcc::runtime::cache::{self, PagedCache};
use kvcc::runtime::encode::{encode_page, EncodeError, TrainOptions};
use kvcc::runtime::live::Append;
use kvcc::runtime::synth::{synthesize, SynthKv, SynthOptions};

pub fn bundled() -> Vec<Format> {
    SPECS
        .iter()
        .map(|(file, source)| Format::parse(source, file).unwrap_or_else(|e| panic!("{file}: {e}")))
        .collect()
}

/// Formats whose key codebooks the kernels read directly rather than through
/// per-query lookup tables (`tests/in/codebook-reads/`).
pub fn direct_codebook_formats() -> Vec<Format> {
    formats_in(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/in/codebook-reads"
    ))
}

/// Formats for the tensor cores' scaled and asymmetric codes: keys with zero
/// points, values with per-group scales and zero points, per-item zero
/// points or per-page channel scales (`tests/in/tensor-cores/`).
pub fn tensor_core_formats() -> Vec<Format> {
    formats_in(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/in/tensor-cores"
    ))
}

fn formats_in(dir: &str) -> Vec<Format> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{dir}: {e}"))
        .map(|entry| entry.expect("readable directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|path| Format::load(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .collect()
}

/// One append of `chunks`: `(sequence, keys, values)` with
/// `[kv_head][token][head_dim]` blocks.
pub fn appends(chunks: &[(usize, Vec<f32>, Vec<f32>)]) -> Vec<Append<'_>> {
    (chunks.iter())
        .map(|(s, k, v)| Append {
            sequence: *s,
            keys: k,
            values: v,
        })
        .collect()
}

/// A fresh seed per run (so every run exercises new inputs), printed for replay;
/// `KVCC_TEST_SEED` pins it.
/// A GPU from `open`, or `None` after saying on stderr why the test skips;
/// with `KVCC_REQUIRE_GPU` set (the GPU machine) no GPU is a failure.
pub fn gpu_or_skip<T, E: std::fmt::Display>(
    test: &str,
    open: impl FnOnce() -> Result<T, E>,
) -> Option<T> {
    match open() {
        Ok(gpu) => Some(gpu),
        Err(error) if std::env::var_os("KVCC_REQUIRE_GPU").is_some() => {
            panic!("{test}: KVCC_REQUIRE_GPU is set but {error}")
        }
        Err(error) => {
            // To the stderr handle: the harness hides `eprintln!` of passing
            // tests, and a skip must show in a plain `cargo test`.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED {test}: {error} (GPU tests run for real on a machine with an NVIDIA GPU)"
            );
            None
        }
    }
}

pub fn fresh_seed(test: &str) -> u64 {
    let seed = std::env::var("KVCC_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!("{test}: KVCC_TEST_SEED={seed}");
    seed
}

pub fn data(format: &Format, seed: u64, kv_heads: usize, q_heads: usize, tokens: usize) -> SynthKv {
    synthesize(&SynthOptions {
        seed,
        kv_heads,
        q_heads,
        tokens,
        head_dim: format.head_dim() as usize,
    })
}

pub fn trained_cache(format: &Format, data: &SynthKv, seed: u64) -> PagedCache {
    let options = TrainOptions {
        seed,
        max_samples: 4096,
        iterations: 6,
    };
    let tables = cache::train(
        format,
        &data.keys,
        &data.values,
        data.options.kv_heads,
        &options,
    )
    .expect("train");
    PagedCache::new(format, data.options.kv_heads, tables).expect("cache")
}

/// A cache holding sequences of `lengths` tokens, sequence `s` with its pages
/// placed by `plan(s, page)` and written by `encode` ([`encode_page`], or
/// another of its signature), tables trained on the longest; and the queries.
pub fn cache_and_queries(
    format: &Format,
    seed: u64,
    kv_heads: usize,
    q_heads: usize,
    lengths: &[usize],
    plan: &dyn Fn(usize, usize) -> usize,
    encode: &PageEncoder<'_>,
) -> (PagedCache, Vec<f32>) {
    let sets: Vec<_> = lengths
        .iter()
        .enumerate()
        .map(|(i, &t)| data(format, seed.wrapping_add(i as u64), kv_heads, q_heads, t))
        .collect();
    let longest = (0..sets.len())
        .max_by_key(|&i| sets[i].options.tokens)
        .expect("sequences");
    let mut cache = trained_cache(format, &sets[longest], seed);
    for (s, set) in sets.iter().enumerate() {
        cache
            .append_sequence_with(&set.keys, &set.values, |p| plan(s, p), encode)
            .expect("append");
    }
    let queries = sets
        .iter()
        .flat_map(|s| s.queries.iter().copied())
        .collect();
    (cache, queries)
}

/// A page encoder: [`encode_page`]'s signature.
pub type PageEncoder<'a> =
    dyn Fn(&TierLayout, &[Vec<f32>], &[f32], &[f32], &mut [u8]) -> Result<(), EncodeError> + 'a;

/// [`encode_page`], then each item's bitmap masks emptied, filled, set at
/// random or left as encoded (a quarter each): masks with any number of
/// set bits, where the encoder sets exactly `keep`. With fewer, the other
/// groups are 0; with more, those past the `keep`-th repeat packed group
/// `keep − 1` (the interpreter's reading).
pub fn scrambled_bitmap_masks(seed: u64) -> Box<PageEncoder<'static>> {
    let rng = RefCell::new(SplitMix64(seed));
    Box::new(move |layout, tables, keys, values, page| {
        encode_page(layout, tables, keys, values, page)?;
        let mut rng = rng.borrow_mut();
        for item in 0..layout.items_per_page {
            // One pattern for both sides: a key that takes the softmax (a
            // full mask) keeps values, so no output is a sum of rounding.
            let pattern = rng.below(4);
            if pattern == 3 {
                continue; // left as encoded
            }
            for side in [Side::Key, Side::Value] {
                let codec = layout.codec(side);
                let FieldLayout::Bitmap {
                    mask_offset,
                    groups,
                    ..
                } = *codec.body()
                else {
                    continue;
                };
                let mask = 8 * (layout.stream_offset(side) + item * codec.stride) + mask_offset;
                for group in 0..groups {
                    let set = match pattern {
                        0 => false,
                        1 => true,
                        _ => rng.coin(),
                    };
                    let (byte, bit) = (((mask + group) / 8) as usize, (mask + group) % 8);
                    page[byte] = (page[byte] & !(1 << bit)) | (u8::from(set) << bit);
                }
            }
        }
        Ok(())
    })
}

/// Single-tier f16 bitmap formats whose masks are one, two or four words,
/// of groups of 1 (expanded into dense rows on the tensor-core path), 2 and
/// 4 elements (gathered into fragments), alike on both sides or mixed;
/// with what to call each.
pub fn bitmap_mask_specs() -> Vec<(String, Format)> {
    let field = |(group_size, keep): (u32, u32)| {
        format!(
            "[{{ kind = \"bitmap\", group_size = {group_size}, keep = {keep}, elem = \"f16\" }}]"
        )
    };
    [
        (128, (2, 16), (2, 16)),
        (128, (1, 20), (1, 20)),
        (128, (4, 5), (4, 5)),
        (64, (2, 8), (2, 8)),
        (128, (2, 16), (1, 20)),
        (128, (1, 20), (4, 5)),
    ]
    .into_iter()
    .map(|(head_dim, key, value)| {
        let source = format!(
            "name = \"masks\"\nhead_dim = {head_dim}\n\n[page]\nitems = 64\n\n\
             [[tier]]\nname = \"t\"\nkey.field = {}\nvalue.field = {}\n",
            field(key),
            field(value)
        );
        let what = format!(
            "head_dim {head_dim}, key groups of {} keep {}, value groups of {} keep {}",
            key.0, key.1, value.0, value.1
        );
        let format = Format::parse(&source, "masks.toml").unwrap_or_else(|e| panic!("{what}: {e}"));
        (what, format)
    })
    .collect()
}

/// Asserts every element of `got` is within `tolerance` relative to the largest
/// magnitude of `want`'s row (outputs are vectors; per-element relative error
/// is meaningless near zero).
pub fn assert_rows_close(what: &str, got: &[f32], want: &[f32], row: usize, tolerance: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (r, (g, w)) in got.chunks(row).zip(want.chunks(row)).enumerate() {
        let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
        for (c, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(a.is_finite(), "{what}: row {r} channel {c} is {a}");
            assert!(
                (a - b).abs() <= tolerance * scale,
                "{what}: row {r} channel {c}: got {a}, want {b} (row scale {scale})"
            );
        }
    }
}

#[allow(unused_imports)]
pub use spec_gen::{random_specs, random_vq_value_specs, SplitMix64};

/// Random valid spec generator (`tests/random_specs.rs`, `tests/gpu.rs`).
mod spec_gen {
    use std::fmt::Write as _;

    /// SplitMix64: small and seedable, for picking test parameters.
    pub struct SplitMix64(pub u64);

    impl SplitMix64 {
        pub fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Uniform in `0..n` (n > 0).
        pub fn below(&mut self, n: usize) -> usize {
            (self.next_u64() % n as u64) as usize
        }
        /// Uniform in `lo..=hi`.
        pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
            lo + self.below((hi - lo + 1) as usize) as u32
        }
        pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
            items[self.below(items.len())]
        }
        pub fn coin(&mut self) -> bool {
            self.next_u64() & 1 == 1
        }
    }

    const HEAD_DIMS: [u32; 6] = [16, 32, 64, 96, 128, 256];
    const PAGE_ITEMS: [u32; 4] = [1, 7, 16, 64];
    /// A bound on a random spec's shared-memory estimate (f32 words), well
    /// under `front::check::SHARED_MEMORY_BUDGET`, so every target fits it.
    const SHARED_MEMORY_FLOATS: u64 = 96 * 1024 / 4;
    const BODY_KINDS: usize = 5;
    const TRANSFORM_KINDS: usize = 4;

    #[derive(Clone, Copy)]
    enum Transform {
        Identity { explicit: bool },
        Hadamard,
        Srht { seed: u64 },
        Pca { rank: u32, i8_basis: bool },
    }

    #[derive(Clone, Copy)]
    struct Book {
        group_size: u32,
        bits: u32,
        per_group: bool,
        f32_table: bool,
    }

    #[derive(Clone, Copy)]
    enum Body {
        /// dtype and (fp8) scale.
        Dense(&'static str, Option<&'static str>),
        Coeff {
            bits: u32,
            scale: &'static str,
            zero_point: bool,
            /// Channels per scale (scale = "group").
            group: u32,
        },
        Vector(Book),
        /// Radius bits and scale (`None`: the default, page) before a direction codebook.
        Radius {
            bits: u32,
            scale: Option<&'static str>,
            book: Book,
        },
        Bitmap {
            group_size: u32,
            keep: u32,
            elem: &'static str,
        },
    }

    struct Codec {
        transform: Transform,
        body: Body,
    }

    impl Book {
        /// (key LUT floats, codebook floats) of `front::check`'s shared-memory estimate.
        fn floats(&self, n: u32) -> (u64, u64) {
            let groups = u64::from(n / self.group_size);
            let entries = 1u64 << self.bits;
            let books = if self.per_group { groups } else { 1 };
            (
                groups * entries,
                books * entries * u64::from(self.group_size),
            )
        }

        fn toml(&self, codewords: &str) -> String {
            let mut s = format!(
                "{{ kind = \"codebook\", group_size = {}, bits = {}, codewords = \"{codewords}\"",
                self.group_size, self.bits
            );
            if self.per_group {
                s.push_str(", per_group = true");
            }
            if self.f32_table {
                s.push_str(", dtype = \"f32\"");
            }
            s.push_str(" }");
            s
        }
    }

    impl Codec {
        /// Shared-memory floats: `max_query_group * key LUT + codebook floats`.
        fn cost(&self, head_dim: u32, is_key: bool, max_query_group: u64) -> u64 {
            let n = match self.transform {
                Transform::Pca { rank, .. } => rank,
                _ => head_dim,
            };
            match self.body {
                Body::Vector(book) | Body::Radius { book, .. } => {
                    let (lut, books) = book.floats(n);
                    if is_key {
                        max_query_group * lut + books
                    } else {
                        books
                    }
                }
                _ => 0,
            }
        }

        fn toml(&self, side: &str, out: &mut String) {
            match self.transform {
                Transform::Identity { explicit: false } => {}
                Transform::Identity { explicit: true } => {
                    writeln!(out, "{side}.transform = {{ kind = \"identity\" }}").unwrap()
                }
                Transform::Hadamard => {
                    writeln!(out, "{side}.transform = {{ kind = \"hadamard\" }}").unwrap()
                }
                Transform::Srht { seed } => writeln!(
                    out,
                    "{side}.transform = {{ kind = \"srht\", seed = {seed} }}"
                )
                .unwrap(),
                Transform::Pca { rank, i8_basis } => {
                    let basis = if i8_basis { ", basis = \"i8\"" } else { "" };
                    writeln!(
                        out,
                        "{side}.transform = {{ kind = \"pca\", rank = {rank}{basis} }}"
                    )
                    .unwrap()
                }
            }
            let fields = match self.body {
                Body::Dense(dtype, scale) => {
                    let scale = scale.map(|s| format!(", scale = \"{s}\"")).unwrap_or_default();
                    format!("{{ kind = \"dense\", dtype = \"{dtype}\"{scale} }}")
                }
                Body::Coeff {
                    bits,
                    scale,
                    zero_point,
                    group,
                } => {
                    let mut s = format!("{{ kind = \"coeff\", bits = {bits}, scale = \"{scale}\"");
                    if scale == "group" {
                        write!(s, ", group = {group}").unwrap();
                    }
                    if zero_point {
                        s.push_str(", zero_point = true");
                    }
                    s.push_str(" }");
                    s
                }
                Body::Vector(book) => book.toml("vector"),
                Body::Radius { bits, scale, book } => {
                    let scale = scale.map(|s| format!(", scale = \"{s}\"")).unwrap_or_default();
                    format!(
                        "\n  {{ kind = \"radius\", group_size = {}, bits = {bits}{scale} }},\n  {},\n",
                        book.group_size,
                        book.toml("direction")
                    )
                }
                Body::Bitmap { group_size, keep, elem } => format!(
                    "{{ kind = \"bitmap\", group_size = {group_size}, keep = {keep}, elem = \"{elem}\" }}"
                ),
            };
            writeln!(out, "{side}.field = [{fields}]").unwrap();
        }
    }

    struct Generator {
        rng: SplitMix64,
        /// Round-robin counters, so every body kind and transform appears in every
        /// batch whatever the seed (the parameters inside stay random).
        bodies: usize,
        transforms: usize,
    }

    impl Generator {
        fn transform(&mut self, head_dim: u32) -> Transform {
            let kind = self.transforms % TRANSFORM_KINDS;
            self.transforms += 1;
            let power_of_two = head_dim.is_power_of_two();
            match kind {
                1 if power_of_two => Transform::Hadamard,
                2 if power_of_two => Transform::Srht {
                    // Sometimes beyond i64: the front end takes the whole u64 range.
                    seed: if self.rng.below(8) == 0 {
                        u64::MAX - self.rng.next_u64() % 16
                    } else {
                        self.rng.next_u64() >> 1
                    },
                },
                // PCA, also standing in for hadamard/srht when head_dim is not a power of two.
                1..=3 => {
                    let ranks: Vec<u32> = [
                        1,
                        3,
                        4,
                        8,
                        12,
                        16,
                        24,
                        32,
                        48,
                        head_dim / 4,
                        head_dim / 2,
                        head_dim,
                    ]
                    .into_iter()
                    .filter(|&r| r <= head_dim)
                    .collect();
                    Transform::Pca {
                        rank: self.rng.pick(&ranks),
                        i8_basis: self.rng.coin(),
                    }
                }
                _ => Transform::Identity {
                    explicit: self.rng.coin(),
                },
            }
        }

        /// A codebook over `n` dimensions within `budget` shared-memory floats.
        fn book(&mut self, n: u32, budget: u64, is_key: bool, max_query_group: u64) -> Book {
            let divisors: Vec<u32> = (1..=n.min(32)).filter(|&d| n.is_multiple_of(d)).collect();
            let cost = |b: &Book| {
                let (lut, books) = b.floats(n);
                if is_key {
                    max_query_group * lut + books
                } else {
                    books
                }
            };
            for _ in 0..200 {
                let book = Book {
                    group_size: self.rng.pick(&divisors),
                    bits: self.rng.range(1, 8),
                    per_group: self.rng.coin(),
                    f32_table: self.rng.coin(),
                };
                if cost(&book) <= budget {
                    return book;
                }
            }
            // The cheapest codebook (the budgets below always leave room for it).
            let book = Book {
                group_size: *divisors.last().unwrap(),
                bits: 1,
                per_group: false,
                f32_table: false,
            };
            assert!(
                cost(&book) <= budget,
                "spec generator: no codebook fits {budget} floats"
            );
            book
        }

        fn codec(
            &mut self,
            head_dim: u32,
            budget: u64,
            is_key: bool,
            max_query_group: u64,
        ) -> Codec {
            let transform = self.transform(head_dim);
            let n = match transform {
                Transform::Pca { rank, .. } => rank,
                _ => head_dim,
            };
            let mut kind = self.bodies % BODY_KINDS;
            self.bodies += 1;
            // Bitmap groups must divide n and fill whole 32-bit mask words (or one partial).
            let bitmap_groups: Vec<u32> = [1, 2, 4]
                .into_iter()
                .filter(|&g| n.is_multiple_of(g) && (n / g <= 32 || (n / g).is_multiple_of(32)))
                .collect();
            if kind == 4 && bitmap_groups.is_empty() {
                kind = 1;
            }
            let body = match kind {
                0 => {
                    let dtype = self.rng.pick(&["f16", "bf16", "f32", "fp8e4m3", "fp8e5m2"]);
                    let scale = match dtype.starts_with("fp8") {
                        true => self.rng.pick(&[
                            None,
                            Some("tensor"),
                            Some("head"),
                            Some("page"),
                            Some("item"),
                        ]),
                        false => None,
                    };
                    Body::Dense(dtype, scale)
                }
                1 => {
                    let groups: Vec<u32> = [1, 2, 4, 8, 16, 32]
                        .into_iter()
                        .filter(|&g| n.is_multiple_of(g))
                        .collect();
                    Body::Coeff {
                        bits: self.rng.pick(&[2, 3, 4, 8]),
                        scale: self.rng.pick(&[
                            "item",
                            "group",
                            "page",
                            "page_component",
                            "component",
                        ]),
                        zero_point: self.rng.coin(),
                        group: self.rng.pick(&groups),
                    }
                }
                2 => Body::Vector(self.book(n, budget, is_key, max_query_group)),
                3 => Body::Radius {
                    bits: self.rng.range(1, 16),
                    scale: self.rng.pick(&[None, Some("page"), Some("page_group")]),
                    book: self.book(n, budget, is_key, max_query_group),
                },
                _ => {
                    let group_size = self.rng.pick(&bitmap_groups);
                    Body::Bitmap {
                        group_size,
                        keep: self.rng.range(1, n / group_size),
                        elem: self.rng.pick(&["f16", "int8", "fp8e4m3", "fp8e5m2"]),
                    }
                }
            };
            Codec { transform, body }
        }

        fn spec(&mut self, index: usize, head_dim: Option<u32>, tiers: Option<usize>) -> String {
            let head_dim = head_dim.unwrap_or_else(|| self.rng.pick(&HEAD_DIMS));
            let tiers = tiers.unwrap_or_else(|| 1 + self.rng.below(3));
            let items = self.rng.pick(&PAGE_ITEMS);
            let max_query_group: u32 = self.rng.pick(&[4, 8]);
            let mut toml = format!(
                "# generated spec {index}\nname = \"random_{index}\"\nhead_dim = {head_dim}\n\n[page]\nitems = {items}\n"
            );
            // 8 is the default: sometimes left out.
            if max_query_group != 8 || self.rng.coin() {
                writeln!(toml, "max_query_group = {max_query_group}").unwrap();
            }
            let mqg = u64::from(max_query_group);
            for t in 0..tiers {
                // Floats left after the per-query head_dim terms; half for the key codec.
                let budget = SHARED_MEMORY_FLOATS - mqg * 4 * u64::from(head_dim);
                let key = self.codec(head_dim, budget / 2, true, mqg);
                let key_cost = key.cost(head_dim, true, mqg);
                let value = self.codec(head_dim, budget - key_cost, false, mqg);
                assert!(
                    key_cost + value.cost(head_dim, false, mqg) <= budget,
                    "spec generator: over budget"
                );
                writeln!(toml, "\n[[tier]]\nname = \"t{t}\"").unwrap();
                key.toml("key", &mut toml);
                value.toml("value", &mut toml);
            }
            toml
        }
    }

    /// `count` random specs whose values are vector codebooks of f16 books
    /// that the GPU kernels look up where the tensor cores' fragments load
    /// them: head_dim a multiple of 16 up to 256, a lane group's `head_dim / 8`
    /// channels whole codewords or part of one, 1-, 2-, 4- or 8-bit codes in
    /// whole words an item, whose lane-group run is a power-of-two part of a
    /// word or whole words, shared or per-group books within the
    /// shared-memory budget; dense, 8-bit page-scaled or 4-bit
    /// component-scaled keys; a Hadamard rotation of the values at a
    /// power-of-two head_dim half the time; 1-3 tiers, 16 or 64 items a page.
    pub fn random_vq_value_specs(seed: u64, count: usize) -> Vec<String> {
        let mut rng = SplitMix64(seed);
        (0..count)
            .map(|index| {
                let head_dim = 16 * rng.range(1, 16);
                let lane = head_dim / 8;
                let mut out = format!(
                    "name = \"vq_values_{index}\"\nhead_dim = {head_dim}\n[page]\nitems = {}\n",
                    rng.pick(&[16, 64])
                );
                for tier in 0..rng.range(1, 3) {
                    let per_group = rng.coin();
                    let books: Vec<(u32, u32)> = (2..=head_dim)
                        .filter(|&g| head_dim.is_multiple_of(g))
                        .filter(|&g| lane.is_multiple_of(g) || g.is_multiple_of(lane))
                        .filter(|&g| (2 * g.min(lane)).is_multiple_of(4))
                        .flat_map(|g| [1, 2, 4, 8].map(|bits| (g, bits)))
                        // Items of whole 32-bit words of codes.
                        .filter(|&(g, bits)| (head_dim / g * bits).is_multiple_of(32))
                        .filter(|&(g, bits)| {
                            let run = (lane / g).max(1) * bits;
                            if run <= 32 { 32 % run == 0 } else { run.is_multiple_of(32) }
                        })
                        .filter(|&(group_size, bits)| {
                            let book = Book {
                                group_size,
                                bits,
                                per_group,
                                f32_table: false,
                            };
                            book.floats(head_dim).1 <= SHARED_MEMORY_FLOATS
                        })
                        .collect();
                    let (group_size, bits) = rng.pick(&books);
                    let key = rng.pick(&[
                        "{ kind = \"dense\", dtype = \"f16\" }",
                        "{ kind = \"coeff\", bits = 8, scale = \"page_component\" }",
                        "{ kind = \"coeff\", bits = 4, scale = \"component\" }",
                    ]);
                    writeln!(out, "[[tier]]\nname = \"t{tier}\"\nkey.field = [{key}]").unwrap();
                    if head_dim.is_power_of_two() && rng.coin() {
                        writeln!(out, "value.transform = {{ kind = \"hadamard\" }}").unwrap();
                    }
                    writeln!(
                        out,
                        "value.field = [{{ kind = \"codebook\", group_size = {group_size}, bits = {bits}, codewords = \"vector\", per_group = {per_group} }}]"
                    )
                    .unwrap();
                }
                out
            })
            .collect()
    }

    /// `count` random specs (TOML text) that `front::check` must accept: head_dim
    /// from {16, 32, 64, 96, 128, 256} (no hadamard/srht at 96), 1-3 tiers, page
    /// items from {1, 7, 16, 64}; every codec a transform (identity, hadamard, srht,
    /// pca) and a body (dense, coeff, vector codebook, radius + direction codebook,
    /// bitmap), both kinds taken round-robin so each appears in every batch of 5+
    /// specs, with random parameters within the shared-memory budget. Spec 0 is a
    /// 3-tier head_dim 64 spec, spec 1 a 3-tier head_dim 256 spec, specs 2-5 have
    /// head_dim 16, 32, 96 and 128; the rest are fully random.
    pub fn random_specs(seed: u64, count: usize) -> Vec<String> {
        let mut generator = Generator {
            rng: SplitMix64(seed),
            bodies: 0,
            transforms: 0,
        };
        // Offset the round robins so body/transform pairings differ between seeds.
        generator.bodies = generator.rng.below(BODY_KINDS);
        generator.transforms = generator.rng.below(TRANSFORM_KINDS);
        (0..count)
            .map(|index| {
                let (head_dim, tiers) = match index {
                    0 => (Some(64), Some(3)),
                    1 => (Some(256), Some(3)),
                    2..=5 => (Some([16, 32, 96, 128][index - 2]), None),
                    _ => (None, None),
                };
                generator.spec(index, head_dim, tiers)
            })
            .collect()
    }
}
