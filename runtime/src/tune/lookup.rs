//! What the runtime launches: per tier, the tuned configuration for the pages'
//! page size when a tune cache has one for this GPU, code and shape — the
//! user's cache first, then the results that ship with kvcc — else the cost
//! model's ([`super::model`]), with the reason (printed once per process by
//! [`report_once`]).

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use kvcc_compiler::Format;

use super::model::{self, Machine};
use super::store::{Found, TuneCache};
use super::{shipped, GpuId, KernelConfig, ShapeBucket, TuneKey};

/// Environment variable that turns lookups off (`KVCC_TUNE=off`): the cost
/// model's defaults, silently, e.g. to time them against tuned kernels.
pub const SWITCH_VARIABLE: &str = "KVCC_TUNE";

/// Where a tier's configuration came from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    Tuned {
        /// The tuned time and the default's, at the tuned shape.
        ms: f64,
        default_ms: Option<f64>,
        /// From the results shipped with kvcc, not the user's cache.
        shipped: bool,
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
    /// Things worth telling the user once (e.g. a faster page size exists),
    /// each with the tier it is about.
    pub notes: Vec<(usize, String)>,
}

/// The first cache of `caches` (in order of precedence) with an entry for
/// `key`, or the first stale entry when none has a fresh one.
fn find<'a>(caches: &[&'a TuneCache], key: &TuneKey) -> (Found<'a>, bool) {
    let mut stale = None;
    for cache in caches {
        match cache.find(key) {
            Found::Hit(entry) => return (Found::Hit(entry), cache.is_shipped()),
            Found::Stale(entry) => {
                stale.get_or_insert(entry);
            }
            Found::Miss => {}
        }
    }
    (stale.map_or(Found::Miss, Found::Stale), false)
}

/// Configurations for every tier of `format`, whose pages hold
/// `format.spec().page.items` items, at `shape` on `gpu`, from the first of
/// `caches` that has it. Never returns a configuration for another page size.
pub fn resolve(
    caches: &[&TuneCache],
    gpu: &GpuId,
    machine: Machine,
    format: &Format,
    shape: ShapeBucket,
) -> Resolution {
    let pages = format.spec().page.items;
    let mut resolution = Resolution {
        configs: Vec::new(),
        sources: Vec::new(),
        notes: Vec::new(),
    };
    let mut untuned = Vec::new();
    for tier in 0..format.tiers().len() {
        let key = TuneKey::new(gpu, format, tier, shape);
        let what = format!("{}/{} ({shape}) on {}", key.format, key.tier, gpu.name);
        let default = model::config_at(format, tier, shape, machine);
        let (found, shipped) = find(caches, &key);
        let (config, source) = match found {
            Found::Hit(entry) => match entry.best_at(pages) {
                Some((config, ms)) => {
                    if entry.winner.page_items != pages {
                        if let Some(best) = entry.winner_ms() {
                            resolution.notes.push((tier, format!(
                                "{what}: {}-item pages tuned {:.2}x faster than the {pages}-item pages in use ({:.4} vs {ms:.4} ms); re-encode with page.items = {} to use them",
                                entry.winner.page_items, ms / best, best, entry.winner.page_items
                            )));
                        }
                    }
                    (
                        config,
                        Source::Tuned {
                            ms,
                            default_ms: entry.default_ms(),
                            shipped,
                        },
                    )
                }
                None => (
                    default,
                    Source::Default {
                        reason: format!(
                            "{what}: the tuned entry has no candidate with {pages}-item pages; using the cost model's defaults"
                        ),
                    },
                ),
            },
            Found::Stale(_) => (
                default,
                Source::Default {
                    reason: format!(
                        "{what}: the tuned entry is for other generated code (codegen changed); using the cost model's defaults — rerun `kvcc tune`"
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
        "{} ({shape}) on {}: tier {} not tuned; using the cost model's defaults — run `kvcc tune --spec {} --batch {} --q-heads {} --kv-heads {} --ctx {}`",
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

/// The cost model's defaults for every tier at the pages' size and `shape`,
/// for `reason`.
pub fn defaults(format: &Format, shape: ShapeBucket, machine: Machine, reason: &str) -> Resolution {
    let tiers = format.tiers().len();
    Resolution {
        configs: (0..tiers)
            .map(|tier| model::config_at(format, tier, shape, machine))
            .collect(),
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

/// The page size to encode `tier`'s pages with when the caller chooses it:
/// the tuned winner's (the user's cache, then the shipped results), else the
/// cost model's ([`model::page_items`]).
pub fn page_items(
    gpu: &GpuId,
    machine: Machine,
    format: &Format,
    tier: usize,
    shape: ShapeBucket,
) -> u32 {
    if !lookups_disabled() {
        let key = TuneKey::new(gpu, format, tier, shape);
        if let (Found::Hit(entry), _) = find(&[default_cache(), shipped::cache()], &key) {
            return entry.winner.page_items;
        }
    }
    model::page_items(format, tier, shape, machine)
}

/// Whether `KVCC_TUNE=off` turned lookups off.
pub fn lookups_disabled() -> bool {
    std::env::var(SWITCH_VARIABLE).is_ok_and(|v| v == "off" || v == "0")
}

/// The runtime's lookup: the default cache file (read once per process, its
/// problems reported once), then the shipped results, or the cost model's
/// defaults when lookups are off.
pub fn resolve_default(
    gpu: &GpuId,
    machine: Machine,
    format: &Format,
    shape: ShapeBucket,
) -> Resolution {
    resolve_reporting(gpu, machine, format, shape, |_| true)
}

/// [`resolve_default`] for a caller that runs only `tier` (`kvcc bench`
/// times one tier of pages encoded for it): what it reports is about that
/// tier alone.
pub fn resolve_default_for_tier(
    gpu: &GpuId,
    machine: Machine,
    format: &Format,
    tier: usize,
    shape: ShapeBucket,
) -> Resolution {
    resolve_reporting(gpu, machine, format, shape, |t| t == tier)
}

fn resolve_reporting(
    gpu: &GpuId,
    machine: Machine,
    format: &Format,
    shape: ShapeBucket,
    reported: impl Fn(usize) -> bool,
) -> Resolution {
    if lookups_disabled() {
        return defaults(format, shape, machine, &format!("{SWITCH_VARIABLE}=off"));
    }
    let caches = [default_cache(), shipped::cache()];
    let resolution = resolve(&caches, gpu, machine, format, shape);
    for (tier, source) in resolution.sources.iter().enumerate() {
        match source {
            Source::Default { reason } if reported(tier) => report_once(reason),
            _ => {}
        }
    }
    for (tier, note) in &resolution.notes {
        if reported(*tier) {
            report_once(note);
        }
    }
    resolution
}
