//! Checks of the `[cache]` table: the live-cache policy (exact sinks, an exact
//! recent window, the tier new pages are compressed into).

use super::problem::{PathSegment, Problem};
use crate::spec::{BudgetSpec, FormatSpec, SelectMethod, SelectSpec};

/// Most tokens `sinks` or `window` may keep exact: far beyond any published
/// policy (StreamingLLM 4 sinks, ParisKV 256–512 local tokens), small enough
/// that a cache of them stays a bounded fraction of a long context.
pub const MAX_EXACT_TOKENS: u32 = 65536;

/// Most tokens a selection budget may name: 16M, past any context a page
/// table can hold.
pub const MAX_SELECT_TOKENS: u32 = 1 << 24;

/// Most decode steps between a budget's allocations, and most queries per
/// head it observes: bounded so a cache's pending exact rows and observed
/// queries stay a bounded fraction of a long context.
pub const MAX_BUDGET_STEPS: u32 = 65536;

/// Every problem of `spec.cache`, in document order.
pub fn check_cache(spec: &FormatSpec) -> Vec<Problem> {
    let cache = &spec.cache;
    let at = |key: &'static str| vec![PathSegment::Key("cache"), PathSegment::Key(key)];
    let mut problems = Vec::new();
    for (key, value) in [("sinks", cache.sinks), ("window", cache.window)] {
        if value > MAX_EXACT_TOKENS {
            problems.push(Problem {
                path: at(key),
                message: format!(
                    "{key} = {value} keeps more tokens exact than a cache may ({MAX_EXACT_TOKENS}); \
                     valid: 0..={MAX_EXACT_TOKENS}"
                ),
            });
        }
    }
    if let Some(name) = &cache.tier {
        if !spec.tiers.iter().any(|t| &t.name == name) {
            let names: Vec<String> = spec.tiers.iter().map(|t| format!("`{}`", t.name)).collect();
            problems.push(Problem {
                path: at("tier"),
                message: format!(
                    "no tier is named `{name}`; the tiers are {}",
                    names.join(", ")
                ),
            });
        }
    }
    if let Some(select) = &cache.select {
        problems.extend(check_select(select, spec.page.items));
    }
    if let Some(budget) = &cache.budget {
        if cache.tier.is_some() {
            problems.push(Problem {
                path: at("tier"),
                message: "`tier` puts every page in one tier and [cache.budget] chooses a tier \
                          per state; give one of them"
                    .to_string(),
            });
        }
        problems.extend(check_budget(budget));
    }
    problems
}

/// Problems of `[cache.budget]`.
fn check_budget(budget: &BudgetSpec) -> Vec<Problem> {
    let at = |key: &'static str| {
        vec![
            PathSegment::Key("cache"),
            PathSegment::Key("budget"),
            PathSegment::Key(key),
        ]
    };
    let mut problems = Vec::new();
    let b = budget.bytes_per_token;
    if !(b.is_finite() && b > 0.0) {
        problems.push(Problem {
            path: at("bytes_per_token"),
            message: format!(
                "bytes_per_token = {b} is not a budget; give the average page bytes per \
                 compressed state, a number above 0"
            ),
        });
    }
    if !(0.0..=1.0).contains(&budget.protect) {
        problems.push(Problem {
            path: at("protect"),
            message: format!(
                "protect = {} is not a fraction of the states; valid: 0.0..=1.0",
                budget.protect
            ),
        });
    }
    for (key, value) in [("refresh", budget.refresh), ("observe", budget.observe)] {
        if !(1..=MAX_BUDGET_STEPS).contains(&value) {
            problems.push(Problem {
                path: at(key),
                message: format!("{key} = {value} is out of range; valid: 1..={MAX_BUDGET_STEPS}"),
            });
        }
    }
    problems
}

/// Problems of `[cache.select]` for pages of `items` items.
fn check_select(select: &SelectSpec, items: u32) -> Vec<Problem> {
    let at = |key: Option<&'static str>| {
        let mut path = vec![PathSegment::Key("cache"), PathSegment::Key("select")];
        path.extend(key.map(PathSegment::Key));
        path
    };
    let mut problems = Vec::new();
    let mut report = |key, message: String| {
        problems.push(Problem {
            path: at(key),
            message,
        })
    };
    match (select.tokens, select.pages) {
        (None, None) => report(
            None,
            "a selection needs a budget: `tokens = N` (rounded up to whole pages) or `pages = N`"
                .to_string(),
        ),
        (Some(_), Some(_)) => report(
            Some("pages"),
            "give the budget once: `tokens` or `pages`, not both".to_string(),
        ),
        (Some(tokens), None) if !(1..=MAX_SELECT_TOKENS).contains(&tokens) => report(
            Some("tokens"),
            format!("tokens = {tokens} is out of range; valid: 1..={MAX_SELECT_TOKENS}"),
        ),
        (None, Some(pages)) if !(1..=MAX_SELECT_TOKENS / items.max(1)).contains(&pages) => report(
            Some("pages"),
            format!(
                "pages = {pages} is out of range; valid: 1..={} ({MAX_SELECT_TOKENS} tokens of \
                 {items}-item pages)",
                MAX_SELECT_TOKENS / items.max(1)
            ),
        ),
        _ => {}
    }
    match (select.method, select.block) {
        (SelectMethod::Quest, Some(_)) => report(
            Some("block"),
            "`block` is for method = \"block_mean\"; Quest summarizes whole pages".to_string(),
        ),
        (SelectMethod::BlockMean, block) => {
            let block = block.unwrap_or(SelectSpec::DEFAULT_BLOCK);
            if block == 0 || !items.is_multiple_of(block) {
                let divisors: Vec<String> = (1..=items.min(64))
                    .filter(|b| items.is_multiple_of(*b))
                    .map(|b| b.to_string())
                    .collect();
                report(
                    Some("block"),
                    format!(
                        "block = {block} does not divide page.items = {items}; use one of {}",
                        divisors.join(", ")
                    ),
                );
            }
        }
        _ => {}
    }
    problems
}

/// The index of the tier `spec.cache.tier` names (the first tier when unset);
/// `None` for a name that [`check_cache`] rejects.
pub fn cache_tier(spec: &FormatSpec) -> Option<usize> {
    match &spec.cache.tier {
        None => Some(0),
        Some(name) => spec.tiers.iter().position(|t| &t.name == name),
    }
}
