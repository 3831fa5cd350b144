//! The tune cache on the CPU: keying, invalidation when the spec (hence the
//! generated code) changes, corrupt and foreign files, export/import, the
//! runtime's lookup and its refusal of another page size, and the
//! `kvcc tune-cache` / `kvcc tune` commands' error paths.

use std::path::Path;
use std::process::Command;

use kvcc_compiler::back::ptx::Schedule;
use kvcc_compiler::Format;
use kvcc_runtime::tune::lookup::{resolve, Source};
use kvcc_runtime::tune::model;
use kvcc_runtime::tune::search::Strategy;
use kvcc_runtime::tune::store::Found;
use kvcc_runtime::tune::{
    Candidate, Entry, GpuId, KernelConfig, ShapeBucket, SweepRecord, TuneCache, TuneKey,
};

fn spec(bits: u32, items: u32) -> Format {
    Format::parse(
        &format!(
            "name = \"q\"\nhead_dim = 64\n[page]\nitems = {items}\n\
             [[tier]]\nname = \"int\"\n\
             key.field = [{{ kind = \"coeff\", bits = {bits}, scale = \"page_component\" }}]\n\
             value.field = [{{ kind = \"dense\", dtype = \"f16\" }}]\n\
             [[tier]]\nname = \"f16\"\n\
             key.field = [{{ kind = \"dense\", dtype = \"f16\" }}]\n\
             value.field = [{{ kind = \"dense\", dtype = \"f16\" }}]\n"
        ),
        "q.toml",
    )
    .unwrap()
}

fn h200() -> GpuId {
    GpuId {
        name: "NVIDIA H200".into(),
        compute_capability: (9, 0),
        driver_version: 13000,
    }
}

/// The H200 under another driver: another GPU key.
fn other_driver() -> GpuId {
    GpuId {
        driver_version: 12080,
        ..h200()
    }
}

fn shape() -> ShapeBucket {
    ShapeBucket::of(8, 32, 8, 32768)
}

/// What the cost model knows of the H200.
fn machine() -> model::Machine {
    model::Machine {
        target: h200().target(),
        multiprocessors: 132,
    }
}

fn candidate(config: KernelConfig, ms: Option<f64>) -> Candidate {
    Candidate {
        config,
        ms,
        min_ms: ms,
        max_ms: ms,
        max_rel_error: ms.map(|_| 1e-6),
        skipped: ms.is_none().then(|| "too much shared memory".to_string()),
    }
}

/// An entry for tier `tier` of `format` whose winner uses `winner_pages`-item
/// pages; at the spec's page size, 8 warps beat the default.
fn entry(format: &Format, tier: usize, gpu: &GpuId, winner_pages: u32) -> Entry {
    let default = KernelConfig::reference(format);
    let eight_warps = KernelConfig {
        schedule: Schedule {
            warps: 8,
            ..default.schedule
        },
        ..default
    };
    let winner = KernelConfig {
        page_items: winner_pages,
        schedule: Schedule {
            warps: 2,
            ..default.schedule
        },
        ..default
    };
    Entry {
        key: TuneKey::new(gpu, format, tier, shape()),
        default,
        winner,
        confirmation: None,
        candidates: vec![
            candidate(default, Some(0.40)),
            candidate(eight_warps, Some(0.35)),
            candidate(
                KernelConfig {
                    schedule: Schedule {
                        warps: 1,
                        ..default.schedule
                    },
                    ..default
                },
                None,
            ),
            candidate(winner, Some(0.30)),
        ],
        sweep: SweepRecord {
            search: Strategy::Descent,
            space_size: 480,
            seconds: 1.5,
            created: 0,
            kvcc_version: "test".into(),
        },
    }
}

