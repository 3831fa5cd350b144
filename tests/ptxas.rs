//! Every generated kernel assembles with ptxas for sm_80 and sm_90 with no
//! local memory: no spill stores or loads, no stack frame, no `lmem`. Covers the
//! bundled specs (and checks their committed `.report` files when made by the
//! same ptxas version) and a handful of randomly generated valid specs with
//! random tile options per run (fresh seed printed; `KVCC_TEST_SEED` replays).
//!
//! ptxas comes from `nvidia-cuda-nvcc` (see `tests/support/ptxas.rs`); without
//! it the tests skip, unless `KVCC_REQUIRE_PTXAS=1`.

mod common;
#[path = "support/ptxas.rs"]
mod ptxas;

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use kvcc::compiler::back::ptx::{self, Options, Schedule};
use kvcc::compiler::spec::{
    BasisDtype, BitmapElem, CodecSpec, CodewordKind, CoeffScale, DenseDtype, FieldSpec, FormatSpec,
    Fp8Scale, PageSpec, RadiusScale, TableDtype, TierSpec, TransformSpec,
};
use kvcc::compiler::target::Target;
use kvcc::compiler::Format;

/// Random specs per run.
const RANDOM_SPECS: usize = 5;

/// A module to assemble: what it is, its PTX, its target and its dynamic
/// shared memory (for the report).
struct Job {
    what: String,
    ptx: String,
    target: Target,
    shared_bytes: u32,
    report: Option<PathBuf>,
}

fn jobs_of(what: &str, output: &ptx::Output, dir: Option<&Path>) -> Vec<Job> {
    let target = output.target;
    let mut jobs: Vec<Job> = output
        .tiers
        .iter()
        .map(|t| Job {
            what: format!("{what}/{} ({})", t.tier, target.name()),
            ptx: t.ptx.clone(),
            target,
            shared_bytes: t.kernel.shared_bytes,
            report: dir.map(|d| {
                d.join(ptx::file_name(&t.tier, target))
                    .with_extension("report")
            }),
        })
        .collect();
    jobs.push(Job {
        what: format!("{what}/merge ({})", target.name()),
        ptx: output.merge.ptx.clone(),
        target,
        shared_bytes: output.merge.kernel.shared_bytes,
        report: dir.map(|d| {
            d.join(ptx::merge_file_name(target))
                .with_extension("report")
        }),
    });
    jobs
}

/// Assembles the jobs on two threads; returns every problem found.
fn assemble_all(assembler: &Path, jobs: Vec<Job>) -> Vec<String> {
    let version = ptxas::version(assembler);
    let queue = Mutex::new(jobs);
    let problems = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| loop {
                let Some(job) = queue.lock().unwrap().pop() else {
                    break;
                };
                let found = match ptxas::assemble(assembler, &job.ptx, job.target) {
                    Err(messages) => vec![format!("{}: ptxas failed:\n{messages}", job.what)],
                    Ok(resources) => {
                        let mut found: Vec<String> = resources
                            .iter()
                            .flat_map(|r| r.problems())
                            .map(|p| format!("{}: {p}", job.what))
                            .collect();
                        if resources.len() != 1 {
                            found.push(format!("{}: expected one kernel", job.what));
                        }
                        if let Some(path) = &job.report {
                            found.extend(check_report(path, &version, &job, &resources));
                        }
                        found
                    }
                };
                problems.lock().unwrap().extend(found);
            });
        }
    });
    problems.into_inner().unwrap()
}

/// A committed report made by this ptxas version must match what it says now.
fn check_report(
    path: &Path,
    version: &str,
    job: &Job,
    resources: &[ptxas::Resources],
) -> Option<String> {
    let committed = std::fs::read_to_string(path).ok()?;
    let fresh = ptxas::report(version, job.target, job.shared_bytes, resources);
    (ptxas::report_version(&committed) == Some(version) && committed != fresh).then(|| {
        format!(
            "{}: {} is stale (rerun the generated_ptx test with KVCC_BLESS=1):\n{fresh}",
            job.what,
            path.display()
        )
    })
}

