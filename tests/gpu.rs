//! GPU kernels against the reference interpreter: every element of every
//! output, fresh random inputs each run, outputs poisoned (NaN) before each
//! launch. Without a GPU these tests print why and pass, unless
//! `KVCC_REQUIRE_GPU=1` (set on the GPU machine) makes that a failure.

mod common;

use common::{
    assert_rows_close, bitmap_mask_specs, bundled, cache_and_queries, direct_codebook_formats,
    fresh_seed, scrambled_bitmap_masks, tensor_core_formats,
};
use kvcc::compiler::back::interp::{Interpreter, Options};
use kvcc::compiler::back::ptx::Schedule;
use kvcc::compiler::Format;
use kvcc::runtime::cache::PagedCache;
use kvcc::runtime::encode::encode_page;
use kvcc::runtime::exec::{CudaExecutor, Executor};

fn gpu(test: &str) -> Option<CudaExecutor> {
    common::gpu_or_skip(test, CudaExecutor::open)
}

/// Sequences of several lengths, none a multiple of the page size.
const LENGTHS: [usize; 4] = [1, 150, 333, 1000];

fn check(
    executor: &CudaExecutor,
    format: &Format,
    seed: u64,
    kv_heads: usize,
    group: usize,
    plan: &dyn Fn(usize, usize) -> usize,
    what: &str,
) {
    let q_heads = kv_heads * group;
    let (cache, queries) = cache_and_queries(
        format,
        seed,
        kv_heads,
        q_heads,
        &LENGTHS,
        plan,
        &encode_page,
    );
    check_cache(executor, format, &cache, &queries, q_heads, what);
}

fn check_cache(
    executor: &CudaExecutor,
    format: &Format,
    cache: &PagedCache,
    queries: &[f32],
    q_heads: usize,
    what: &str,
) {
    let want = Interpreter::new(format.tiers(), Options::default())
        .decode(&cache.view(), queries, q_heads)
        .expect("interpreter");
    let got = executor
        .decode(cache, queries, q_heads)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_rows_close(what, &got, &want, format.head_dim() as usize, 1e-4);
}

#[test]
fn gpu_matches_interpreter_on_every_bundled_tier() {
    let Some(executor) = gpu("gpu_matches_interpreter_on_every_bundled_tier") else {
        return;
    };
    let seed = fresh_seed("gpu_bundled");
    for format in bundled() {
        for tier in 0..format.tiers().len() {
            let what = format!("{}/{} (GQA 4)", format.name(), format.layout(tier).name);
            check(&executor, &format, seed, 2, 4, &|_, _| tier, &what);
        }
    }
}

#[test]
fn gpu_matches_interpreter_with_gqa_1_4_8_and_mixed_tiers() {
    let Some(executor) = gpu("gpu_matches_interpreter_with_gqa_1_4_8_and_mixed_tiers") else {
        return;
    };
    let seed = fresh_seed("gpu_gqa_mixed");
    for format in bundled() {
        let tiers = format.tiers().len();
        for group in [1, 4, 8] {
            let what = format!("{} mixed tiers (GQA {group})", format.name());
            check(
                &executor,
                &format,
                seed,
                2,
                group,
                &|s, p| (s + p) % tiers,
                &what,
            );
        }
    }
}

/// Each tier of each format alone at every GQA group of `groups`, then its
/// tiers mixed at GQA `mixed`.
fn check_tiers(
    executor: &CudaExecutor,
    formats: &[Format],
    seed: u64,
    groups: &[usize],
    mixed: usize,
) {
    for format in formats {
        let tiers = format.tiers().len();
        for &group in groups {
            for tier in 0..tiers {
                let what = format!(
                    "{}/{} (GQA {group})",
                    format.name(),
                    format.layout(tier).name
                );
                check(executor, format, seed, 2, group, &|_, _| tier, &what);
            }
        }
        let what = format!("{} mixed tiers (GQA {mixed})", format.name());
        check(
            executor,
            format,
            seed,
            2,
            mixed,
            &|s, p| (s + p) % tiers,
            &what,
        );
    }
}