#[test]
fn entries_round_trip_and_are_found_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nested").join("tune.json");
    let f = spec(8, 64);
    let mut cache = TuneCache::open(&path);
    assert!(cache.entries().is_empty() && cache.problems().is_empty());
    // Nothing tuned: defaults, with one reason for all tiers naming the command.
    let r = resolve(&[&cache], &h200(), machine(), &f, shape());
    let modeled: Vec<_> = (0..2)
        .map(|t| model::config_at(&f, t, shape(), machine()))
        .collect();
    assert_eq!(r.configs, modeled);
    assert_eq!(r.sources[0], r.sources[1]);
    match &r.sources[0] {
        Source::Default { reason } => assert!(
            reason.contains("tier int, f16 not tuned")
                && reason
                    .contains("kvcc tune --spec q --batch 8 --q-heads 32 --kv-heads 8 --ctx 32768"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
    cache.insert(entry(&f, 0, &h200(), 64));
    cache.save().unwrap();

    let reopened = TuneCache::open(&path);
    assert!(reopened.problems().is_empty(), "{:?}", reopened.problems());
    assert_eq!(reopened.entries().len(), 1);
    let key = TuneKey::new(&h200(), &f, 0, shape());
    match reopened.find(&key) {
        Found::Hit(e) => assert_eq!(e, &entry(&f, 0, &h200(), 64)),
        other => panic!("expected a hit, got {other:?}"),
    }
    // Every candidate is kept, including the skipped one and its reason.
    assert_eq!(reopened.entries()[0].candidates.len(), 4);
    assert!(reopened.entries()[0].candidates[2].skipped.is_some());
    // Another tier, GPU, driver or shape bucket misses.
    for miss in [
        TuneKey::new(&h200(), &f, 1, shape()),
        TuneKey::new(&other_driver(), &f, 0, shape()),
        TuneKey::new(&h200(), &f, 0, ShapeBucket::of(8, 32, 8, 8192)),
        TuneKey::new(&h200(), &f, 0, ShapeBucket::of(32, 32, 8, 32768)),
    ] {
        assert!(matches!(reopened.find(&miss), Found::Miss), "{miss:?}");
    }
    // A new length in the same bucket hits.
    let near = TuneKey::new(&h200(), &f, 0, ShapeBucket::of(8, 32, 8, 40000));
    assert!(matches!(reopened.find(&near), Found::Hit(_)));
}

#[test]
fn a_winner_that_loses_the_confirmation_leaves_the_default() {
    let f = spec(8, 64);
    let mut e = entry(&f, 0, &h200(), 64);
    // The search's fastest candidate was slower than the default when both
    // were timed alternately: the sweep keeps the default.
    e.confirmation = Some(kvcc_runtime::tune::store::Confirmation {
        default_ms: 0.40,
        winner_ms: 0.41,
        rounds: 3,
    });
    e.winner = e.default;
    assert_eq!(e.winner_ms(), Some(0.40));
    assert_eq!(e.default_ms(), Some(0.40));
    let dir = tempfile::tempdir().unwrap();
    let mut cache = TuneCache::open(&dir.path().join("t.json"));
    cache.insert(e);
    let r = resolve(&[&cache], &h200(), machine(), &f, shape());
    assert_eq!(r.configs[0], KernelConfig::reference(&f));
    assert!(matches!(r.sources[0], Source::Tuned { ms, default_ms: Some(d), .. } if ms == d));
}

#[test]
fn winners_of_related_entries_seed_a_search() {
    let dir = tempfile::tempdir().unwrap();
    let mut cache = TuneCache::open(&dir.path().join("t.json"));
    let f = spec(8, 64);
    let key = TuneKey::new(&h200(), &f, 0, shape());
    assert!(cache.related_winners(&key).is_empty());
    // The key's own entry is no seed; the same tier at another context, and
    // a stale entry (other generated code), are.
    cache.insert(entry(&f, 0, &h200(), 64));
    assert!(cache.related_winners(&key).is_empty());
    let mut at_8k = entry(&f, 0, &h200(), 128);
    at_8k.key = TuneKey::new(&h200(), &f, 0, ShapeBucket::of(8, 32, 8, 8192));
    cache.insert(at_8k.clone());
    let edited = spec(4, 64);
    let mut stale = entry(&edited, 0, &h200(), 256);
    stale.key.shape = ShapeBucket::of(8, 32, 8, 131072);
    cache.insert(stale.clone());
    assert_eq!(
        cache.related_winners(&key),
        vec![at_8k.winner, stale.winner]
    );
    // Another tier, GPU or query group seeds nothing.
    for unrelated in [
        TuneKey::new(&h200(), &f, 1, shape()),
        TuneKey::new(&other_driver(), &f, 0, shape()),
        TuneKey::new(&h200(), &f, 0, ShapeBucket::of(8, 32, 32, 32768)),
    ] {
        assert!(
            cache.related_winners(&unrelated).is_empty(),
            "{unrelated:?}"
        );
    }
}

#[test]
fn a_spec_change_invalidates_the_entry() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tune.json");
    let mut cache = TuneCache::open(&path);
    cache.insert(entry(&spec(8, 64), 0, &h200(), 64));
    cache.save().unwrap();
    let cache = TuneCache::open(&path);

    // 4-bit keys: another layout, other generated code, same name and shape.
    let edited = spec(4, 64);
    let key = TuneKey::new(&h200(), &edited, 0, shape());
    assert!(matches!(cache.find(&key), Found::Stale(_)));
    let resolution = resolve(&[&cache], &h200(), machine(), &edited, shape());
    assert_eq!(
        resolution.configs[0],
        model::config_at(&edited, 0, shape(), machine())
    );
    match &resolution.sources[0] {
        Source::Default { reason } => assert!(reason.contains("codegen changed"), "{reason}"),
        other => panic!("stale entry used: {other:?}"),
    }
    // Tier 1 was never tuned.
    assert!(
        matches!(&resolution.sources[1], Source::Default { reason } if reason.contains("not tuned"))
    );

    // Re-tuning replaces the stale entry instead of keeping both.
    let mut cache = TuneCache::open(&path);
    cache.insert(entry(&edited, 0, &h200(), 64));
    assert_eq!(cache.entries().len(), 1);
    assert!(matches!(cache.find(&key), Found::Hit(_)));
}

#[test]
fn the_runtime_uses_the_winner_for_its_page_size_and_never_another() {
    let f = spec(8, 64);
    let dir = tempfile::tempdir().unwrap();
    let mut cache = TuneCache::open(&dir.path().join("tune.json"));

    // Winner at the pages' size: used.
    cache.insert(entry(&f, 0, &h200(), 64));
    let r = resolve(&[&cache], &h200(), machine(), &f, shape());
    assert_eq!(r.configs[0].schedule.warps, 2);
    assert!(matches!(r.sources[0], Source::Tuned { ms, .. } if ms == 0.30));
    assert!(r.notes.is_empty());

    // Winner at 128-item pages, pages of 64: the best 64-item candidate, and a note.
    cache.insert(entry(&f, 0, &h200(), 128));
    let r = resolve(&[&cache], &h200(), machine(), &f, shape());
    assert_eq!(r.configs[0].page_items, 64);
    assert_eq!(r.configs[0].schedule.warps, 8);
    assert!(matches!(r.sources[0], Source::Tuned { ms, .. } if ms == 0.35));
    assert_eq!(r.notes[0].0, 0, "the note names its tier");
    assert!(
        r.notes[0].1.contains("re-encode with page.items = 128"),
        "{}",
        r.notes[0].1
    );

    // Re-encoded at 128 items: the same entry (the key does not depend on the
    // spec's page size) gives the winner.
    let f128 = spec(8, 128);
    let r = resolve(&[&cache], &h200(), machine(), &f128, shape());
    assert_eq!(r.configs[0].page_items, 128);
    assert_eq!(r.configs[0].schedule.warps, 2);

    // Pages of 32 items: no candidate at that size, defaults.
    let f32_pages = spec(8, 32);
    let r = resolve(&[&cache], &h200(), machine(), &f32_pages, shape());
    assert_eq!(
        r.configs[0],
        model::config_at(&f32_pages, 0, shape(), machine())
    );
    assert!(
        matches!(&r.sources[0], Source::Default { reason } if reason.contains("32-item pages"))
    );

    // And a configuration for another page size is refused outright.
    let tuned_128 = r.configs[0];
    let refused = KernelConfig {
        page_items: 128,
        ..tuned_128
    }
    .check_pages(32);
    assert!(refused
        .unwrap_err()
        .to_string()
        .contains("tuned for 128-item pages"));
}

#[test]
fn corrupt_files_are_reported_ignored_and_kept_aside() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tune.json");
    std::fs::write(&path, "{ \"kvcc_tune_cache\": 1, \"entries\": [ {\"key\": ").unwrap();
    let mut cache = TuneCache::open(&path);
    assert!(cache.entries().is_empty());
    assert_eq!(cache.problems().len(), 1);
    assert!(
        cache.problems()[0].contains("unreadable"),
        "{:?}",
        cache.problems()
    );
    // Lookups work (defaults) and saving keeps the corrupt file aside.
    let f = spec(8, 64);
    let r = resolve(&[&cache], &h200(), machine(), &f, shape());
    assert!(matches!(r.sources[0], Source::Default { .. }));
    cache.insert(entry(&f, 0, &h200(), 64));
    cache.save().unwrap();
    let aside = dir.path().join("tune.json.corrupt");
    assert!(std::fs::read_to_string(&aside)
        .unwrap()
        .contains("\"key\": "));
    let reopened = TuneCache::open(&path);
    assert!(reopened.problems().is_empty());
    assert_eq!(reopened.entries().len(), 1);

    // Not JSON at all, and a binary file: same.
    for bytes in [b"not json".to_vec(), vec![0xff, 0x00, 0x13]] {
        std::fs::write(&path, bytes).unwrap();
        let c = TuneCache::open(&path);
        assert!(c.entries().is_empty() && c.problems().len() == 1);
    }
}

