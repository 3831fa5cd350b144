//! The tune results that ship with kvcc (`runtime/tune-cache/shipped.json`):
//! `kvcc tune` sweeps of the bundled specs on the GPUs the project benchmarks
//! on, at the shapes `kvcc bench` reports. The runtime uses them where the
//! user's own cache has no entry; a codegen change makes them stale, and they
//! are then ignored like any stale entry.

use std::sync::OnceLock;

use kvcc_compiler::Format;

use super::store::{Entry, TuneCache};
use super::TuneKey;

/// Where the file lives in the repository (how `tune-cache show` names it).
pub const LABEL: &str = "runtime/tune-cache/shipped.json";

/// The shipped results, parsed once per process.
pub fn cache() -> &'static TuneCache {
    static CACHE: OnceLock<TuneCache> = OnceLock::new();
    CACHE.get_or_init(|| TuneCache::shipped(LABEL, include_str!("../../tune-cache/shipped.json")))
}

/// Whether `entry` is for the code this build generates for its bundled
/// tier (`None`: not a bundled format or tier).
pub fn is_fresh(entry: &Entry) -> Option<bool> {
    let file = format!("specs/{}.toml", entry.key.format);
    let (_, source) = crate::builtin::SPECS
        .iter()
        .find(|(path, _)| *path == file)?;
    let format = Format::parse(source, &file).ok()?;
    let tier = format.tier_index(&entry.key.tier)?;
    let key = TuneKey::new(&entry.key.gpu, &format, tier, entry.key.shape);
    Some(key.codegen == entry.key.codegen)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A codegen change to a bundled tier must come with its results tuned
    /// again (`benches/gpu/run.sh shipped-tune`) or with them removed: stale
    /// entries are ignored, so the tier would silently run untuned.
    #[test]
    fn every_shipped_entry_is_for_this_builds_code() {
        let stale: Vec<String> = (cache().entries().iter())
            .filter(|e| is_fresh(e) != Some(true))
            .map(|e| format!("{}/{} ({})", e.key.format, e.key.tier, e.key.shape))
            .collect();
        assert!(
            stale.is_empty(),
            "stale or unknown shipped entries: {stale:?}"
        );
    }

    #[test]
    fn the_shipped_file_parses_without_problems() {
        let cache = cache();
        assert!(cache.problems().is_empty(), "{:?}", cache.problems());
        assert!(!cache.entries().is_empty());
        assert!(cache.is_shipped());
    }
}
