//! `kvcc demo`: every bundled spec on structured synthetic K/V — bytes, ratio
//! and attention error against dense fp32 attention, per tier.

use std::path::Path;

use kvcc_compiler::{CompileError, Format};
use serde::Serialize;

use super::fidelity::{self, Block};
use super::live_fidelity::{self, PolicyScore};
use crate::builtin::SPECS;
use crate::cache;
use crate::encode::TrainOptions;
use crate::exec::ExecutorKind;
use crate::live::{CachePolicy, LiveError};
use crate::metrics::{Fidelity, FidelityAccumulator};
use crate::synth::{synthesize, SynthOptions};
use crate::table::Table;

#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub seed: u64,
    pub tokens: usize,
    pub kv_heads: usize,
    pub q_heads: usize,
    /// Tokens the bytes/token column amortizes headers, partial pages and
    /// tables over; `None` is the data's own `tokens`.
    pub context: Option<u32>,
    /// Decodes the queries the fidelity columns score (the interpreter is
    /// timed as well).
    pub executor: ExecutorKind,
    /// Replace the spec's `[cache]` sinks and window (`--sinks`, `--window`).
    pub sinks: Option<usize>,
    pub window: Option<usize>,
}

impl DemoOptions {
    /// The token count bytes/token is amortized over.
    pub fn context(&self) -> u32 {
        self.context
            .unwrap_or_else(|| u32::try_from(self.tokens).unwrap_or(u32::MAX))
    }
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            seed: 7,
            tokens: 1000,
            kv_heads: 2,
            q_heads: 8,
            context: None,
            executor: ExecutorKind::default(),
            sinks: None,
            window: None,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct DemoRow {
    pub format: String,
    /// A tier name, or "mixed" for pages cycling through every tier.
    pub tier: String,
    pub bytes_per_token: f64,
    pub compression: f64,
    pub fidelity: Fidelity,
    pub interpreter_ms: f64,
    /// The executor the fidelity numbers come from, and its time.
    pub executor: String,
    pub executor_ms: f64,
    /// The same tier held by a live cache under the spec's `[cache]` policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyScore>,
}

/// Loads the specs to run: the bundled ones, or every `*.toml` in `dir`.
pub fn formats(dir: Option<&Path>) -> Result<Vec<Format>, CompileError> {
    match dir {
        None => SPECS
            .iter()
            .map(|(file, source)| Format::parse(source, file))
            .collect(),
        Some(dir) => {
            let mut paths: Vec<_> = std::fs::read_dir(dir)
                .map_err(|source| kvcc_compiler::front::SpecError::Io {
                    file: dir.display().to_string(),
                    source,
                })?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "toml"))
                .collect();
            paths.sort();
            paths.iter().map(|p| Format::load(p)).collect()
        }
    }
}

pub fn run(
    formats: &[Format],
    options: &DemoOptions,
    mut progress: impl FnMut(&str),
) -> Result<Vec<DemoRow>, Box<dyn std::error::Error>> {
    let mut rows = Vec::new();
    let executor = options.executor.executor()?;
    for format in formats {
        progress(format.name());
        let d = format.head_dim() as usize;
        let data = synthesize(&SynthOptions {
            seed: options.seed,
            kv_heads: options.kv_heads,
            q_heads: options.q_heads,
            tokens: options.tokens,
            head_dim: d,
        });
        let tables = cache::train(
            format,
            &data.keys,
            &data.values,
            options.kv_heads,
            &TrainOptions::default(),
        )?;
        let block = Block {
            keys: &data.keys,
            values: &data.values,
            queries: &data.queries,
            kv_heads: options.kv_heads,
            q_heads: options.q_heads,
            query_rows: 1,
        };
        let tiers = format.tiers().len();
        // One row per tier, plus a cache whose pages cycle through every tier.
        let plans: Vec<(String, Option<usize>)> = (0..tiers)
            .map(|t| (format.layout(t).name.clone(), Some(t)))
            .chain((tiers > 1).then(|| ("mixed".to_string(), None)))
            .collect();
        for (name, tier) in plans {
            let mut acc = FidelityAccumulator::default();
            let result = fidelity::run(
                format,
                &tables,
                &block,
                |p| tier.unwrap_or(p % tiers),
                executor.as_ref(),
                true,
                &mut acc,
            )?;
            let bytes_per_token = match format.tier_index(&name) {
                Some(t) => format
                    .layout(t)
                    .effective_bytes_per_token(options.context()),
                // Mixed: what these pages actually take, tables of every tier amortized.
                None => {
                    let tables: u32 = (0..tiers).map(|t| format.layout(t).table_bytes()).sum();
                    (result.page_bytes as f64 / options.kv_heads as f64 / options.tokens as f64)
                        + f64::from(tables) / f64::from(options.context())
                }
            };
            rows.push(DemoRow {
                format: format.name().to_string(),
                tier: name,
                bytes_per_token,
                compression: f64::from(4 * format.head_dim()) / bytes_per_token,
                fidelity: acc.finish(),
                interpreter_ms: result.interpreter.unwrap_or(result.elapsed).as_secs_f64() * 1e3,
                executor: executor.name().to_string(),
                executor_ms: result.elapsed.as_secs_f64() * 1e3,
                policy: match tier {
                    Some(t) => policy_score(format, &tables, &block, options, t)?,
                    None => None,
                },
            });
        }
    }
    Ok(rows)
}