#[test]
fn malformed_entries_and_other_versions_are_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tune.json");
    let f = spec(8, 64);
    let good = serde_json::to_value(entry(&f, 0, &h200(), 64)).unwrap();
    let text = serde_json::json!({
        "kvcc_tune_cache": 1,
        "entries": [good, {"key": "nonsense"}],
    });
    std::fs::write(&path, text.to_string()).unwrap();
    let cache = TuneCache::open(&path);
    assert_eq!(cache.entries().len(), 1);
    assert_eq!(cache.problems().len(), 1);
    assert!(
        cache.problems()[0].contains("entry 1 is malformed"),
        "{:?}",
        cache.problems()
    );

    let future = serde_json::json!({ "kvcc_tune_cache": 99, "entries": [] });
    std::fs::write(&path, future.to_string()).unwrap();
    let cache = TuneCache::open(&path);
    assert!(cache.entries().is_empty());
    assert!(
        cache.problems()[0].contains("cache version 99"),
        "{:?}",
        cache.problems()
    );
}

#[test]
fn exported_entries_import_into_another_cache() {
    let dir = tempfile::tempdir().unwrap();
    let f = spec(8, 64);
    let mut a100 = h200();
    a100.name = "NVIDIA A100-SXM4-80GB".into();
    a100.compute_capability = (8, 0);
    let mut source = TuneCache::open(&dir.path().join("a.json"));
    source.insert(entry(&f, 0, &h200(), 64));
    source.insert(entry(&f, 1, &h200(), 64));
    source.insert(entry(&f, 0, &a100, 64));
    let shipped = dir.path().join("shipped.json");
    assert_eq!(
        source
            .export(&shipped, |e| e.key.gpu.name.contains("H200"))
            .unwrap(),
        2
    );

    let target_path = dir.path().join("b.json");
    let mut target = TuneCache::open(&target_path);
    target.insert(entry(&f, 0, &h200(), 128));
    let (merged, problems) = target.import(&shipped).unwrap();
    assert!(problems.is_empty());
    assert_eq!((merged.added, merged.replaced), (1, 1));
    target.save().unwrap();
    let target = TuneCache::open(&target_path);
    assert_eq!(target.entries().len(), 2);
    let r = resolve(&[&target], &h200(), machine(), &f, shape());
    assert!(r.sources.iter().all(|s| matches!(s, Source::Tuned { .. })));
    assert_eq!(
        r.configs[0].schedule.warps, 2,
        "the imported winner replaced the older entry"
    );

    // A file the user names must be readable: importing garbage is an error.
    std::fs::write(dir.path().join("bad.json"), "garbage").unwrap();
    assert!(target_clone(&target_path)
        .import(&dir.path().join("bad.json"))
        .is_err());
    assert!(target_clone(&target_path)
        .import(&dir.path().join("missing.json"))
        .is_err());
}