/// Key codebooks whose lookup tables would not fit (VQ keys in groups of 4 at
/// 8 bits, 8-dim directions at 8 bits with GQA 8): the kernels read the
/// codewords directly. Each tier alone at GQA 4 (where the directions' tables
/// fit again: both reads run) and 8, then mixed tiers.
#[test]
fn gpu_matches_interpreter_on_direct_codebook_formats() {
    let Some(executor) = gpu("gpu_matches_interpreter_on_direct_codebook_formats") else {
        return;
    };
    let seed = fresh_seed("gpu_direct_codebooks");
    check_tiers(&executor, &direct_codebook_formats(), seed, &[4, 8], 8);
}

/// Asymmetric keys and grouped, asymmetric or page-scaled values on the tensor cores
/// (`tests/in/tensor-cores/`): each tier alone at GQA 1, 4 and 8 (one and
/// two column tiles), then mixed tiers.
#[test]
fn gpu_matches_interpreter_on_tensor_core_formats() {
    let Some(executor) = gpu("gpu_matches_interpreter_on_tensor_core_formats") else {
        return;
    };
    let seed = fresh_seed("gpu_tensor_core_formats");
    check_tiers(&executor, &tensor_core_formats(), seed, &[1, 4, 8], 4);
}

/// Random specs whose values the kernels look up in the codebooks where the
/// tensor cores' fragments load them ([`common::random_vq_value_specs`]):
/// on the CPU, that every tier takes that path on both targets; on the GPU,
/// each tier alone at GQA 1 and 4, then mixed tiers.
#[test]
fn gpu_matches_interpreter_on_random_vq_values() {
    use kvcc::compiler::back::ptx::tensor_core_phases;
    use kvcc::compiler::target::Target;
    use kvcc::runtime::tune::KernelConfig;
    let seed = fresh_seed("gpu_random_vq_values");
    let mut formats = Vec::new();
    for source in common::random_vq_value_specs(seed, 8) {
        let format = Format::parse(&source, "vq.toml")
            .unwrap_or_else(|e| panic!("generated spec rejected: {e}\n{source}"));
        for target in [Target::Sm80, Target::Sm90] {
            let options = KernelConfig::reference(&format).options(target, 4);
            for tier in 0..format.tiers().len() {
                assert!(
                    tensor_core_phases(&format, tier, &options).accumulate,
                    "tier {tier} on {target:?}: values not looked up for the tensor cores\n{source}"
                );
            }
        }
        formats.push(format);
    }
    let Some(executor) = gpu("gpu_matches_interpreter_on_random_vq_values") else {
        return;
    };
    check_tiers(&executor, &formats, seed, &[1, 4], 4);
}

#[test]
fn gpu_matches_interpreter_on_random_specs() {
    let Some(executor) = gpu("gpu_matches_interpreter_on_random_specs") else {
        return;
    };
    let seed = fresh_seed("gpu_random_specs");
    for (i, source) in common::random_specs(seed, 24).iter().enumerate() {
        let format = Format::parse(source, "random.toml")
            .unwrap_or_else(|e| panic!("generated spec rejected: {e}\n{source}"));
        let tiers = format.tiers().len();
        let group = [1, 2, 4][i % 3];
        check(
            &executor,
            &format,
            seed + i as u64,
            2,
            group,
            &|s, p| (s * 7 + p) % tiers,
            &format!("random spec {i}:\n{source}"),
        );
    }
}

/// Bitmap masks with any number of set bits
/// ([`common::scrambled_bitmap_masks`]), on tiers whose bitmaps the tensor
/// cores read expanded or gathered.
#[test]
fn gpu_reads_bitmap_masks_with_any_number_of_set_bits() {
    let Some(executor) = gpu("gpu_reads_bitmap_masks_with_any_number_of_set_bits") else {
        return;
    };
    let seed = fresh_seed("gpu_bitmap_masks");
    let scramble = scrambled_bitmap_masks(seed);
    for (what, format) in bitmap_mask_specs() {
        let (cache, queries) =
            cache_and_queries(&format, seed, 2, 8, &LENGTHS, &|_, _| 0, &scramble);
        check_cache(&executor, &format, &cache, &queries, 8, &what);
    }
}