/// Tier `tier` held by a live cache under the spec's policy (with the
/// options' overrides); `None` when that policy keeps no token exact.
fn policy_score(
    format: &Format,
    tables: &cache::Tables,
    block: &Block,
    options: &DemoOptions,
    tier: usize,
) -> Result<Option<PolicyScore>, LiveError> {
    let policy = CachePolicy::of(format).with_overrides(options.sinks, options.window);
    if !policy.keeps_exact() {
        return Ok(None);
    }
    let policy = CachePolicy { tier, ..policy };
    let mut acc = FidelityAccumulator::default();
    let observed = Default::default();
    let elapsed = live_fidelity::run(
        format,
        tables,
        block,
        policy,
        observed,
        options.executor,
        &mut acc,
    )?
    .elapsed;
    let context = options.context() as usize;
    Ok(Some(PolicyScore::new(
        format, &policy, &acc, elapsed, context,
    )))
}

/// A tier's score under the cache policy, as a row beneath the tier's.
fn policy_row(policy: &PolicyScore, timed: bool) -> Vec<String> {
    let mut row = vec![String::new(), policy.label()];
    row.extend(policy.cells(4));
    let ms = format!("{:.2}", policy.executor_ms);
    if timed {
        row.extend(["-".to_string(), ms]);
    } else {
        row.push(ms);
    }
    row
}

pub fn render(rows: &[DemoRow], options: &DemoOptions) -> String {
    let executor = options.executor.name();
    // The selected executor's time beside the interpreter's.
    let timed = options.executor != ExecutorKind::Interp;
    let executor_ms = format!("{executor} ms");
    let mut headers = vec!["format", "tier", "B/token", "vs f16"];
    headers.extend(Fidelity::HEADERS);
    headers.push("interp ms");
    if timed {
        headers.push(executor_ms.as_str());
    }
    let mut table = Table::new(&headers);
    for column in 2..headers.len() {
        table.right_align(column);
    }
    for r in rows {
        let mut row = vec![
            r.format.clone(),
            r.tier.clone(),
            format!("{:.2}", r.bytes_per_token),
            format!("{:.2}x", r.compression),
        ];
        row.extend(r.fidelity.cells(4));
        row.push(format!("{:.1}", r.interpreter_ms));
        if timed {
            row.push(format!("{:.2}", r.executor_ms));
        }
        table.row(row);
        if let Some(policy) = &r.policy {
            table.row(policy_row(policy, timed));
        }
    }
    format!(
        "kvcc demo: synthetic K/V (seed {}, {} tokens, {} kv heads, {} query heads), the {executor} executor vs dense fp32 attention\n(B/token per kv head over {} tokens, headers, partial pages and tables included)\n{}",
        options.seed,
        options.tokens,
        options.kv_heads,
        options.q_heads,
        options.context(),
        table
    )
}
