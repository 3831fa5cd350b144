//! The quickstart runs, and the README shows it as it is.

use std::process::Command;

#[test]
fn runs() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvcc-quickstart"))
        .output()
        .expect("run the quickstart");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "quickstart failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("cpu (jit): relative error"), "{stdout}");
    assert!(stdout.contains("tier high:"), "{stdout}");
}

#[test]
fn the_readme_shows_the_spec_and_the_program_as_they_are() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/../../README.md")).unwrap();
    for file in ["specs/quickstart.toml", "src/main.rs", "build.rs"] {
        let text = std::fs::read_to_string(format!("{root}/{file}")).unwrap();
        assert!(
            readme.contains(&text),
            "README.md does not show examples/quickstart/{file} as it is"
        );
    }
}