/// Kernel configurations other than the default (what `kvcc tune` sweeps)
/// compute the same outputs; a configuration or kernels for another page size
/// than the pages' are refused before anything runs.
#[test]
fn gpu_tuning_space_matches_interpreter_and_page_size_is_enforced() {
    use kvcc::runtime::cuda::measure::max_rel_error;
    use kvcc::runtime::cuda::{CudaError, DeviceCache, FormatKernels};
    use kvcc::runtime::tune::{KernelConfig, TuneError};

    let Some(executor) = gpu("gpu_tuning_space_matches_interpreter_and_page_size_is_enforced")
    else {
        return;
    };
    let gpu = executor.gpu();
    let seed = fresh_seed("gpu_tuning_space_matches_interpreter_and_page_size_is_enforced");
    for format in bundled() {
        let plan = |s: usize, p: usize| (s + p) % format.tiers().len();
        let (cache, queries) =
            cache_and_queries(&format, seed, 2, 8, &LENGTHS, &plan, &encode_page);
        let want = Interpreter::new(format.tiers(), Options::default())
            .decode(&cache.view(), &queries, 8)
            .expect("interpreter");
        let default = KernelConfig::reference(&format);
        let kernels_of = |config: KernelConfig| {
            FormatKernels::load_configs(gpu, &format, &vec![config; format.tiers().len()], 4)
                .unwrap_or_else(|e| panic!("{} {config}: {e}", format.name()))
        };
        // One upload serves every configuration (as `kvcc tune` and `kvcc
        // bench` reuse theirs): what depends on the kernel is the step's.
        let uploaded = DeviceCache::upload(gpu, &kernels_of(default), &cache).expect("upload");
        // Pipelined with partial and empty tiles, a warp without a token
        // tile and values loading two tiles ahead.
        let partial_pipelined = KernelConfig {
            splits: Some(3),
            schedule: Schedule {
                pipeline: true,
                warps: 2,
                tile_items: Some(16),
                stages: 3,
                ..default.schedule
            },
            ..default
        };
        for config in [
            KernelConfig {
                splits: Some(3),
                schedule: Schedule {
                    warps: 2,
                    stages: 3,
                    ..default.schedule
                },
                ..default
            },
            KernelConfig {
                schedule: Schedule {
                    warps: 8,
                    head_block: 4,
                    max_accumulators: 16,
                    stages: 4,
                    ..default.schedule
                },
                ..default
            },
            KernelConfig {
                splits: Some(1),
                schedule: Schedule {
                    tile_items: Some(32),
                    ..default.schedule
                },
                ..default
            },
            // Tiles of 22, 22 and 20 items: the last box of a swizzled
            // tensor copy reaches past the page (zero-filled).
            KernelConfig {
                schedule: Schedule {
                    tile_items: Some(24),
                    ..default.schedule
                },
                ..default
            },
            KernelConfig {
                schedule: Schedule {
                    tile_items: Some(16),
                    stages: 4,
                    ..default.schedule
                },
                ..default
            },
            KernelConfig {
                schedule: Schedule {
                    tensor_cores: false,
                    ..default.schedule
                },
                ..default
            },
            // Bulk copies forced on (rows a multiple of 32 bytes unpadded)
            // and off.
            KernelConfig {
                schedule: Schedule {
                    bulk_copies: Some(true),
                    ..default.schedule
                },
                ..default
            },
            KernelConfig {
                schedule: Schedule {
                    bulk_copies: Some(false),
                    ..default.schedule
                },
                ..default
            },
            KernelConfig {
                schedule: Schedule {
                    pipeline: true,
                    ..default.schedule
                },
                ..default
            },
            partial_pipelined,
            // The same with bulk copies forced on.
            KernelConfig {
                schedule: Schedule {
                    bulk_copies: Some(true),
                    ..partial_pipelined.schedule
                },
                ..partial_pipelined
            },
        ] {
            let kernels = kernels_of(config);
            let device = &uploaded;
            let mut step = kvcc::runtime::cuda::DeviceDecode::new(gpu, &kernels, device, 8, None)
                .expect("decode step");
            step.set_queries(gpu, &kernels, device, &queries)
                .expect("queries");
            step.poison(gpu).expect("poison");
            step.launch(gpu, &kernels, device).expect("launch");
            let got = step
                .output(gpu, device, format.head_dim() as usize)
                .expect("output");
            let error = max_rel_error(&got, &want, format.head_dim() as usize);
            assert!(
                error <= 1e-4,
                "{} {config}: max relative error {error:.2e}",
                format.name()
            );
        }
        // A step keeps what it was made for: launched with kernels of another
        // tile (whose tensor copies move other boxes), it is refused.
        let made_for = kernels_of(KernelConfig {
            schedule: Schedule {
                bulk_copies: Some(true),
                ..default.schedule
            },
            ..default
        });
        let other = kernels_of(KernelConfig {
            schedule: Schedule {
                bulk_copies: Some(true),
                tile_items: Some(16),
                ..default.schedule
            },
            ..default
        });
        let mut step = kvcc::runtime::cuda::DeviceDecode::new(gpu, &made_for, &uploaded, 8, None)
            .expect("decode step");
        step.set_queries(gpu, &made_for, &uploaded, &queries)
            .expect("queries");
        let launched = step.launch(gpu, &other, &uploaded);
        assert_eq!(
            matches!(launched, Err(CudaError::Shape(_))),
            made_for.tensor_copies(),
            "{}: {launched:?}",
            format.name()
        );
        // …and so is another cache, even one of the same pages: the step's
        // buffers and tensor maps are its own cache's.
        let again = DeviceCache::upload(gpu, &made_for, &cache).expect("upload");
        let launched = step.launch(gpu, &made_for, &again);
        assert!(
            matches!(launched, Err(CudaError::Shape(_))),
            "{}: {launched:?}",
            format.name()
        );
        // A configuration tuned for pages twice as large cannot load for these…
        let pages = format.spec().page.items;
        let other = KernelConfig {
            page_items: 2 * pages,
            ..default
        };
        let refused =
            FormatKernels::load_configs(gpu, &format, &vec![other; format.tiers().len()], 4);
        assert!(
            matches!(
                refused,
                Err(CudaError::Tune(TuneError::PageSize { tuned, pages: p }))
                    if tuned == 2 * pages && p == pages
            ),
            "{}: {:?}",
            format.name(),
            refused.err()
        );
        // …and kernels generated for the larger pages refuse a cache of these.
        let paged = other.paged_format(&format).expect("larger-page variant");
        let kernels =
            FormatKernels::load_configs(gpu, &paged, &vec![other; format.tiers().len()], 4)
                .expect("larger-page kernels");
        let upload = DeviceCache::upload(gpu, &kernels, &cache);
        assert!(
            matches!(
                upload,
                Err(CudaError::Tune(TuneError::PageSize { tuned, pages: p }))
                    if tuned == 2 * pages && p == pages
            ),
            "{}: page size mismatch not refused",
            format.name()
        );
    }
}

