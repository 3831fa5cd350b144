//! Checks of the `[cache]` table: the live-cache policy (exact sinks, an exact
//! recent window, the tier new pages are compressed into).

use super::problem::{PathSegment, Problem};
use crate::spec::FormatSpec;

/// Most tokens `sinks` or `window` may keep exact: far beyond any published
/// policy (StreamingLLM 4 sinks, ParisKV 256–512 local tokens), small enough
/// that a cache of them stays a bounded fraction of a long context.
pub const MAX_EXACT_TOKENS: u32 = 65536;

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
