//! What the runtime launches: per tier, the tuned configuration for the pages'
//! page size when the cache has one for this GPU, code and shape, else the
//! defaults, with the reason (printed once per process by [`report_once`]).

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use kvcc_compiler::Format;

use super::store::{Found, TuneCache};
use super::{GpuId, KernelConfig, ShapeBucket, TuneKey};

/// Environment variable that turns lookups off (`KVCC_TUNE=off`): defaults,
/// silently, e.g. to time the defaults against tuned kernels.
pub const SWITCH_VARIABLE: &str = "KVCC_TUNE";

/// Where a tier's configuration came from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    Tuned {
        /// The tuned time and the default's, at the tuned shape.
        ms: f64,
        default_ms: Option<f64>,
    },
    Default {
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Resolution {
    /// Per tier.
    pub configs: Vec<KernelConfig>,
    pub sources: Vec<Source>,
    /// Things worth telling the user once (e.g. a faster page size exists).
    pub notes: Vec<String>,
}

/// Configurations for every tier of `format`, whose pages hold
/// `format.spec().page.items` items, at `shape` on `gpu`. Never returns a
/// configuration for another page size.
pub fn resolve(cache: &TuneCache, gpu: &GpuId, format: &Format, shape: ShapeBucket) -> Resolution {
    let pages = format.spec().page.items;
    let default = KernelConfig::default_for(format);
    let mut resolution = Resolution {
        configs: Vec::new(),
        sources: Vec::new(),
        notes: Vec::new(),
    };
    let mut untuned = Vec::new();
    for tier in 0..format.tiers().len() {
        let key = TuneKey::new(gpu, format, tier, shape);
        let what = format!("{}/{} ({shape}) on {}", key.format, key.tier, gpu.name);
        let (config, source) = match cache.find(&key) {
            Found::Hit(entry) => match entry.best_at(pages) {
                Some((config, ms)) => {
                    if entry.winner.page_items != pages {
                        if let Some(best) = entry.winner_ms() {
                            resolution.notes.push(format!(
                                "{what}: {}-item pages tuned {:.2}x faster than the {pages}-item pages in use ({:.4} vs {ms:.4} ms); re-encode with page.items = {} to use them",
                                entry.winner.page_items, ms / best, best, entry.winner.page_items
                            ));
                        }
                    }
                    (
                        config,
                        Source::Tuned {
                            ms,
                            default_ms: entry.default_ms(),
                        },
                    )
                }
                None => (
                    default,
                    Source::Default {
                        reason: format!(
                            "{what}: the tuned entry has no candidate with {pages}-item pages; using defaults"
                        ),
                    },
                ),
            },
            Found::Stale(_) => (
                default,
                Source::Default {
                    reason: format!(
                        "{what}: the tuned entry is for other generated code (codegen changed); using defaults — rerun `kvcc tune`"
                    ),
                },
            ),
            Found::Miss => {
                untuned.push(tier);
                (default, Source::Default { reason: String::new() })
            }
        };
        resolution.configs.push(config);
        resolution.sources.push(source);
    }
    // One message for all untuned tiers of the format at this shape.
    let names: Vec<&str> = untuned
        .iter()
        .map(|&t| format.spec().tiers[t].name.as_str())
        .collect();
    let miss = format!(
        "{} ({shape}) on {}: tier {} not tuned; using defaults — run `kvcc tune --spec {} --batch {} --q-heads {} --kv-heads {} --ctx {}`",
        format.name(),
        gpu.name,
        names.join(", "),
        format.name(),
        shape.batch.0.max(1),
        shape.q_heads,
        shape.kv_heads,
        shape.context.0
    );
    for &t in &untuned {
        resolution.sources[t] = Source::Default {
            reason: miss.clone(),
        };
    }
    resolution
}

/// The defaults for every tier, for `reason`.
pub fn defaults(format: &Format, reason: &str) -> Resolution {
    let tiers = format.tiers().len();
    Resolution {
        configs: vec![KernelConfig::default_for(format); tiers],
        sources: vec![
            Source::Default {
                reason: reason.to_string()
            };
            tiers
        ],
        notes: Vec::new(),
    }
}

/// Prints `message` to stderr unless this process printed it before.
pub fn report_once(message: &str) {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let seen = SEEN.get_or_init(|| Mutex::new(HashSet::new()));
    if seen
        .lock()
        .map(|mut s| s.insert(message.to_string()))
        .unwrap_or(false)
    {
        eprintln!("kvcc: {message}");
    }
}

/// The cache at the default location, read once per process (its problems
/// reported once).
fn default_cache() -> &'static TuneCache {
    static CACHE: OnceLock<TuneCache> = OnceLock::new();
    CACHE.get_or_init(|| {
        let cache = TuneCache::open_default();
        for problem in cache.problems() {
            report_once(problem);
        }
        cache
    })
}

/// The page size the default cache's winner for `tier` at `shape` uses, if
/// there is a (fresh) entry: what to encode pages with to get the tuned speed.
pub fn tuned_page_items(
    gpu: &GpuId,
    format: &Format,
    tier: usize,
    shape: ShapeBucket,
) -> Option<u32> {
    if lookups_disabled() {
        return None;
    }
    match default_cache().find(&TuneKey::new(gpu, format, tier, shape)) {
        Found::Hit(entry) => Some(entry.winner.page_items),
        _ => None,
    }
}

/// Whether `KVCC_TUNE=off` turned lookups off.
pub fn lookups_disabled() -> bool {
    std::env::var(SWITCH_VARIABLE).is_ok_and(|v| v == "off" || v == "0")
}

/// The runtime's lookup: the default cache file (read once per process, its
/// problems reported once), or defaults when lookups are off.
pub fn resolve_default(gpu: &GpuId, format: &Format, shape: ShapeBucket) -> Resolution {
    if lookups_disabled() {
        return defaults(format, &format!("{SWITCH_VARIABLE}=off"));
    }
    let cache = default_cache();
    let resolution = resolve(cache, gpu, format, shape);
    for source in &resolution.sources {
        if let Source::Default { reason } = source {
            report_once(reason);
        }
    }
    for note in &resolution.notes {
        report_once(note);
    }
    resolution
}