/// Every bundled format, its tiers mixed over sequences of `lengths` (2 kv
/// heads, GQA 4), decoded by one step (`splits` per tier, else the kernels'
/// own) that `run` launches once the queries are set; `run` poisons the
/// output first. Every output element checked against the interpreter.
fn check_mixed_tier_steps(test: &str, lengths: &[usize], splits: Option<u32>, run: StepRun) {
    use kvcc::runtime::cuda::measure::max_rel_error;
    use kvcc::runtime::cuda::{DeviceCache, DeviceDecode, FormatKernels};
    use kvcc::runtime::tune::KernelConfig;

    let Some(executor) = gpu(test) else {
        return;
    };
    let gpu = executor.gpu();
    let seed = fresh_seed(test);
    for format in bundled() {
        let tiers = format.tiers().len();
        let plan = |s: usize, p: usize| (s + p) % tiers;
        let (cache, queries) = cache_and_queries(&format, seed, 2, 8, lengths, &plan, &encode_page);
        let want = Interpreter::new(format.tiers(), Options::default())
            .decode(&cache.view(), &queries, 8)
            .expect("interpreter");
        let configs = vec![KernelConfig::reference(&format); tiers];
        let kernels = FormatKernels::load_configs(gpu, &format, &configs, 4)
            .unwrap_or_else(|e| panic!("{}: {e}", format.name()));
        let device = DeviceCache::upload(gpu, &kernels, &cache).expect("upload");
        let splits = splits.map(|s| vec![s; tiers]);
        let mut step = DeviceDecode::new(gpu, &kernels, &device, 8, splits).expect("decode step");
        step.set_queries(gpu, &kernels, &device, &queries)
            .expect("queries");
        run(gpu, &kernels, &device, &mut step, format.name());
        let got = step
            .output(gpu, &device, format.head_dim() as usize)
            .expect("output");
        let error = max_rel_error(&got, &want, format.head_dim() as usize);
        assert!(
            error <= 1e-4,
            "{}: max relative error {error:.2e}",
            format.name()
        );
    }
}

