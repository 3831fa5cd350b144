//! `kvcc eval SPEC --qkv FILE --budget a,b,c`: output error against bytes
//! of the `[cache.budget]` controller over every tier of the spec, beside
//! each of its tiers alone and KIVI's int8 and int4 alone, all under the
//! same budget (a single tier meets it by dropping), the same exact sinks
//! and window, and the same observed queries.
//!
//! Each layer of the dump is one sequence. The first `observe` query rows
//! are the queries the controllers weigh states by; the later ones are
//! scored, so no row is scored by a controller that saw it.

use kvcc_compiler::spec::{BudgetSpec, FormatSpec};
use kvcc_compiler::Format;
use serde::Serialize;

use super::eval::{Dump, EvalError};
use super::fidelity::Block;
use super::live_fidelity;
use crate::builtin::SPECS;
use crate::cache::{self, Tables};
use crate::encode::TrainOptions;
use crate::exec::ExecutorKind;
use crate::live::{CachePolicy, Queries};
use crate::metrics::{Fidelity, FidelityAccumulator};
use crate::table::Table;
use crate::tensor_io::Qkv;

/// One cache at one budget.
#[derive(Debug, Clone, Serialize)]
pub struct BudgetRow {
    /// Average page bytes per compressed state the controller was given.
    pub budget: f64,
    /// `controller`, `<tier> only`, `kivi int8 only`…
    pub cache: String,
    /// Page bytes held per compressed state (kept or dropped), headers and
    /// partial pages included.
    pub bytes_per_token: f64,
    /// The share of compressed states dropped.
    pub dropped: f64,
    /// Per tier of the cache: the share of compressed states it holds.
    pub tiers: Vec<(String, f64)>,
    pub fidelity: Fidelity,
}

#[derive(Debug, Clone, Serialize)]
pub struct BudgetReport {
    pub format: String,
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub tokens: usize,
    pub sinks: usize,
    pub window: usize,
    pub observed_rows: usize,
    pub scored_rows: usize,
    pub controller: String,
    pub rows: Vec<BudgetRow>,
}

/// A cache the report measures: a format whose every state the budget
/// allocates, and the tables per layer it reads.
struct Contender {
    name: String,
    /// The format with every tier, or one tier; `bytes_per_token` replaced per budget.
    spec: FormatSpec,
    /// The tiers of the trained tables it reads: the spec's, or KIVI's.
    tiers: Vec<usize>,
    kivi: bool,
}

