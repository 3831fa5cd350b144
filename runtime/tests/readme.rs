//! The README's commands work when typed in order on a fresh machine.

const README: &str = include_str!("../../README.md");

/// Lines of the README's `sh` code blocks, in order.
fn shell_lines() -> Vec<&'static str> {
    let mut lines = Vec::new();
    let mut in_sh = false;
    for line in README.lines() {
        match line.trim() {
            "```sh" => in_sh = true,
            "```" => in_sh = false,
            command if in_sh => lines.push(command),
            _ => {}
        }
    }
    lines
}

#[test]
fn kvcc_is_installed_before_it_is_used_as_a_command() {
    let lines = shell_lines();
    let first_use = lines
        .iter()
        .position(|l| l.starts_with("kvcc "))
        .expect("the README runs kvcc");
    let install = lines
        .iter()
        .position(|l| l.starts_with("cargo install --path runtime"))
        .unwrap_or_else(|| {
            panic!(
                "no `cargo install --path runtime` before `{}`",
                lines[first_use]
            )
        });
    assert!(
        install < first_use,
        "`{}` comes before the install step `{}`",
        lines[first_use],
        lines[install]
    );
}

#[test]
fn the_installed_binary_is_named_kvcc() {
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_kvcc"));
    assert_eq!(exe.file_stem().and_then(|s| s.to_str()), Some("kvcc"));
}
