//! A bad spec is a compile error at the `kv_format!` call, with the message
//! `kvcc check` prints (`file:line:column: field.path: message`); the
//! expected compiler output is committed beside each case in `tests/ui/`.
//!
//! The cases name their specs relative to the crate trybuild builds them in
//! (`CARGO_MANIFEST_DIR` is its project folder,
//! `<target>/tests/trybuild/kvcc-dsl-macros/`), so the bad specs are copied
//! there from `tests/in/bad-specs/`: the messages then name
//! `bad-specs/<file>`, the same on every machine.

use std::path::Path;

/// Specs of `tests/in/bad-specs/` the cases use.
const SPECS: [&str; 3] = [
    "01_syntax_error.toml",
    "07_group_size_not_dividing.toml",
    "20_many_problems.toml",
];

#[test]
fn bad_specs_fail_to_compile_with_their_diagnostics() {
    let target = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("CARGO_TARGET_TMPDIR is <target>/tmp");
    let project = target.join("tests/trybuild/kvcc-dsl-macros/bad-specs");
    std::fs::create_dir_all(&project).unwrap();
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/in/bad-specs");
    for spec in SPECS {
        std::fs::copy(source.join(spec), project.join(spec)).unwrap();
    }
    trybuild::TestCases::new().compile_fail("tests/ui/*.rs");
}