#[test]
fn bundled_kernels_assemble_without_local_memory() {
    let Some(assembler) = ptxas::find_or_skip("bundled_kernels_assemble") else {
        return;
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("generated");
    let mut jobs = Vec::new();
    for format in common::bundled() {
        for target in Target::ALL {
            let output = ptx::write(&format, &Options::for_target(target))
                .unwrap_or_else(|e| panic!("{}: {e}", format.name()));
            jobs.extend(jobs_of(
                format.name(),
                &output,
                Some(&root.join(format.name())),
            ));
        }
    }
    let problems = assemble_all(&assembler, jobs);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn random_specs_assemble_without_local_memory() {
    let Some(assembler) = ptxas::find_or_skip("random_specs_assemble") else {
        return;
    };
    let seed = common::fresh_seed("random_specs_assemble");
    let mut rng = Rng(seed);
    let mut jobs = Vec::new();
    for index in 0..RANDOM_SPECS {
        let (format, spec) = loop {
            let spec = random_spec(&mut rng, index);
            // Specs over the checker's shared-memory estimate are redrawn.
            if let Ok(format) = Format::compile(spec.clone()) {
                break (format, spec);
            }
        };
        let mut options = random_options(&mut rng, index);
        // A fixed tile may not fit; automatic tiles always must.
        if let Err(ptx::Error::SharedMemory { .. }) = ptx::write(&format, &options) {
            options.schedule.tile_items = None;
        }
        // The checker admits what the roomiest target holds: a spec that only
        // sm_90 fits is refused on sm_80 with that error, and assembled for sm_90.
        if let Err(ptx::Error::SharedMemory { .. }) = ptx::write(&format, &options) {
            options.target = Target::roomiest();
        }
        let output = ptx::write(&format, &options).unwrap_or_else(|e| {
            panic!("seed {seed}, spec {index}: {e}\noptions {options:?}\n{spec:#?}")
        });
        // Shown with a failure (the test harness captures it otherwise).
        eprintln!("spec {index}: {options:?}\n{spec:#?}");
        jobs.extend(jobs_of(&format!("seed {seed} spec {index}"), &output, None));
    }
    let problems = assemble_all(&assembler, jobs);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// What the random specs once found (seed 1795297849463998009): head_dim 256
/// with 8 query heads holds too many registers for the tensor cores (their
/// kernel spilled on sm_80), so the tier must take the fma path there.
#[test]
fn long_heads_in_wide_groups_assemble_without_local_memory() {
    let Some(assembler) = ptxas::find_or_skip("long_heads_in_wide_groups_assemble") else {
        return;
    };
    let text = r#"
        name = "wide"
        head_dim = 256
        [page]
        items = 64
        max_query_group = 8
        [[tier]]
        name = "t0"
        key.field = [{ kind = "coeff", bits = 8, scale = "page_component" }]
        value.transform = { kind = "hadamard" }
        value.field = [{ kind = "coeff", bits = 4, scale = "item" }]
    "#;
    let format = Format::parse(text, "wide.toml").expect("a valid spec");
    let mut jobs = Vec::new();
    for target in Target::ALL {
        let options = Options {
            schedule: Schedule {
                warps: 8,
                tile_items: Some(16),
                tile_bytes: 16384,
                head_block: 2,
                max_accumulators: 16,
                ..Schedule::default()
            },
            ..Options::for_target(target)
        };
        let output = ptx::write(&format, &options).expect("the kernel fits");
        jobs.extend(jobs_of("wide", &output, None));
    }
    let problems = assemble_all(&assembler, jobs);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The tuning space's corners (`tests/gpu.rs` runs them against the
/// interpreter) for the 2- and 3-bit asymmetric tiers: every configuration
/// writes its kernels, and they assemble with no local memory.
#[test]
fn kivi2_tuning_space_assembles_without_local_memory() {
    let Some(assembler) = ptxas::find_or_skip("kivi2_tuning_space_assembles") else {
        return;
    };
    let format = (common::bundled().into_iter())
        .find(|f| f.name() == "kivi2")
        .expect("the bundled kivi2 spec");
    // (warps, tile items, stages, head block, pipeline)
    let corners: [(u32, Option<u32>, u32, u32, bool); 6] = [
        (2, Some(16), 3, 4, true),
        (4, Some(32), 2, 8, false),
        (8, Some(128), 4, 4, true),
        (8, Some(64), 2, 8, false),
        (4, None, 3, 8, true),
        (2, Some(48), 2, 4, false),
    ];
    let mut jobs = Vec::new();
    for (i, &(warps, tile_items, stages, head_block, pipeline)) in corners.iter().enumerate() {
        let target = Target::ALL[i % 2];
        let options = Options {
            schedule: Schedule {
                warps,
                tile_items,
                stages,
                head_block,
                pipeline,
                ..Schedule::default()
            },
            ..Options::for_target(target)
        };
        let output =
            ptx::write(&format, &options).unwrap_or_else(|e| panic!("kivi2 {options:?}: {e}"));
        jobs.extend(jobs_of(&format!("kivi2 {options:?}"), &output, None));
    }
    let problems = assemble_all(&assembler, jobs);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % u64::from(n)) as u32
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u32) as usize]
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
    /// A divisor of `n` from `candidates` (1 always qualifies).
    fn divisor(&mut self, n: u32, candidates: &[u32]) -> u32 {
        let fitting: Vec<u32> = candidates
            .iter()
            .copied()
            .filter(|&c| n.is_multiple_of(c))
            .collect();
        if fitting.is_empty() {
            1
        } else {
            self.pick(&fitting)
        }
    }
}

/// Codec `slot` of a run cycles through every body kind and transform, so a
/// handful of specs covers them all; sizes are random.
fn random_codec(rng: &mut Rng, head_dim: u32, slot: usize) -> CodecSpec {
    let power_of_two = head_dim.is_power_of_two();
    let transform = match slot % 4 {
        1 if power_of_two => TransformSpec::Hadamard,
        2 if power_of_two => TransformSpec::Srht { seed: rng.next() },
        3 => TransformSpec::Pca {
            rank: loop {
                let rank = rng.pick(&[1, 3, 8, 12, 16, 24, 32, 48, 64, 96, 128]);
                if rank <= head_dim {
                    break rank;
                }
            },
            basis: if rng.coin() {
                BasisDtype::I8
            } else {
                BasisDtype::F16
            },
        },
        _ => TransformSpec::Identity,
    };
    let n = transform.dims(head_dim);
    let book = |rng: &mut Rng, bits_max: u32| {
        (
            rng.divisor(n, &[1, 2, 3, 4, 8, 16]),
            1 + rng.below(bits_max),
            rng.coin(),
            if rng.coin() {
                TableDtype::F32
            } else {
                TableDtype::F16
            },
        )
    };
    let fields = match slot % 5 {
        0 => {
            let dtype = rng.pick(&[
                DenseDtype::F16,
                DenseDtype::Bf16,
                DenseDtype::F32,
                DenseDtype::Fp8e4m3,
                DenseDtype::Fp8e5m2,
            ]);
            let scales = [
                None,
                Some(Fp8Scale::Tensor),
                Some(Fp8Scale::Head),
                Some(Fp8Scale::Page),
                Some(Fp8Scale::Item),
            ];
            let scale = dtype.fp8().and_then(|_| rng.pick(&scales));
            vec![FieldSpec::Dense { dtype, scale }]
        }
        1 => {
            let scale = rng.pick(&[
                CoeffScale::Item,
                CoeffScale::Group,
                CoeffScale::Page,
                CoeffScale::PageComponent,
                CoeffScale::Component,
            ]);
            vec![FieldSpec::Coeff {
                bits: rng.pick(&[2, 3, 4, 8]),
                scale,
                zero_point: rng.coin(),
                group: (scale == CoeffScale::Group).then(|| rng.divisor(n, &[8, 16, 32, 64])),
            }]
        }
        2 => {
            let (group_size, bits, per_group, dtype) = book(rng, 8);
            vec![FieldSpec::Codebook {
                group_size,
                bits,
                codewords: CodewordKind::Vector,
                per_group,
                dtype,
            }]
        }
        3 => {
            let (group_size, bits, per_group, dtype) = book(rng, 6);
            vec![
                FieldSpec::Radius {
                    group_size,
                    bits: 1 + rng.below(16),
                    scale: rng.pick(&[RadiusScale::Page, RadiusScale::PageGroup]),
                },
                FieldSpec::Codebook {
                    group_size,
                    bits,
                    codewords: CodewordKind::Direction,
                    per_group,
                    dtype,
                },
            ]
        }
        _ => {
            // Mask words are 32 bits: groups must be at most 32 or a multiple of 32.
            let sizes: Vec<u32> = [1, 2, 4]
                .into_iter()
                .filter(|&g| n.is_multiple_of(g) && (n / g <= 32 || (n / g).is_multiple_of(32)))
                .collect();
            match sizes.is_empty() {
                true => vec![FieldSpec::Dense {
                    dtype: DenseDtype::F16,
                    scale: None,
                }],
                false => {
                    let group_size = rng.pick(&sizes);
                    vec![FieldSpec::Bitmap {
                        group_size,
                        keep: 1 + rng.below(n / group_size),
                        elem: rng.pick(&[
                            BitmapElem::F16,
                            BitmapElem::Int8,
                            BitmapElem::Fp8e4m3,
                            BitmapElem::Fp8e5m2,
                        ]),
                    }]
                }
            }
        }
    };
    CodecSpec { transform, fields }
}

fn random_spec(rng: &mut Rng, index: usize) -> FormatSpec {
    let head_dim = if index.is_multiple_of(2) {
        rng.pick(&[16, 32, 64, 128, 256])
    } else {
        8 * (2 + rng.below(31))
    };
    let tiers = 1 + rng.below(2) as usize;
    FormatSpec {
        name: format!("random{index}"),
        description: None,
        head_dim,
        page: PageSpec {
            items: rng.pick(&[1, 5, 16, 33, 64, 128]),
            max_query_group: rng.pick(&[1, 2, 3, 4, 8]),
        },
        cache: Default::default(),
        tiers: (0..tiers)
            .map(|t| {
                let slot = 2 * (index * 2 + t);
                TierSpec {
                    name: format!("t{t}"),
                    key: random_codec(rng, head_dim, slot),
                    value: random_codec(rng, head_dim, slot + 1 + index),
                }
            })
            .collect(),
    }
}

fn random_options(rng: &mut Rng, index: usize) -> Options {
    Options {
        target: Target::ALL[index % 2],
        query_group: None,
        schedule: Schedule {
            warps: rng.pick(&[1, 2, 4, 8]),
            tile_items: if rng.coin() {
                None
            } else {
                Some(1 + rng.below(64))
            },
            tile_bytes: rng.pick(&[4096, 16 * 1024, 40 * 1024]),
            stages: rng.pick(&[2, 3, 4]),
            head_block: 1 + rng.below(8),
            max_accumulators: rng.pick(&[4, 16, 32]),
            tensor_cores: rng.coin(),
            pipeline: rng.coin(),
            bulk_copies: rng.pick(&[None, Some(true), Some(false)]),
        },
    }
}

/// KIVI's asymmetric keys (`tests/in/tensor-cores/asymmetric_keys.toml`) on
/// the integer tensor cores at 2, 3, 4 and 8 bits (2-bit rows in 8-byte
/// chunks, 3-bit in 12-byte ones, a score bias per page): the kernels
/// assemble with no local memory.
#[test]
fn asymmetric_keys_on_the_tensor_cores_assemble_without_local_memory() {
    let Some(assembler) = ptxas::find_or_skip("asymmetric_keys_assemble") else {
        return;
    };
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/in/tensor-cores/asymmetric_keys.toml");
    let format = Format::load(&path).expect("the test spec");
    let mut jobs = Vec::new();
    for target in Target::ALL {
        let output = ptx::write(&format, &Options::for_target(target)).expect("the kernels fit");
        for tier in &output.tiers {
            assert!(
                tier.ptx.contains("tensor-core score"),
                "{}: keys not scored on the tensor cores",
                tier.tier
            );
        }
        jobs.extend(jobs_of("asymmetric_keys", &output, None));
    }
    let problems = assemble_all(&assembler, jobs);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn page_selection_kernels_assemble_without_local_memory() {
    let Some(assembler) = ptxas::find_or_skip("page_selection_kernels_assemble") else {
        return;
    };
    use kvcc::compiler::layout::summary::SummaryLayout;
    use kvcc::compiler::spec::ExactDtype;
    use kvcc::runtime::live::serving_format;
    let selects = [
        "method = \"quest\"\npages = 4",
        "method = \"quest\"\ngroup = \"sum\"\ntokens = 4096",
        "method = \"block_mean\"\npages = 4",
        "method = \"block_mean\"\nblock = 16\ngroup = \"sum\"\npages = 4",
    ];
    let mut problems = Vec::new();
    let specs = [
        "specs/dense_f16.toml",
        "specs/kivi.toml",
        "specs/subspace.toml",
    ];
    for (file, source) in (kvcc::runtime::builtin::SPECS.iter()).filter(|(f, _)| specs.contains(f))
    {
        for (i, select) in selects.iter().enumerate() {
            let text = format!("{source}\n[cache.select]\n{select}\n");
            let format = Format::parse(&text, file).unwrap_or_else(|e| panic!("{e}"));
            let summary = SummaryLayout::of(format.spec()).expect("a selection");
            let exact = [ExactDtype::F16, ExactDtype::Bf16][i % 2];
            let serving = serving_format(&format, exact).unwrap();
            let exact = serving.format.layout(serving.exact_tier);
            for (target, group) in Target::ALL
                .into_iter()
                .flat_map(|t| [1, 4, 8].map(|g| (t, g)))
            {
                let (text, _) = ptx::write_select(format.name(), &summary, exact, group, target)
                    .unwrap_or_else(|e| panic!("{}: {e}", format.name()));
                let what = format!(
                    "{} select {i} group {group} ({})",
                    format.name(),
                    target.name()
                );
                match ptxas::assemble(&assembler, &text, target) {
                    Err(messages) => problems.push(format!("{what}: ptxas failed:\n{messages}")),
                    Ok(resources) => {
                        problems.extend(
                            resources
                                .iter()
                                .flat_map(|r| r.problems())
                                .map(|p| format!("{what}: {p}")),
                        );
                        if resources.len() != 3 {
                            problems.push(format!("{what}: {} kernels, not 3", resources.len()));
                        }
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
