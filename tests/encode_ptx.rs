//! The page-compress (encode) kernels of every bundled tier assemble with
//! ptxas for sm_80 and sm_90 with no local memory, those of random specs
//! assemble (their register spills are reported, not failed: a kernel that
//! runs once per page may spill; see `Spills`), and
//! their launch contract is consistent with the decode kernels' (the same
//! table buffer). Random specs take a fresh seed per run (printed;
//! `KVCC_TEST_SEED` replays). Without ptxas the assembling tests skip
//! (see `tests/support/ptxas.rs`), unless `KVCC_REQUIRE_PTXAS=1`.

mod common;
#[path = "support/encode_check.rs"]
mod encode_check;
#[path = "support/ptxas.rs"]
mod ptxas;

use std::sync::Mutex;

use kvcc::compiler::back::ptx;
use kvcc::compiler::back::ptx::abi::{DenseSource, TableBuffer};
use kvcc::compiler::back::ptx::encode::{write_encoder_within, write_encoders, EncodeOutput};
use kvcc::compiler::target::Target;
use kvcc::compiler::Format;

/// Random specs per run.
const RANDOM_SPECS: usize = 8;

/// The dense f16 tier the encoders read rows from, for a format's geometry.
pub fn dense_source(format: &Format, dtype: &str) -> DenseSource {
    let text = format!(
        "name = \"source\"\nhead_dim = {}\n\n[page]\nitems = {}\n\n[[tier]]\nname = \"exact\"\n\
         key.field = [{{ kind = \"dense\", dtype = \"{dtype}\" }}]\n\
         value.field = [{{ kind = \"dense\", dtype = \"{dtype}\" }}]\n",
        format.head_dim(),
        format.spec().page.items
    );
    let source = Format::parse(&text, "source.toml").expect("a dense spec");
    DenseSource::of_layout(source.layout(0)).expect("a dense tier is a source")
}

/// Whether register spills fail the check or are only reported.
#[derive(Clone, Copy, PartialEq)]
enum Spills {
    Fail,
    Report,
}

