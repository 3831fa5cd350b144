//! Snapshot test: the PTX of every bundled spec, tier and target is committed
//! under `generated/<format>/<tier>.<target>.ptx` (and the format's merge
//! kernel as `merge.<target>.ptx`); a change in the backend or in lowering
//! shows up as a diff there. `KVCC_BLESS=1` rewrites the files after review and,
//! when ptxas is available (see `tests/support/ptxas.rs`), the resource report
//! beside each (`.report`: registers, shared memory, stack, spills).

mod common;
#[path = "support/ptxas.rs"]
mod ptxas;

use std::path::PathBuf;

use kvcc::compiler::back::ptx::{self, Options, Schedule};
use kvcc::compiler::target::Target;

#[test]
fn generated_ptx_matches_the_committed_snapshots() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("generated");
    let bless = std::env::var_os("KVCC_BLESS").is_some();
    let assembler = if bless {
        ptxas::find_or_skip("generated_ptx (reports)")
    } else {
        None
    };
    let mut stale = Vec::new();
    for format in common::bundled() {
        let dir = root.join(format.name());
        for target in Target::ALL {
            let output = ptx::write(&format, &Options::for_target(target))
                .unwrap_or_else(|e| panic!("{}: {e}", format.name()));
            let mut files: Vec<(String, &str, u32)> = output
                .tiers
                .iter()
                .map(|t| {
                    (
                        ptx::file_name(&t.tier, target),
                        t.ptx.as_str(),
                        t.kernel.shared_bytes,
                    )
                })
                .collect();
            files.push((
                ptx::merge_file_name(target),
                output.merge.ptx.as_str(),
                output.merge.kernel.shared_bytes,
            ));
            for (name, fresh, shared_bytes) in files {
                let path = dir.join(&name);
                if bless {
                    std::fs::create_dir_all(&dir).unwrap();
                    std::fs::write(&path, fresh).unwrap();
                    if let Some(assembler) = &assembler {
                        let resources = ptxas::assemble(assembler, fresh, target)
                            .unwrap_or_else(|e| panic!("{}: ptxas failed:\n{e}", path.display()));
                        let report = ptxas::report(
                            &ptxas::version(assembler),
                            target,
                            shared_bytes,
                            &resources,
                        );
                        std::fs::write(path.with_extension("report"), report).unwrap();
                    }
                } else {
                    if std::fs::read_to_string(&path).ok().as_deref() != Some(fresh) {
                        stale.push(path.display().to_string());
                    }
                    if !path.with_extension("report").exists() {
                        stale.push(format!(
                            "{} (missing)",
                            path.with_extension("report").display()
                        ));
                    }
                }
            }
        }
    }
    assert!(
        stale.is_empty(),
        "generated PTX differs from the snapshots (review, then rerun with KVCC_BLESS=1 and ptxas \
         available):\n{}",
        stale.join("\n")
    );
}

/// The tensor cores serve the tiers whose codes are exact f16 operands: the
/// accumulate of every tier with f16, fp8 (widened on sm_90) or integer
/// value elements (dense f16, Spherical's f16 values, KIVI, fp8) or f16
/// bitmap groups (MosaicKV, expanded per tile), the score where the key is
/// a dot product of such elements with the query (dense f16, KIVI, MosaicKV,
/// fp8, kivi2's 2- and 3-bit codes with zero points); with `tensor_cores`
/// off every tier is per-thread fma chains.
/// Grouped and asymmetric values (`tests/in/tensor-cores/`) accumulate on
/// the tensor cores on both targets, whatever the GQA group.
#[test]
fn tensor_core_formats_accumulate_on_the_tensor_cores() {
    for format in common::tensor_core_formats() {
        for target in Target::ALL {
            for head_block in [1, 4, 8] {
                let options = Options {
                    schedule: Schedule {
                        head_block,
                        ..Schedule::default()
                    },
                    ..Options::for_target(target)
                };
                let output = ptx::write(&format, &options).expect("test formats generate");
                for tier in &output.tiers {
                    assert!(
                        tier.ptx.contains("tensor-core accumulate"),
                        "{}/{} on {target:?}, head block {head_block}: values not on the tensor cores",
                        format.name(),
                        tier.tier
                    );
                }
            }
        }
    }
}

