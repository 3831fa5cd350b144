//! Snapshot test: the IR of every bundled spec and tier is committed under
//! `generated/<format>/<tier>.ir`; a lowering change shows up as a diff there.
//! Run with `KVCC_BLESS=1` to rewrite the files after reviewing the change.

mod common;

use std::path::PathBuf;

use kvcc::compiler::back::text;

#[test]
fn generated_ir_matches_the_committed_snapshots() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("generated");
    let bless = std::env::var_os("KVCC_BLESS").is_some();
    let mut stale = Vec::new();
    for format in common::bundled() {
        for module in format.tiers() {
            let path = root
                .join(format.name())
                .join(text::file_name(module.module()));
            let fresh = text::write(module, &text::Options);
            if bless {
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(&path, &fresh).unwrap();
            } else if std::fs::read_to_string(&path).ok().as_deref() != Some(fresh.as_str()) {
                stale.push(path.display().to_string());
            }
        }
    }
    assert!(
        stale.is_empty(),
        "generated IR differs from the snapshots (review, then rerun with KVCC_BLESS=1):\n{}",
        stale.join("\n")
    );
}
