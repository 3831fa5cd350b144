//! Every bundled spec under `specs/` parses and passes the checks.

use std::path::PathBuf;

use kvcc_compiler::front::check::{check_spec, shared_memory_estimate, SHARED_MEMORY_BUDGET};
use kvcc_compiler::front::load_spec;

const SPECS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../specs");

#[test]
fn bundled_specs_parse_and_check() {
    let mut files: Vec<PathBuf> = std::fs::read_dir(SPECS)
        .expect("specs/ exists")
        .map(|entry| entry.expect("readable directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no specs under {SPECS}");
    for path in &files {
        let spec = load_spec(path).unwrap_or_else(|err| panic!("{}:\n{err}", path.display()));
        assert_eq!(check_spec(&spec), vec![], "{}", path.display());
        let stem = path.file_stem().unwrap().to_str().unwrap();
        assert_eq!(
            spec.name,
            stem,
            "{}: name should match the file name",
            path.display()
        );
        for tier in 0..spec.tiers.len() {
            assert!(shared_memory_estimate(&spec, tier) <= SHARED_MEMORY_BUDGET);
        }
    }
}

#[test]
fn missing_file_is_an_io_error() {
    let err = load_spec(std::path::Path::new("does/not/exist.toml")).unwrap_err();
    assert!(err.diagnostics().is_empty());
    assert!(
        err.to_string().starts_with("does/not/exist.toml: "),
        "{err}"
    );
}

#[test]
fn non_utf8_spec_points_at_the_byte() {
    let path = std::env::temp_dir().join(format!("kvcc-non-utf8-{}.toml", std::process::id()));
    std::fs::write(&path, b"name = \"x\"\n# caf\xc3\xa9 \xff\nhead_dim = 64\n").unwrap();
    let err = load_spec(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    let file = path.display().to_string();
    assert_eq!(err.diagnostics().len(), 1, "{err}");
    assert_eq!(
        err.to_string(),
        format!(
            "{file}:2:8: the spec is not UTF-8: byte 0xff at byte offset 19; TOML files are UTF-8"
        )
    );
}

/// The full example of `docs/spec-reference.md` parses, checks, and has the
/// shared-memory estimate the document states.
#[test]
fn reference_example_parses() {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/spec-reference.md"
    ))
    .expect("docs/spec-reference.md exists");
    // The first whole spec among the toml blocks (others show one table).
    let example = (doc.split("```toml\n").skip(1))
        .map(|block| &block[..block.find("```").expect("closed example")])
        .find(|block| block.contains("[[tier]]"))
        .expect("a toml example with tiers");
    let spec = kvcc_compiler::front::parse_spec(example, "docs/spec-reference.md")
        .unwrap_or_else(|err| panic!("{err}"));
    assert_eq!(spec.tiers.len(), 2);
    assert_eq!(shared_memory_estimate(&spec, 0), 69632);
}

/// Re-paging a compiled format gives what compiling it at that page size
/// gives: the same layout, IR and proofs, and the same refusal.
#[test]
fn repaging_matches_compiling_at_that_page_size() {
    use kvcc_compiler::Format;
    for entry in std::fs::read_dir(SPECS).expect("specs/ exists") {
        let path = entry.expect("readable directory entry").path();
        if path.extension().is_none_or(|ext| ext != "toml") {
            continue;
        }
        let format = Format::load(&path).unwrap();
        for items in [0, 1, 7, 16, 64, 100, 256, 4096, 4097] {
            let mut spec = format.spec().clone();
            spec.page.items = items;
            let compiled = Format::compile(spec);
            let repaged = format.with_page_items(items);
            match (compiled, repaged) {
                (Ok(compiled), Ok(repaged)) => {
                    assert_eq!(compiled.spec(), repaged.spec());
                    for (c, r) in compiled.tiers().iter().zip(repaged.tiers()) {
                        assert_eq!(c.module().layout, r.module().layout, "{items}");
                        assert_eq!(format!("{c:?}"), format!("{r:?}"), "{items}");
                    }
                }
                (Err(compiled), Err(repaged)) => {
                    assert_eq!(compiled.to_string(), repaged.to_string())
                }
                (c, r) => panic!("{}: items {items}: {c:?} vs {r:?}", path.display()),
            }
        }
    }
}
