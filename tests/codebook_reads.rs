//! Key codebooks read directly instead of through per-query lookup tables
//! (`target::shared_memory` chooses, `proc::inline_lut` rewrites): formats whose
//! tables would not fit compile for every target (ptxas-clean, no local
//! memory, where ptxas is found), the bundled tiers keep their tables, the
//! check's suggestions compile, and the inlined score is bitwise the table's
//! in the interpreter and the JIT on fresh random inputs, every logit and
//! output element.

mod common;
#[path = "support/ptxas.rs"]
mod ptxas;

use common::{bundled, cache_and_queries, direct_codebook_formats, fresh_seed};
use kvcc::compiler::back::clif;
use kvcc::compiler::back::interp::{Interpreter, Options as InterpOptions};
use kvcc::compiler::back::ptx::{self, Options};
use kvcc::compiler::layout::FieldLayout;
use kvcc::compiler::proc::inline_lut::inline_lut;
use kvcc::compiler::target::shared_memory::{CodebookReads, TierModel};
use kvcc::compiler::target::Target;
use kvcc::compiler::valid::{validate, ValidModule};
use kvcc::compiler::Format;
use kvcc::runtime::encode::encode_page;

/// Whether a tier's key body is a codebook (its prologue builds a table).
fn key_codebook(module: &ValidModule) -> bool {
    matches!(
        module.module().layout.key.body(),
        FieldLayout::Codebook { .. }
    )
}

fn reads(format: &Format, tier: usize, target: Target) -> CodebookReads {
    let group = format.spec().page.max_query_group;
    TierModel::of_layout(format.layout(tier), group).reads(target)
}

