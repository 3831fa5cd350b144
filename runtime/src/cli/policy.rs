//! The cache policy lines of `kvcc check`: the spec's `[cache]` policy and,
//! per tier, bytes per token at a context with the exact rows counted.

use kvcc_compiler::Format;

use crate::live::CachePolicy;
use crate::table::Table;

/// The policy and a table of bytes per token per kv head at `context` tokens,
/// per tier with and without the policy (pages in that tier).
pub fn render(format: &Format, context: usize) -> String {
    let policy = CachePolicy::of(format);
    let items = format.spec().page.items as usize;
    let split = policy.split(context, items);
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
    let dense = f64::from(4 * format.head_dim());
    for t in 0..format.tiers().len() {
        let layout = format.layout(t);
        let with = CachePolicy { tier: t, ..policy }.bytes_per_token(layout, context);
        let without = CachePolicy::compress_all(t).bytes_per_token(layout, context);
        let marker = if t == policy.tier { " *" } else { "" };
        table.row(vec![
            format!("{}{marker}", layout.name),
            (split.sinks + split.tail).to_string(),
            format!("{with:.2}"),
            format!("{:.2}x", dense / with),
            format!("{without:.2}"),
            format!("{:.2}x", dense / without),
        ]);
    }
    format!(
        "cache policy: {} (* new pages' tier)\n\
         at {context} tokens: {} sinks + {} pages + {} tail tokens; exact rows {} B/token each \
         (K+V), pages and tables amortized over the context\n{}",
        policy.describe(format),
        split.sinks,
        split.pages,
        split.tail,
        2 * format.head_dim() * policy.exact.bytes(),
        table
    )
}