fn target_clone(path: &Path) -> TuneCache {
    TuneCache::open(path)
}

#[test]
fn saving_merges_with_entries_written_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tune.json");
    let f = spec(8, 64);
    let mut first = TuneCache::open(&path);
    let mut second = TuneCache::open(&path);
    first.insert(entry(&f, 0, &h200(), 64));
    first.save().unwrap();
    second.insert(entry(&f, 1, &h200(), 64));
    second.save().unwrap();
    assert_eq!(TuneCache::open(&path).entries().len(), 2);
}

fn kvcc(args: &[&str], cache: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kvcc"))
        .args(args)
        .env("KVCC_TUNE_CACHE", cache)
        .output()
        .expect("run kvcc")
}

#[test]
fn tune_cache_commands_use_the_environment_path_and_survive_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("env-cache.json");
    let out = kvcc(&["tune-cache", "path"], &path);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        path.display().to_string()
    );

    std::fs::write(&path, "{ truncated").unwrap();
    let out = kvcc(&["tune-cache", "show"], &path);
    assert!(out.status.success(), "a corrupt cache is not fatal");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unreadable"), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("0 entries"));

    // Import a shipped file over the corrupt one: the corrupt file is kept aside.
    let shipped = dir.path().join("shipped.json");
    let mut source = TuneCache::open(&dir.path().join("src.json"));
    source.insert(entry(&spec(8, 64), 0, &h200(), 64));
    source.export(&shipped, |_| true).unwrap();
    let out = kvcc(&["tune-cache", "import", shipped.to_str().unwrap()], &path);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 added"));
    assert!(dir.path().join("env-cache.json.corrupt").exists());
    let out = kvcc(&["tune-cache", "show", "--json"], &path);
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["user"]["entries"].as_array().unwrap().len(), 1);
    // The shipped results are listed beside the user's, each saying whether
    // it is for this build's code.
    let shipped_entries = shown["shipped"]["entries"].as_array().unwrap();
    assert!(!shipped_entries.is_empty());
    assert!(shipped_entries.iter().all(|e| e["fresh"].is_boolean()));
    let exported = dir.path().join("out.json");
    let out = kvcc(
        &[
            "tune-cache",
            "export",
            exported.to_str().unwrap(),
            "--gpu",
            "A100",
        ],
        &path,
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("exported 0 entries"));
}

