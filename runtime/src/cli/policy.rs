//! The cache policy of `kvcc check`: the spec's `[cache]` policy and, per
//! tier, bytes per token at a context with the exact rows counted — as a
//! report (`--json`) and as the lines under the layout table.

use kvcc_compiler::Format;
use serde::Serialize;

use crate::live::{CachePolicy, Split};
use crate::table::Table;

/// The spec's `[cache]` policy and what it costs at `context` tokens.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    /// First tokens of every sequence kept exact.
    pub sinks: usize,
    /// Most recent tokens kept exact.
    pub window: usize,
    /// How exact rows are stored (`f16` or `bf16`).
    pub exact: &'static str,
    /// The tier whole pages are compressed into.
    pub tier: String,
    /// Whether any token is kept exact (`sinks` or `window` above 0).
    pub keeps_exact: bool,
    /// The tokens of one sequence the bytes below are counted over.
    pub context: usize,
    /// Where those tokens are: `sinks` exact, `pages` whole compressed
    /// pages of `page_items` tokens, then `tail` exact tokens (the window
    /// plus the tokens of a page not yet whole).
    pub split: Split,
    pub page_items: usize,
    /// `split.sinks + split.tail`.
    pub exact_tokens: usize,
    /// Bytes of one exact token per kv head, K and V (`2 * head_dim * 2`).
    pub exact_row_bytes: u32,
    /// Per tier, as if its pages held the compressed tokens.
    pub tiers: Vec<PolicyTier>,
    /// `[cache.select]` in words (what each page keeps, what a step reads),
    /// where the spec selects; its summaries are in `bytes_per_token`.
    pub select: Option<String>,
    /// Under a `[cache.budget]`: bytes per token per kv head with the
    /// policy's exact rows and the budget's pages (the tier rows are each
    /// tier alone).
    pub budget_bytes_per_token: Option<f64>,
}

/// One tier's bytes per token per kv head at the report's context: exact
/// rows, whole pages and the tier's tables, all over the context.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyTier {
    pub tier: String,
    /// Whether this is the policy's tier (new pages go to it).
    pub policy_tier: bool,
    /// With the policy's sinks and window exact.
    pub bytes_per_token: f64,
    /// Dense f16 K+V bytes per token divided by `bytes_per_token`.
    pub compression: f64,
    /// With no exact tokens (every whole page compressed; a partial last
    /// page stays exact).
    pub all_pages_bytes_per_token: f64,
    pub all_pages_compression: f64,
}

/// The policy of `format`'s `[cache]` table at `context` tokens.
pub fn report(format: &Format, context: usize) -> PolicyReport {
    let policy = CachePolicy::of(format);
    let items = format.spec().page.items as usize;
    let split = policy.split(context, items);
    let dense = f64::from(4 * format.head_dim());
    let tiers = (0..format.tiers().len())
        .map(|t| {
            let layout = format.layout(t);
            let alone = CachePolicy {
                tier: t,
                budget: None,
                ..policy
            };
            let with = alone.bytes_per_token(layout, context);
            let without = CachePolicy::compress_all(t).bytes_per_token(layout, context);
            PolicyTier {
                tier: layout.name.clone(),
                policy_tier: t == policy.tier && policy.budget.is_none(),
                bytes_per_token: with,
                compression: dense / with,
                all_pages_bytes_per_token: without,
                all_pages_compression: dense / without,
            }
        })
        .collect();
    PolicyReport {
        sinks: policy.sinks,
        window: policy.window,
        exact: policy.exact.name(),
        tier: format.layout(policy.tier).name.clone(),
        keeps_exact: policy.keeps_exact(),
        context,
        split,
        page_items: items,
        exact_tokens: split.sinks + split.tail,
        exact_row_bytes: 2 * format.head_dim() * policy.exact.bytes(),
        tiers,
        select: policy.select.map(|s| s.describe()),
        budget_bytes_per_token: (policy.budget)
            .map(|_| policy.bytes_per_token(format.layout(0), context)),
    }
}

/// The policy and a table of bytes per token per kv head at the report's
/// context, per tier with and without the policy (pages in that tier).
pub fn render(format: &Format, report: &PolicyReport) -> String {
    let mut table = Table::new(&[
        "tier",
        "exact tokens",
        "B/token (policy)",
        "vs f16",
        "B/token (all pages)",
        "vs f16",
    ]);
    for column in 1..6 {
        table.right_align(column);
    }
    for t in &report.tiers {
        let marker = if t.policy_tier { " *" } else { "" };
        table.row(vec![
            format!("{}{marker}", t.tier),
            report.exact_tokens.to_string(),
            format!("{:.2}", t.bytes_per_token),
            format!("{:.2}x", t.compression),
            format!("{:.2}", t.all_pages_bytes_per_token),
            format!("{:.2}x", t.all_pages_compression),
        ]);
    }
    if let Some(bytes) = report.budget_bytes_per_token {
        let dense = f64::from(4 * format.head_dim());
        table.row(vec![
            "budget".to_string(),
            report.exact_tokens.to_string(),
            format!("{bytes:.2}"),
            format!("{:.2}x", dense / bytes),
            "-".to_string(),
            "-".to_string(),
        ]);
    }
    let select = match &report.select {
        Some(line) => format!("{line}\n"),
        None => String::new(),
    };
    format!(
        "cache policy: {}{}\n{select}\
         at {} tokens: {} sinks + {} pages + {} tail tokens; exact rows {} B/token each \
         (K+V), pages and tables amortized over the context\n{}",
        CachePolicy::of(format).describe(format),
        match report.budget_bytes_per_token {
            Some(_) => " (tier rows: each tier alone; budget: the controller's pages)",
            None => " (* new pages' tier)",
        },
        report.context,
        report.split.sinks,
        report.split.pages,
        report.split.tail,
        report.exact_row_bytes,
        table
    )
}