#[test]
fn direct_codebook_formats_compile_for_every_target() {
    let assembler = ptxas::find_or_skip("direct_codebook_formats_compile_for_every_target");
    let mut problems = Vec::new();
    for format in direct_codebook_formats() {
        for target in Target::ALL {
            for tier in 0..format.tiers().len() {
                assert_eq!(reads(&format, tier, target), CodebookReads::Direct);
            }
            // Smaller groups than the spec's may fit the tables again.
            for group in [1, 4, 8] {
                let options = Options {
                    query_group: Some(group),
                    ..Options::for_target(target)
                };
                let output = ptx::write(&format, &options)
                    .unwrap_or_else(|e| panic!("{} ({}): {e}", format.name(), target.name()));
                let Some(assembler) = &assembler else {
                    continue;
                };
                for tier in &output.tiers {
                    let what = format!(
                        "{}/{} ({}, group {group})",
                        format.name(),
                        tier.tier,
                        target.name()
                    );
                    match ptxas::assemble(assembler, &tier.ptx, target) {
                        Ok(resources) => problems.extend(
                            (resources.iter().flat_map(|r| r.problems()))
                                .map(|p| format!("{what}: {p}")),
                        ),
                        Err(messages) => {
                            problems.push(format!("{what}: ptxas failed:\n{messages}"))
                        }
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every bundled tier with codebook keys keeps its lookup table on every
/// target (their generated PTX is unchanged).
#[test]
fn bundled_codebook_keys_keep_their_lookup_tables() {
    let mut seen = 0;
    for format in bundled() {
        for (tier, module) in format.tiers().iter().enumerate() {
            if key_codebook(module) {
                seen += 1;
                for target in Target::ALL {
                    assert_eq!(
                        reads(&format, tier, target),
                        CodebookReads::LookupTable,
                        "{}/{} ({})",
                        format.name(),
                        module.module().tier,
                        target.name()
                    );
                }
            }
        }
    }
    assert!(seen > 0, "no bundled tier has codebook keys");
}

/// What the check suggests for a codebook too large for shared memory
/// (`tests/in/bad-specs/14_…`) compiles for the roomiest target.
#[test]
fn shared_memory_suggestions_compile() {
    let source = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/in/bad-specs/14_codebook_too_large_for_shared_memory.toml"
    ))
    .expect("bad spec 14");
    assert!(Format::parse(&source, "14.toml").is_err());
    let message = Format::parse(&source, "14.toml").unwrap_err().to_string();
    assert!(
        message.contains("at most 8 or use per_group = false"),
        "{message}"
    );
    for fixed in [
        source.replace("bits = 12", "bits = 8"),
        source.replace("per_group = true", "per_group = false"),
    ] {
        let format = Format::parse(&fixed, "fixed.toml").unwrap_or_else(|e| panic!("{e}"));
        ptx::write(&format, &Options::for_target(Target::Sm90))
            .unwrap_or_else(|e| panic!("{e}\n{fixed}"));
    }
}

/// The tiers with every lookup table inlined; each tier with codebook keys
/// must have had one.
fn inlined(format: &Format) -> Vec<ValidModule> {
    format
        .tiers()
        .iter()
        .map(|module| match inline_lut(module) {
            Some(m) => {
                let m = validate(m).unwrap_or_else(|e| panic!("{e}"));
                assert!(inline_lut(&m).is_none(), "a second table");
                assert!(m.module().arrays.iter().all(|(_, a)| a.name != "key.lut"));
                m
            }
            None => {
                assert!(
                    !key_codebook(module),
                    "{}: not inlined",
                    module.module().tier
                );
                module.clone()
            }
        })
        .collect()
}

#[test]
fn inlined_lookup_tables_are_bitwise_exact() {
    let seed = fresh_seed("inlined_lookup_tables_are_bitwise_exact");
    let formats = bundled()
        .into_iter()
        .filter(|f| f.tiers().iter().any(key_codebook))
        .chain(direct_codebook_formats());
    let (kv_heads, group) = (2, 8);
    for format in formats {
        let tables = format.tiers();
        let direct = inlined(&format);
        let tiers = tables.len();
        let (cache, queries) = cache_and_queries(
            &format,
            seed,
            kv_heads,
            kv_heads * group,
            &[1, 150, 333],
            &|s, p| (s + p) % tiers,
            &encode_page,
        );
        let view = cache.view();
        let with_tables = Interpreter::new(tables, InterpOptions::default());
        let inlined = Interpreter::new(&direct, InterpOptions::default());
        let scale = with_tables.softmax_scale();
        let jit = |modules: &[ValidModule]| -> Vec<clif::Kernels> {
            let options = clif::Options {
                heads: 1,
                ..Default::default()
            };
            (modules.iter())
                .map(|m| clif::compile(m, &options).unwrap_or_else(|e| panic!("{e}")))
                .collect()
        };
        let (jit_tables, jit_inlined) = (jit(tables), jit(&direct));
        let d = format.head_dim() as usize;
        for (sequence, rows) in queries.chunks(kv_heads * group * d).enumerate() {
            for (head, query) in rows.chunks(d).enumerate() {
                let what = format!(
                    "{} seed {seed}, sequence {sequence}, head {head}",
                    format.name()
                );
                let kv_head = head / group;
                let want = with_tables
                    .attend(&view, sequence, kv_head, query)
                    .expect("interpreter");
                let got = inlined
                    .attend(&view, sequence, kv_head, query)
                    .expect("interpreter");
                assert_bits(&what, "interpreter logits", &got.logits, &want.logits);
                assert_bits(&what, "interpreter output", &got.output, &want.output);
                // The JIT's scores page by page, before the softmax scale.
                let mut logits = [Vec::new(), Vec::new()];
                for page_ref in &view.page_tables[sequence][kv_head] {
                    let t = page_ref.tier as usize;
                    let bytes = format.layout(t).page_bytes as usize;
                    let start = page_ref.page as usize * bytes;
                    let page = &view.tiers[t].pool[start..start + bytes];
                    let table_values = &view.tiers[t].tables[kv_head];
                    for (out, kernels) in logits.iter_mut().zip([&jit_tables[t], &jit_inlined[t]]) {
                        let shape = kernels.shape();
                        let tables = kernels.tables(table_values);
                        let mut arrays = vec![0.0; shape.arrays_len];
                        arrays[shape.query()].copy_from_slice(query);
                        kernels.prologue(&tables, &mut arrays);
                        let mut scores = vec![f32::NAN; shape.items_stride];
                        let count = kernels.score(page, &tables, &arrays, &mut scores);
                        out.extend(scores[..count].iter().map(|s| s * scale));
                    }
                }
                assert_bits(&what, "JIT logits", &logits[1], &logits[0]);
                assert_bits(&what, "JIT against interpreter", &logits[1], &want.logits);
            }
        }
    }
}

fn assert_bits(what: &str, which: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: {which}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}: {which}[{i}]: {g} against {w}"
        );
    }
}