fn assemble(
    assembler: &std::path::Path,
    jobs: Vec<(String, EncodeOutput, Target)>,
    spills: Spills,
) {
    let queue = Mutex::new(jobs);
    let problems = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| loop {
                let Some((what, output, target)) = queue.lock().unwrap().pop() else {
                    break;
                };
                let found = match ptxas::assemble(assembler, &output.ptx, target) {
                    Err(messages) => vec![format!("{what}: ptxas failed:\n{messages}")],
                    Ok(resources) => {
                        let mut found: Vec<String> = resources
                            .iter()
                            .flat_map(|r| r.problems())
                            .map(|p| format!("{what}: {p}"))
                            .collect();
                        if resources.len() != 1 {
                            found.push(format!("{what}: expected one kernel"));
                        }
                        found
                    }
                };
                problems.lock().unwrap().extend(found);
            });
        }
    });
    let mut problems = problems.into_inner().unwrap();
    if spills == Spills::Report {
        let (spilled, others): (Vec<String>, Vec<String>) = problems
            .into_iter()
            .partition(|p| p.contains("spill") || p.contains("stack frame"));
        for p in &spilled {
            eprintln!("note: {p}");
        }
        problems = others;
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

fn encoders(
    what: &str,
    format: &Format,
    dtype: &str,
    target: Target,
) -> Vec<(String, EncodeOutput, Target)> {
    let source = dense_source(format, dtype);
    write_encoders(format, &source, target)
        .unwrap_or_else(|e| panic!("{what}: {e}"))
        .into_iter()
        .map(|o| (format!("{what}/{} ({})", o.tier, target.name()), o, target))
        .collect()
}

#[test]
fn bundled_encoders_assemble_without_local_memory() {
    let Some(assembler) = ptxas::find_or_skip("bundled_encoders_assemble") else {
        return;
    };
    let mut jobs = Vec::new();
    for format in common::bundled() {
        for target in Target::ALL {
            jobs.extend(encoders(format.name(), &format, "f16", target));
        }
    }
    assemble(&assembler, jobs, Spills::Fail);
}

#[test]
fn random_spec_encoders_assemble_without_local_memory() {
    let Some(assembler) = ptxas::find_or_skip("random_spec_encoders_assemble") else {
        return;
    };
    let seed = common::fresh_seed("random_spec_encoders_assemble");
    let mut jobs = Vec::new();
    for (i, source) in common::random_specs(seed, RANDOM_SPECS).iter().enumerate() {
        let format = Format::parse(source, "random.toml")
            .unwrap_or_else(|e| panic!("generated spec rejected: {e}\n{source}"));
        let dtype = ["f16", "bf16"][i % 2];
        let target = Target::ALL[i % 2];
        jobs.extend(encoders(
            &format!("seed {seed} spec {i}"),
            &format,
            dtype,
            target,
        ));
    }
    assemble(&assembler, jobs, Spills::Report);
}

/// The encoders' table buffer is the decode kernels' (one upload serves
/// both), and the kernel reports what it was built for.
#[test]
fn encoders_share_the_decode_table_buffer() {
    for format in common::bundled() {
        let decode = ptx::write(&format, &ptx::Options::default()).expect("decode kernels");
        let source = dense_source(&format, "f16");
        let encode = write_encoders(&format, &source, Target::Sm90).expect("encoders");
        for (t, (d, e)) in decode.tiers.iter().zip(&encode).enumerate() {
            let layout = format.layout(t);
            assert_eq!(
                e.kernel.tables,
                d.kernel.tables,
                "{}/{}",
                format.name(),
                d.tier
            );
            assert_eq!(e.kernel.tables, TableBuffer::of_layout(layout));
            assert_eq!(e.kernel.page_bytes, layout.page_bytes);
            assert_eq!(e.kernel.tier, t as u32);
            assert_eq!(e.kernel.chunk_items, layout.items_per_page);
            assert!(e.kernel.shared_bytes <= Target::Sm80.max_shared_bytes());
            assert_eq!(e.kernel.launch(5).grid, [5, 1, 1]);
        }
    }
}

/// Pages too large for shared memory at once are encoded in chunks of 16
/// items (transformed twice where the page has header scales); a source of
/// another geometry is refused.
#[test]
fn large_pages_encode_in_chunks() {
    let text = r#"
        name = "large"
        head_dim = 256
        [page]
        items = 1024
        [[tier]]
        name = "t0"
        key.field = [{ kind = "coeff", bits = 8, scale = "page_component" }]
        value.transform = { kind = "hadamard" }
        value.field = [{ kind = "dense", dtype = "f32" }]
    "#;
    let format = Format::parse(text, "large.toml").expect("a valid spec");
    let source = dense_source(&format, "f16");
    let out = write_encoders(&format, &source, Target::Sm80).expect("encoder");
    let chunk = out[0].kernel.chunk_items;
    assert!(chunk < 1024 && chunk.is_multiple_of(16), "chunk {chunk}");
    assert!(out[0].kernel.shared_bytes <= Target::Sm80.max_shared_bytes());
    let other = dense_source(&common::bundled()[0], "f16");
    assert!(write_encoders(&format, &other, Target::Sm80).is_err());
    // The GPU test's chunked spec goes in two chunks under its budget.
    let chunked = Format::parse(encode_check::CHUNKED_SPEC, "chunked.toml").expect("valid");
    let mut jobs = vec![("large/t0 (sm_80)".to_string(), out[0].clone(), Target::Sm80)];
    for t in 0..chunked.tiers().len() {
        let source = dense_source(&chunked, "f16");
        let limit = encode_check::CHUNKED_SHARED_BYTES;
        let o = write_encoder_within("chunked", chunked.layout(t), &source, Target::Sm90, limit)
            .expect("chunked encoder");
        assert_eq!(o.kernel.chunk_items, 32, "tier {t}");
        assert!(o.kernel.shared_bytes <= limit);
        jobs.push((format!("chunked/{} (sm_90)", o.tier), o, Target::Sm90));
    }
    if let Some(assembler) = ptxas::find_or_skip("large_pages_encode_in_chunks") {
        assemble(&assembler, jobs, Spills::Fail);
    }
}

#[test]
fn append_kernels_of_every_bundled_serving_format_assemble_without_local_memory() {
    let Some(assembler) = ptxas::find_or_skip("append kernels") else {
        return;
    };
    use kvcc::compiler::spec::ExactDtype;
    for format in common::bundled() {
        for exact in [ExactDtype::F16, ExactDtype::Bf16] {
            let serving = kvcc::runtime::live::serving_format(&format, exact).unwrap();
            let layout = serving.format.layout(serving.exact_tier);
            for (target, input) in Target::ALL
                .into_iter()
                .flat_map(|t| ptx::abi::RowDtype::ALL.map(|r| (t, r)))
            {
                let what = format!(
                    "{} {} append from {} rows ({})",
                    format.name(),
                    exact.name(),
                    input.name(),
                    target.name()
                );
                let (text, kernel) = ptx::write_append(format.name(), layout, input, target)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let resources = ptxas::assemble(&assembler, &text, target)
                    .unwrap_or_else(|e| panic!("{what}: ptxas failed:\n{e}"));
                assert_eq!(resources.len(), 1, "{what}: one kernel");
                let problems = resources[0].problems();
                assert!(problems.is_empty(), "{what}: {}", problems.join("; "));
                assert!(
                    text.contains(&kernel.name),
                    "{what}: the entry is {}",
                    kernel.name
                );
            }
        }
    }
}