/// The report for `budgets`: the controller's `[cache.budget]` is the
/// spec's own (`score`, `protect`, `drop`, `observe`) or the defaults.
pub fn run(
    format: &Format,
    qkv: &Qkv,
    budgets: &[f64],
    policy: CachePolicy,
    max_query_rows: usize,
    executor: ExecutorKind,
    mut progress: impl FnMut(usize, usize),
) -> Result<BudgetReport, EvalError> {
    let dump = Dump::of(format, qkv)?;
    let (layers, q_tokens) = (dump.layers, dump.q_tokens);
    let mut budget =
        (format.spec().cache.budget.clone()).unwrap_or_else(|| BudgetSpec::of_bytes(1.0));
    let observe = (budget.observe as usize).min(q_tokens / 2).max(1);
    budget.observe = observe as u32;
    let scored: Vec<usize> = {
        let left = q_tokens - observe;
        let n = max_query_rows.min(left).max(1);
        (0..n).map(|i| observe + i * left / n).collect()
    };
    let kivi = kivi_at(format)?;
    let mut contenders = vec![Contender {
        name: "controller".to_string(),
        spec: format.spec().clone(),
        tiers: (0..format.tiers().len()).collect(),
        kivi: false,
    }];
    let alone = |spec: &FormatSpec, t: usize, kivi: bool, name: String| {
        let mut one = spec.clone();
        one.tiers = vec![spec.tiers[t].clone()];
        Contender {
            name,
            spec: one,
            tiers: vec![t],
            kivi,
        }
    };
    for t in 0..format.tiers().len() {
        let name = format!("{} only", format.layout(t).name);
        contenders.push(alone(format.spec(), t, false, name));
    }
    for t in 0..kivi.tiers().len() {
        let name = format!("kivi {} only", kivi.layout(t).name);
        contenders.push(alone(kivi.spec(), t, true, name));
    }
    let compiled: Vec<Vec<Format>> = budgets
        .iter()
        .map(|&b| {
            contenders
                .iter()
                .map(|c| {
                    let mut spec = c.spec.clone();
                    spec.cache.sinks = policy.sinks as u32;
                    spec.cache.window = policy.window as u32;
                    spec.cache.exact = policy.exact;
                    spec.cache.tier = None;
                    spec.cache.select = None;
                    spec.cache.budget = Some(BudgetSpec {
                        bytes_per_token: b,
                        ..budget.clone()
                    });
                    Format::compile(spec)
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<_, _>>()
        .map_err(|e| EvalError::Spec(e.to_string()))?;
    let cells = budgets.len() * contenders.len();
    let mut accumulators = vec![FidelityAccumulator::default(); cells];
    let mut held = vec![live_fidelity::Held::default(); cells];
    let steps = layers * (cells + 1);
    progress(0, steps);
    for layer in 0..layers {
        let (keys, values) = dump.kv(qkv, layer);
        let queries = dump.queries(qkv, layer, &scored);
        let observed = dump.queries(qkv, layer, &(0..observe).collect::<Vec<_>>());
        let train = TrainOptions::default();
        let own = cache::train(format, keys, values, dump.kv_heads, &train)?;
        let kivi_tables = cache::train(&kivi, keys, values, dump.kv_heads, &train)?;
        progress(layer * (cells + 1) + 1, steps);
        let block = Block {
            keys,
            values,
            queries: &queries,
            kv_heads: dump.kv_heads,
            q_heads: dump.q_heads,
            query_rows: scored.len(),
        };
        let observed = Queries {
            data: &observed,
            q_heads: dump.q_heads,
        };
        for (b, formats) in compiled.iter().enumerate() {
            for (c, (contender, fmt)) in contenders.iter().zip(formats).enumerate() {
                let source = if contender.kivi { &kivi_tables } else { &own };
                let tables: Tables = contender.tiers.iter().map(|&t| source[t].clone()).collect();
                let i = b * contenders.len() + c;
                let policy = CachePolicy::of(fmt);
                let run = live_fidelity::run(
                    fmt,
                    &tables,
                    &block,
                    policy,
                    observed,
                    executor,
                    &mut accumulators[i],
                )?;
                held[i].add(&run);
                progress(layer * (cells + 1) + 2 + i, steps);
            }
        }
    }
    let mut rows = Vec::with_capacity(cells);
    for (b, formats) in compiled.iter().enumerate() {
        for (c, (contender, fmt)) in contenders.iter().zip(formats).enumerate() {
            let i = b * contenders.len() + c;
            let h = &held[i];
            let states = h.allocated.max(1) as f64;
            rows.push(BudgetRow {
                budget: budgets[b],
                cache: contender.name.clone(),
                bytes_per_token: h.page_bytes as f64 / states,
                dropped: 1.0 - h.kept.iter().sum::<usize>() as f64 / states,
                tiers: (h.kept.iter().enumerate())
                    .map(|(t, &k)| (fmt.layout(t).name.clone(), k as f64 / states))
                    .collect(),
                fidelity: accumulators[i].finish(),
            });
        }
    }
    Ok(BudgetReport {
        format: format.name().to_string(),
        layers,
        q_heads: dump.q_heads,
        kv_heads: dump.kv_heads,
        tokens: dump.tokens,
        sinks: policy.sinks,
        window: policy.window,
        observed_rows: observe,
        scored_rows: scored.len(),
        controller: crate::live::budget::BudgetPolicy::of(&budget).rule(),
        rows,
    })
}

/// The bundled KIVI spec at `format`'s head_dim and page items.
fn kivi_at(format: &Format) -> Result<Format, EvalError> {
    let (file, source) = SPECS
        .iter()
        .find(|(path, _)| path.ends_with("/kivi.toml"))
        .expect("KIVI is bundled");
    let parsed = Format::parse(source, file).map_err(|e| EvalError::Spec(e.to_string()))?;
    let mut spec = parsed.spec().clone();
    spec.head_dim = format.head_dim();
    spec.page.items = format.spec().page.items;
    Format::compile(spec).map_err(|e| EvalError::Spec(e.to_string()))
}

pub fn render(report: &BudgetReport) -> String {
    let mut headers = vec!["budget", "cache", "B/token", "dropped", "tiers"];
    headers.extend(Fidelity::HEADERS);
    headers.push("mass recall");
    let mut table = Table::new(&headers);
    for column in [0, 2, 3, 5, 6, 7, 8, 9] {
        table.right_align(column);
    }
    for r in &report.rows {
        let tiers: Vec<String> = (r.tiers.iter())
            .filter(|(_, share)| *share > 0.0)
            .map(|(name, share)| format!("{name} {:.0}%", share * 100.0))
            .collect();
        let mut row = vec![
            format!("{:.1}", r.budget),
            r.cache.clone(),
            format!("{:.1}", r.bytes_per_token),
            format!("{:.1}%", r.dropped * 100.0),
            tiers.join(", "),
        ];
        row.extend(r.fidelity.cells(4));
        row.push(format!("{:.3}", r.fidelity.attention_mass_recall));
        table.row(row);
    }
    format!(
        "kvcc eval {} --budget: {} layers, {} query heads over {} kv heads, {} tokens; sinks {} + \
         window {} exact; the first {} query rows weigh the states, {} later rows are scored\n\
         controller {}\n(B/token: page bytes per compressed state, kept or dropped)\n{}",
        report.format,
        report.layers,
        report.q_heads,
        report.kv_heads,
        report.tokens,
        report.sinks,
        report.window,
        report.observed_rows,
        report.scored_rows,
        report.controller,
        table
    )
}
