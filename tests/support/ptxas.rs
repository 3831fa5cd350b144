//! Finding and running `ptxas` (from the PyPI package `nvidia-cuda-nvcc`, which
//! runs on machines without a GPU) and reading its resource report.
//!
//! Lookup order: `$KVCC_PTXAS`, `ptxas` on `PATH`, then the package in
//! python3's site-packages (`nvidia/cu13/bin/ptxas`). Without one, tests skip
//! with a message, unless `KVCC_REQUIRE_PTXAS=1`, which makes absence a failure.
// Each test that includes this module uses part of it.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use kvcc::compiler::target::Target;

/// The ptxas to use, or `None` after printing why the caller skips.
pub fn find_or_skip(test: &str) -> Option<PathBuf> {
    let found = locate();
    if found.is_none() {
        let required = std::env::var("KVCC_REQUIRE_PTXAS").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "{test}: KVCC_REQUIRE_PTXAS=1 but no ptxas was found (set KVCC_PTXAS, put ptxas on \
             PATH, or `python3 -m pip install nvidia-cuda-nvcc`)"
        );
        // To the stderr handle: the harness hides `eprintln!` of passing tests.
        let _ = writeln!(
            std::io::stderr(),
            "{test}: SKIPPED: no ptxas (set KVCC_PTXAS, put ptxas on PATH, or \
             `python3 -m pip install nvidia-cuda-nvcc`)"
        );
    }
    found
}

fn locate() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("KVCC_PTXAS") {
        let path = PathBuf::from(path);
        return runs(&path).then_some(path);
    }
    let on_path = PathBuf::from("ptxas");
    if runs(&on_path) {
        return Some(on_path);
    }
    let script = "import nvidia, os\n\
                  for root in nvidia.__path__:\n\
                  \x20   for sub in ('cu13/bin/ptxas', 'cuda_nvcc/bin/ptxas'):\n\
                  \x20       p = os.path.join(root, sub)\n\
                  \x20       if os.path.exists(p): print(p)";
    let out = Command::new("python3").args(["-c", script]).output().ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(PathBuf::from)
        .find(|p| runs(p))
}

fn runs(path: &Path) -> bool {
    Command::new(path)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `release 13.5, V13.5.37` from `ptxas --version`.
pub fn version(ptxas: &Path) -> String {
    let out = Command::new(ptxas)
        .arg("--version")
        .output()
        .expect("ptxas runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| {
            l.split_once("compilation tools, ")
                .map(|(_, v)| v.to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// What `ptxas -v` says about one kernel.
#[derive(Debug, Clone, PartialEq)]
pub struct Resources {
    pub kernel: String,
    pub registers: u32,
    pub stack_frame: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    /// Local memory bytes (`lmem`), 0 when ptxas reports none.
    pub local: u32,
}

impl Resources {
    /// Problems that make a kernel unacceptable: local memory of any kind.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        for (what, n) in [
            ("spill stores", self.spill_stores),
            ("spill loads", self.spill_loads),
            ("stack frame", self.stack_frame),
            ("local memory", self.local),
        ] {
            if n > 0 {
                p.push(format!("{}: {n} bytes of {what}", self.kernel));
            }
        }
        p
    }
}

/// Assembles `ptx` for `target`; `Err` carries ptxas's messages.
pub fn assemble(ptxas: &Path, ptx: &str, target: Target) -> Result<Vec<Resources>, String> {
    let dir = tempfile::tempdir().expect("temp dir");
    let input = dir.path().join("kernel.ptx");
    std::fs::write(&input, ptx).expect("write ptx");
    let out = Command::new(ptxas)
        .arg(format!("-arch={}", target.name()))
        .arg("-v")
        .arg(&input)
        .arg("-o")
        .arg(dir.path().join("kernel.cubin"))
        .output()
        .expect("ptxas runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() || text.contains("error") {
        return Err(text);
    }
    Ok(parse(&text))
}

/// Reads the `Function properties for K` / `Used N registers` blocks.
fn parse(text: &str) -> Vec<Resources> {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find(|part| part.contains(unit))
            .and_then(|part| part.split_whitespace().find_map(|w| w.parse().ok()))
            .unwrap_or(0)
    };
    let mut kernels: Vec<Resources> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            kernels.push(Resources {
                kernel: rest.trim().to_string(),
                registers: 0,
                stack_frame: 0,
                spill_stores: 0,
                spill_loads: 0,
                local: 0,
            });
        } else if let Some(k) = kernels.last_mut() {
            if line.contains("stack frame") {
                k.stack_frame = number_before(line, "stack frame");
                k.spill_stores = number_before(line, "spill stores");
                k.spill_loads = number_before(line, "spill loads");
            } else if line.contains("Used") && line.contains("registers") {
                k.registers = number_before(line, "registers");
                k.local = number_before(line, "lmem");
            }
        }
    }
    kernels
}

/// The `.report` file beside a generated module.
pub fn report(version: &str, target: Target, shared_bytes: u32, resources: &[Resources]) -> String {
    let mut out = format!("ptxas {version} -arch={} -v\n", target.name());
    for r in resources {
        out.push_str(&format!(
            "{}: {} registers, {} bytes dynamic shared memory, {} bytes stack frame, \
             {} bytes spill stores, {} bytes spill loads, {} bytes local memory\n",
            r.kernel,
            r.registers,
            shared_bytes,
            r.stack_frame,
            r.spill_stores,
            r.spill_loads,
            r.local
        ));
    }
    out
}

/// The ptxas version a committed report was made with (its first line).
pub fn report_version(report: &str) -> Option<&str> {
    report
        .lines()
        .next()?
        .strip_prefix("ptxas ")?
        .rsplit_once(" -arch=")
        .map(|(v, _)| v)
}

#[cfg(test)]
mod tests {
    #[test]
    fn parses_ptxas_verbose_output() {
        let text = "ptxas info    : Compiling entry function 'k' for 'sm_80'\n\
                    ptxas info    : Function properties for k\n\
                    \x20   8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
                    ptxas info    : Used 40 registers, 16 bytes lmem, used 1 barriers, 400 bytes cmem[0]\n";
        let r = &super::parse(text)[0];
        assert_eq!(
            (
                r.registers,
                r.stack_frame,
                r.spill_stores,
                r.spill_loads,
                r.local
            ),
            (40, 8, 4, 4, 16)
        );
        assert_eq!(r.problems().len(), 4);
    }
}