#[test]
fn tune_without_a_gpu_or_with_a_bad_spec_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("c.json");
    let out = kvcc(&["tune", "--spec", "no_such_spec"], &cache);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("bundled: dense_f16"), "{stderr}");
    assert!(!stderr.contains("panicked"));
    let out = kvcc(&["tune", "--spec", "dense_f16", "--ctx", "8192"], &cache);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(stderr.contains("error:"), "{stderr}");
    }
}

#[test]
fn shipped_results_serve_any_driver_and_the_users_own_entries_win() {
    let f = spec(8, 64);
    let dir = tempfile::tempdir().unwrap();
    // Results measured on another driver, shipped as text.
    let path = dir.path().join("measured.json");
    let mut measured = TuneCache::open(&path);
    measured.insert(entry(&f, 0, &other_driver(), 64));
    measured.save().unwrap();
    let mut shipped = TuneCache::shipped("shipped.json", &std::fs::read_to_string(&path).unwrap());
    assert!(shipped.problems().is_empty(), "{:?}", shipped.problems());
    assert!(shipped.save().is_err(), "shipped results are read-only");

    // The user's cache is empty: the shipped winner, marked as shipped.
    let user = TuneCache::open(&dir.path().join("user.json"));
    let r = resolve(&[&user, &shipped], &h200(), machine(), &f, shape());
    assert_eq!(r.configs[0].schedule.warps, 2);
    assert!(matches!(r.sources[0], Source::Tuned { shipped: true, .. }));
    // A user's cache file ignores entries of another driver.
    assert!(matches!(
        measured.find(&TuneKey::new(&h200(), &f, 0, shape())),
        Found::Miss
    ));

    // The user's own entry comes first.
    let mut user = user;
    let mut own = entry(&f, 0, &h200(), 64);
    own.winner = KernelConfig {
        schedule: Schedule {
            warps: 8,
            ..own.default.schedule
        },
        ..own.default
    };
    user.insert(own);
    let r = resolve(&[&user, &shipped], &h200(), machine(), &f, shape());
    assert_eq!(r.configs[0].schedule.warps, 8);
    assert!(matches!(r.sources[0], Source::Tuned { shipped: false, .. }));

    // A malformed shipped file is a problem, never a failure.
    let broken = TuneCache::shipped("broken.json", "{not json");
    assert!(broken.entries().is_empty() && broken.problems().len() == 1);
}
