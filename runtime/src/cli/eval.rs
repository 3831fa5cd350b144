//! `kvcc eval SPEC --qkv FILE`: fidelity of every tier on K/V/Q dumped from a
//! real model ([layers, heads, tokens, head_dim]; each layer is one sequence).

use std::time::Duration;

use kvcc_compiler::Format;
use serde::Serialize;

use super::fidelity::{self, Block, FidelityError};
use super::live_fidelity::{self, PolicyScore};
use crate::cache;
use crate::encode::TrainOptions;
use crate::exec::ExecutorKind;
use crate::live::{CachePolicy, LiveError};
use crate::metrics::{Fidelity, FidelityAccumulator};
use crate::table::Table;
use crate::tensor_io::Qkv;

#[derive(Debug, Clone, Serialize)]
pub struct EvalRow {
    pub tier: String,
    pub bytes_per_token: f64,
    pub compression: f64,
    pub fidelity: Fidelity,
    /// Time of the executor decoding every query row of every layer.
    pub executor_ms: f64,
    /// The same tier held by a live cache under the cache policy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<PolicyScore>,
}

#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    pub format: String,
    pub executor: String,
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub tokens: usize,
    pub query_rows: usize,
    /// Tokens bytes/token amortizes headers, partial pages and tables over.
    pub context: u32,
    pub rows: Vec<EvalRow>,
}

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("the format's head_dim is {format} but the tensors' is {tensors}")]
    HeadDim { format: u32, tensors: usize },
    #[error(transparent)]
    Encode(#[from] crate::encode::EncodeError),
    #[error(transparent)]
    Fidelity(#[from] FidelityError),
    #[error(transparent)]
    Executor(#[from] crate::exec::ExecError),
    #[error(transparent)]
    Live(#[from] LiveError),
    #[error("{0}")]
    Spec(String),
}

/// Evaluates every tier on `executor`; at most `max_query_rows` query rows per
/// (layer, head), evenly spaced, attend to all of their layer's keys. Bytes
/// per token are amortized over `context` tokens, by default the dump's own.
/// `progress(done, total)` counts steps: per layer, training and each tier.
/// With a `policy`, every tier is also scored held by a live cache under it
/// (each row's `policy`).
pub fn run(
    format: &Format,
    qkv: &Qkv,
    max_query_rows: usize,
    context: Option<u32>,
    executor: ExecutorKind,
    policy: Option<CachePolicy>,
    mut progress: impl FnMut(usize, usize),
) -> Result<EvalReport, EvalError> {
    let kind = executor;
    let mut live = LiveRows::new(format, policy);
    let dump = Dump::of(format, qkv)?;
    let Dump {
        layers,
        kv_heads,
        tokens,
        q_heads,
        q_tokens,
        ..
    } = dump;
    let rows: Vec<usize> = (0..max_query_rows.min(q_tokens))
        .map(|i| i * q_tokens / max_query_rows.min(q_tokens))
        .collect();
    let tiers = format.tiers().len();
    let plans: Vec<(String, Option<usize>)> = (0..tiers)
        .map(|t| (format.layout(t).name.clone(), Some(t)))
        .chain((tiers > 1).then(|| ("mixed".to_string(), None)))
        .collect();
    let mut accumulators: Vec<FidelityAccumulator> = plans
        .iter()
        .map(|_| FidelityAccumulator::default())
        .collect();
    let mut elapsed = vec![Duration::ZERO; plans.len()];
    let executor = executor.executor()?;
    let mut page_bytes = vec![0usize; plans.len()];
    let context = context.unwrap_or_else(|| u32::try_from(tokens).unwrap_or(u32::MAX));
    let steps = plans.len() + 1;
    progress(0, layers * steps);
    for layer in 0..layers {
        let (keys, values) = dump.kv(qkv, layer);
        let queries = dump.queries(qkv, layer, &rows);
        let tables = cache::train(format, keys, values, kv_heads, &TrainOptions::default())?;
        progress(layer * steps + 1, layers * steps);
        let block = Block {
            keys,
            values,
            queries: &queries,
            kv_heads,
            q_heads,
            query_rows: rows.len(),
        };
        for (i, (_, tier)) in plans.iter().enumerate() {
            let tier = *tier;
            let result = fidelity::run(
                format,
                &tables,
                &block,
                move |p| tier.unwrap_or(p % tiers),
                executor.as_ref(),
                false,
                &mut accumulators[i],
            )?;
            elapsed[i] += result.elapsed;
            page_bytes[i] += result.page_bytes;
            progress(layer * steps + 2 + i, layers * steps);
        }
        live.add_layer(format, &tables, &block, kind)?;
    }
    let table_bytes: u32 = (0..tiers).map(|t| format.layout(t).table_bytes()).sum();
    let rows_out = plans
        .iter()
        .enumerate()
        .map(|(i, (name, tier))| {
            let bytes_per_token = match tier {
                Some(t) => format.layout(*t).effective_bytes_per_token(context),
                None => {
                    page_bytes[i] as f64 / (layers * kv_heads * tokens) as f64
                        + f64::from(table_bytes) / f64::from(context)
                }
            };
            EvalRow {
                tier: name.clone(),
                bytes_per_token,
                compression: f64::from(4 * format.head_dim()) / bytes_per_token,
                fidelity: accumulators[i].finish(),
                executor_ms: elapsed[i].as_secs_f64() * 1e3,
                policy: tier.and_then(|t| live.score(format, t, context)),
            }
        })
        .collect();
    Ok(EvalReport {
        format: format.name().to_string(),
        executor: executor.name().to_string(),
        layers,
        q_heads,
        kv_heads,
        tokens,
        query_rows: rows.len(),
        context,
        rows: rows_out,
    })
}

/// A dump's shape, checked against the format: `[layers, kv_heads, tokens,
/// d]` keys and values, `[layers, q_heads, q_tokens, d]` queries.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dump {
    pub layers: usize,
    pub kv_heads: usize,
    pub tokens: usize,
    pub d: usize,
    pub q_heads: usize,
    pub q_tokens: usize,
}

impl Dump {
    pub fn of(format: &Format, qkv: &Qkv) -> Result<Dump, EvalError> {
        let [layers, kv_heads, tokens, d] = qkv.k.shape;
        let [_, q_heads, q_tokens, _] = qkv.q.shape;
        if d != format.head_dim() as usize {
            return Err(EvalError::HeadDim {
                format: format.head_dim(),
                tensors: d,
            });
        }
        Ok(Dump {
            layers,
            kv_heads,
            tokens,
            d,
            q_heads,
            q_tokens,
        })
    }

    /// Layer `layer`'s keys and values, `[kv_head][token][d]` each.
    pub fn kv<'a>(&self, qkv: &'a Qkv, layer: usize) -> (&'a [f32], &'a [f32]) {
        let n = self.kv_heads * self.tokens * self.d;
        let kv = layer * n..(layer + 1) * n;
        (&qkv.k.data[kv.clone()], &qkv.v.data[kv])
    }

    /// Layer `layer`'s query rows `rows` of every head, `[q_head][row][d]`.
    pub fn queries(&self, qkv: &Qkv, layer: usize, rows: &[usize]) -> Vec<f32> {
        let (d, q_tokens) = (self.d, self.q_tokens);
        let q_layer = &qkv.q.data[layer * self.q_heads * q_tokens * d..];
        (0..self.q_heads)
            .flat_map(|h| {
                rows.iter()
                    .flat_map(move |&r| {
                        &q_layer[(h * q_tokens + r) * d..(h * q_tokens + r + 1) * d]
                    })
                    .copied()
            })
            .collect()
    }
}

pub fn render(report: &EvalReport) -> String {
    let executor_ms = format!("{} ms", report.executor);
    let mut headers = vec!["tier", "B/token", "vs f16"];
    headers.extend(Fidelity::HEADERS);
    headers.push("mass recall");
    headers.push(&executor_ms);
    let mut table = Table::new(&headers);
    for column in 1..9 {
        table.right_align(column);
    }
    for r in &report.rows {
        let mut row = vec![
            r.tier.clone(),
            format!("{:.2}", r.bytes_per_token),
            format!("{:.2}x", r.compression),
        ];
        row.extend(r.fidelity.cells(5));
        row.push(format!("{:.3}", r.fidelity.attention_mass_recall));
        row.push(format!("{:.1}", r.executor_ms));
        table.row(row);
        if let Some(policy) = &r.policy {
            let mut row = vec![policy.label()];
            row.extend(policy.cells(5));
            row.push(format!("{:.3}", policy.fidelity.attention_mass_recall));
            row.push(format!("{:.1}", policy.executor_ms));
            table.row(row);
        }
    }
    format!(
        "kvcc eval {}: {} layers, {} query heads over {} kv heads, {} tokens, {} query rows per head\n(B/token per kv head over {} tokens, headers, partial pages and tables included)\n{}",
        report.format,
        report.layers,
        report.q_heads,
        report.kv_heads,
        report.tokens,
        report.query_rows,
        report.context,
        table
    )
}

/// The rows of every tier under a cache policy, scored layer by layer.
struct LiveRows {
    policy: Option<CachePolicy>,
    accumulators: Vec<FidelityAccumulator>,
    elapsed: Vec<Duration>,
}

impl LiveRows {
    fn new(format: &Format, policy: Option<CachePolicy>) -> LiveRows {
        let tiers = if policy.is_some() {
            format.tiers().len()
        } else {
            0
        };
        LiveRows {
            policy,
            accumulators: vec![FidelityAccumulator::default(); tiers],
            elapsed: vec![Duration::ZERO; tiers],
        }
    }

    fn add_layer(
        &mut self,
        format: &Format,
        tables: &cache::Tables,
        block: &Block,
        executor: ExecutorKind,
    ) -> Result<(), EvalError> {
        let Some(policy) = self.policy else {
            return Ok(());
        };
        for (tier, acc) in self.accumulators.iter_mut().enumerate() {
            let policy = CachePolicy { tier, ..policy };
            let observed = Default::default();
            let elapsed =
                live_fidelity::run(format, tables, block, policy, observed, executor, acc)?.elapsed;
            self.elapsed[tier] += elapsed;
        }
        Ok(())
    }

    /// Tier `tier`'s score; bytes per token count the exact rows of a
    /// `context`-token sequence.
    fn score(&self, format: &Format, tier: usize, context: u32) -> Option<PolicyScore> {
        let policy = CachePolicy {
            tier,
            ..self.policy?
        };
        let (acc, elapsed) = (&self.accumulators[tier], self.elapsed[tier]);
        Some(PolicyScore::new(
            format,
            &policy,
            acc,
            elapsed,
            context as usize,
        ))
    }
}