#[test]
fn tensor_cores_serve_exactly_the_f16_exact_phases() {
    let mut served = Vec::new();
    for format in common::bundled() {
        for tensor_cores in [true, false] {
            let options = Options {
                schedule: Schedule {
                    tensor_cores,
                    ..Schedule::default()
                },
                ..Options::for_target(Target::Sm90)
            };
            let output = ptx::write(&format, &options).expect("bundled formats generate");
            for tier in &output.tiers {
                let name = format!("{}/{}", format.name(), tier.tier);
                assert!(
                    tensor_cores || !tier.ptx.contains("mma.sync"),
                    "{name}: mma with tensor cores off"
                );
                for phase in ["score", "accumulate"] {
                    if tier.ptx.contains(&format!("tensor-core {phase}")) {
                        served.push(format!("{name} {phase}"));
                    }
                }
            }
        }
    }
    assert_eq!(
        served,
        [
            "dense_f16/f16 score",
            "dense_f16/f16 accumulate",
            "spherical/high accumulate",
            "spherical/mid accumulate",
            "spherical/low accumulate",
            "kivi/int8 score",
            "kivi/int8 accumulate",
            "kivi/int4 score",
            "kivi/int4 accumulate",
            "subspace/rank32 score",
            "subspace/rank32 accumulate",
            "shard/pca64_vq score",
            "shard/pca64_vq accumulate",
            "mosaic/keep25 score",
            "mosaic/keep25 accumulate",
            "fp8/e4m3 score",
            "fp8/e4m3 accumulate",
            "kivi2/int2 score",
            "kivi2/int2 accumulate",
            "kivi2/int3 score",
            "kivi2/int3 accumulate",
        ]
    );
}

/// Bitmap fields take the tensor cores only with f16 elements (int8
/// elements are scaled per item, so not exact f16 operands): f16 bitmap
/// values with int8 bitmap keys expand the value rows and leave the score
/// per thread; int8 bitmap values keep the whole tier per thread.
#[test]
fn only_f16_bitmaps_reach_the_tensor_cores_whole_word_groups_gathered() {
    let spec = |key: &str, value: &str, value_group: u32| {
        format!(
            "name = \"bitmaps\"\nhead_dim = 64\n\n[page]\nitems = 64\n\n[[tier]]\nname = \"t\"\n\
             key.field = [{{ kind = \"bitmap\", group_size = 2, keep = 8, elem = \"{key}\" }}]\n\
             value.field = [{{ kind = \"bitmap\", group_size = {value_group}, keep = 8, elem = \"{value}\" }}]\n"
        )
    };
    let served = |key: &str, value: &str, value_group: u32| {
        let format =
            kvcc::compiler::Format::parse(&spec(key, value, value_group), "bitmaps.toml").unwrap();
        let output = ptx::write(&format, &Options::for_target(Target::Sm90)).unwrap();
        let ptx = &output.tiers[0].ptx;
        [
            "tensor-core score",
            "tensor-core accumulate",
            "expand the warp's bitmap rows",
            "key fragments gathered",
            "value fragments gathered",
        ]
        .map(|phase| ptx.contains(phase))
    };
    // Groups of one f16 are expanded into dense rows, whole words gathered.
    assert_eq!(served("f16", "f16", 1), [true, true, true, true, false]);
    assert_eq!(served("f16", "f16", 2), [true, true, false, true, true]);
    assert_eq!(served("int8", "f16", 2), [false, true, false, false, true]);
    assert_eq!(
        served("f16", "int8", 1),
        [false, false, false, false, false]
    );
}

#[test]
fn bulk_copies_and_swizzled_tensor_copies_where_documented() {
    let mut chosen = Vec::new();
    for format in common::bundled() {
        for (target, bulk_copies) in [
            (Target::Sm90, None),
            (Target::Sm90, Some(true)),
            (Target::Sm90, Some(false)),
            (Target::Sm80, Some(true)),
        ] {
            let options = Options {
                schedule: Schedule {
                    bulk_copies,
                    ..Schedule::default()
                },
                ..Options::for_target(target)
            };
            let output = ptx::write(&format, &options).expect("bundled formats generate");
            for tier in &output.tiers {
                let name = format!("{}/{}", format.name(), tier.tier);
                let bulk = tier.ptx.contains("cp.async.bulk.shared");
                let boxes = tier.ptx.contains("cp.async.bulk.tensor");
                let maps: Vec<u32> = tier.kernel.tensor_maps.iter().map(|m| m.slot).collect();
                // A tensor map per swizzled stream, and a box copy for each.
                assert_eq!(boxes, !maps.is_empty(), "{name}");
                assert!(
                    !boxes || maps == [0, 1],
                    "{name}: both streams swizzle or neither"
                );
                if target == Target::Sm80 || bulk_copies == Some(false) {
                    assert!(!bulk && !boxes, "{name}: bulk copies on {target:?}");
                    continue;
                }
                if bulk_copies.is_none() {
                    let path = match (boxes, bulk) {
                        (true, _) => "swizzled",
                        (false, true) => "bulk",
                        (false, false) => "cp.async",
                    };
                    chosen.push(format!("{name} {path}"));
                } else {
                    assert!(bulk, "{name}: no bulk copy with bulk_copies on");
                }
            }
        }
    }
    // By default bulk copies, but not where both streams' rows would be
    // padded and stay unswizzled (subspace, shard); dense f16 swizzles.
    assert_eq!(
        chosen,
        [
            "dense_f16/f16 swizzled",
            "spherical/high bulk",
            "spherical/mid bulk",
            "spherical/low bulk",
            "kivi/int8 bulk",
            "kivi/int4 bulk",
            "subspace/rank32 cp.async",
            "shard/pca64_vq cp.async",
            "mosaic/keep25 bulk",
            "fp8/e4m3 swizzled",
            "kivi2/int2 bulk",
            "kivi2/int3 bulk",
        ]
    );
}