/// How [`check_mixed_tier_steps`] runs a step: GPU, kernels, cache, the
/// step, the format's name.
type StepRun = fn(
    &kvcc::runtime::cuda::Gpu,
    &kvcc::runtime::cuda::FormatKernels,
    &kvcc::runtime::cuda::DeviceCache,
    &mut kvcc::runtime::cuda::DeviceDecode,
    &str,
);

/// Rows of many partials, most of them empty: each tier split up to 70 ways
/// over sequences of 1 to 12000 tokens. The merge's thread groups (4 of 16
/// slots a run) then walk several runs, and some find none live.
#[test]
fn gpu_merges_rows_of_many_mostly_empty_partials() {
    check_mixed_tier_steps(
        "gpu_merges_rows_of_many_mostly_empty_partials",
        &[1, 150, 12000],
        Some(70),
        |gpu, kernels, device, step, name| {
            // Splits stop at a row's pages: 12000 tokens hold 94 to 188 pages.
            assert!(step.slots() > 64, "{name}: {} slots", step.slots());
            step.poison(gpu).expect("poison");
            step.launch(gpu, kernels, device).expect("launch");
        },
    );
}

/// A decode step captured as a CUDA graph (`kvcc bench --timing graph`)
/// writes, replayed, what the interpreter computes; the output is poisoned
/// between capture and replay.
#[test]
fn gpu_captured_steps_replay_as_launched() {
    check_mixed_tier_steps(
        "gpu_captured_steps_replay_as_launched",
        &LENGTHS,
        None,
        |gpu, kernels, device, step, name| {
            let graph =
                (step.capture(gpu, kernels, device)).unwrap_or_else(|e| panic!("{name}: {e}"));
            step.poison(gpu).expect("poison");
            graph.launch().expect("replay");
        },
    );
}

#[path = "support/encode_check.rs"]
mod encode_check;

/// The GPU page-compress kernels write, for every bundled tier, pages
/// byte-identical to the CPU encoder's (`support/encode_check.rs`).
#[test]
fn gpu_encoders_match_cpu_encoder_on_every_bundled_tier() {
    let Some(executor) = gpu("gpu_encoders_match_cpu_encoder_on_every_bundled_tier") else {
        return;
    };
    let seed = fresh_seed("gpu_encoders_bundled");
    for format in bundled() {
        encode_check::check_encoder(executor.gpu(), &format, seed, format.name());
    }
    // Pages in chunks: the page scales' pass, then the items'.
    let chunked = Format::parse(encode_check::CHUNKED_SPEC, "chunked.toml").expect("valid");
    encode_check::check_encoder_within(
        executor.gpu(),
        &chunked,
        seed,
        "chunked pages",
        encode_check::CHUNKED_SHARED_BYTES,
    );
}

/// The same on random specs: every transform, body and page scale kind.
#[test]
fn gpu_encoders_match_cpu_encoder_on_random_specs() {
    let Some(executor) = gpu("gpu_encoders_match_cpu_encoder_on_random_specs") else {
        return;
    };
    let seed = fresh_seed("gpu_encoders_random_specs");
    for (i, source) in common::random_specs(seed, 16).iter().enumerate() {
        let format = Format::parse(source, "random.toml")
            .unwrap_or_else(|e| panic!("generated spec rejected: {e}\n{source}"));
        let what = format!("random spec {i} (KVCC_TEST_SEED={seed}):\n{source}");
        encode_check::check_encoder(executor.gpu(), &format, seed + i as u64, &what);
    }
}
