//! Every spec under `tests/in/bad-specs/` must be rejected; the rendered
//! diagnostics (file:line:column: path: message) are snapshots.

use std::path::PathBuf;

use kvcc_compiler::front::parse_spec;

const BAD_SPECS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/in/bad-specs");

fn bad_specs() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(BAD_SPECS)
        .expect("tests/in/bad-specs exists")
        .map(|entry| entry.expect("readable directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    files.sort();
    files
}

#[test]
fn bad_specs_are_rejected_with_positioned_messages() {
    let files = bad_specs();
    assert!(
        files.len() >= 14,
        "expected at least 14 bad specs, found {}",
        files.len()
    );
    for path in files {
        let name = path.file_stem().unwrap().to_str().unwrap().to_string();
        let source = std::fs::read_to_string(&path).unwrap();
        // A relative file name keeps the snapshots machine-independent.
        let file = format!("tests/in/bad-specs/{name}.toml");
        let error = match parse_spec(&source, &file) {
            Ok(_) => panic!("{file} parsed and checked without errors"),
            Err(error) => error,
        };
        assert!(!error.diagnostics().is_empty(), "{file}: no diagnostics");
        insta::assert_snapshot!(name, error.to_string());
    }
}
