//! The tune cache: one JSON file holding, per [`TuneKey`], every candidate's
//! timing and the winner. Reading never fails: a corrupt file or entry, a file
//! from another cache version, or an entry for older generated code is
//! reported and ignored. Writing is atomic (temporary file, then rename) and
//! keeps a corrupt file aside instead of overwriting it.
//!
//! Location: `$KVCC_TUNE_CACHE`, else `$XDG_CACHE_HOME/kvcc/tune-cache.json`,
//! else `$HOME/.cache/kvcc/tune-cache.json`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::search::Strategy;
use super::{KernelConfig, TuneError, TuneKey};

/// Environment variable naming the cache file.
pub const PATH_VARIABLE: &str = "KVCC_TUNE_CACHE";
/// Version of the file's schema; files of another version are ignored.
pub const CACHE_VERSION: u32 = 1;

/// One candidate's measurement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub config: KernelConfig,
    /// Median of the timed steps; `None` when the candidate was skipped.
    pub ms: Option<f64>,
    pub min_ms: Option<f64>,
    pub max_ms: Option<f64>,
    /// Largest relative error against the interpreter (checked before timing).
    pub max_rel_error: Option<f64>,
    /// Why the candidate did not count (failed to generate, assemble, launch,
    /// or differed from the interpreter).
    pub skipped: Option<String>,
}

/// The default and the winner timed alternately after the search, so the
/// reported speedup is not one lucky sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Confirmation {
    pub default_ms: f64,
    pub winner_ms: f64,
    pub rounds: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub key: TuneKey,
    pub default: KernelConfig,
    /// What the runtime launches for pages of `winner.page_items` items.
    pub winner: KernelConfig,
    pub confirmation: Option<Confirmation>,
    pub candidates: Vec<Candidate>,
    /// Flattened: the file keeps one object per entry.
    #[serde(flatten)]
    pub sweep: SweepRecord,
}

/// How and when the sweep behind an entry ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepRecord {
    /// The strategy that ran (`Auto` resolved).
    pub search: Strategy,
    pub space_size: usize,
    pub seconds: f64,
    /// Unix time of the sweep.
    pub created: u64,
    pub kvcc_version: String,
}

impl SweepRecord {
    /// A sweep finishing now, by this build of kvcc.
    pub fn now(search: Strategy, space_size: usize, seconds: f64) -> SweepRecord {
        SweepRecord {
            search,
            space_size,
            seconds,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            kvcc_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

impl Entry {
    /// The configuration to launch for pages of `page_items` items: the winner
    /// at its page size, else the fastest candidate measured at that size.
    pub fn best_at(&self, page_items: u32) -> Option<(KernelConfig, f64)> {
        if self.winner.page_items == page_items {
            return Some((self.winner, self.winner_ms()?));
        }
        self.candidates
            .iter()
            .filter(|c| c.config.page_items == page_items)
            .filter_map(|c| Some((c.config, c.ms?)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }

    pub fn winner_ms(&self) -> Option<f64> {
        // The default kept after the confirmation was its winner's equal or better.
        if self.winner == self.default {
            return self.default_ms();
        }
        match self.confirmation {
            Some(c) => Some(c.winner_ms),
            None => self.ms_of(&self.winner),
        }
    }

    pub fn default_ms(&self) -> Option<f64> {
        match self.confirmation {
            Some(c) => Some(c.default_ms),
            None => self.ms_of(&self.default),
        }
    }

    pub fn ms_of(&self, config: &KernelConfig) -> Option<f64> {
        self.candidates
            .iter()
            .find(|c| &c.config == config)
            .and_then(|c| c.ms)
    }

    /// Fastest and slowest candidates that ran.
    pub fn spread(&self) -> Option<(f64, f64)> {
        let times = self.candidates.iter().filter_map(|c| c.ms);
        let (lo, hi) = times.fold((f64::INFINITY, 0.0f64), |(lo, hi), t| {
            (lo.min(t), hi.max(t))
        });
        (lo.is_finite()).then_some((lo, hi))
    }
}

#[derive(Debug, Serialize)]
struct FileOut<'a> {
    kvcc_tune_cache: u32,
    entries: &'a [Entry],
}

/// What a key finds in the cache.
#[derive(Debug)]
pub enum Found<'a> {
    Hit(&'a Entry),
    /// An entry for the same GPU, tier and shape but other generated code.
    Stale(&'a Entry),
    Miss,
}

#[derive(Debug, Default)]
pub struct TuneCache {
    path: PathBuf,
    entries: Vec<Entry>,
    /// What was wrong with the file, one line each (reported, never fatal).
    problems: Vec<String>,
    /// The file on disk could not be parsed: saving moves it aside first.
    corrupt: bool,
    /// The results shipped with kvcc: matched on the GPU's name and compute
    /// capability whatever its driver, and never written.
    shipped: bool,
}

/// Entries whose key matches `key` (replaced) or not (added).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Merged {
    pub added: usize,
    pub replaced: usize,
}

impl TuneCache {
    /// The documented location (see the module docs).
    pub fn default_path() -> PathBuf {
        if let Some(p) = std::env::var_os(PATH_VARIABLE).filter(|p| !p.is_empty()) {
            return PathBuf::from(p);
        }
        let base = std::env::var_os("XDG_CACHE_HOME")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from("."));
        base.join("kvcc").join("tune-cache.json")
    }

    /// The cache at the default location.
    pub fn open_default() -> TuneCache {
        TuneCache::open(&TuneCache::default_path())
    }

    /// Reads `path`; a missing file is an empty cache, anything wrong with it
    /// is listed in [`problems`](Self::problems).
    pub fn open(path: &Path) -> TuneCache {
        let mut cache = TuneCache {
            path: path.to_path_buf(),
            ..TuneCache::default()
        };
        match std::fs::read_to_string(path) {
            Ok(text) => match parse(&text) {
                Ok((entries, problems)) => {
                    cache.entries = entries;
                    cache.problems = problems
                        .into_iter()
                        .map(|p| format!("tune cache {}: {p}", path.display()))
                        .collect();
                }
                Err(problem) => {
                    cache.corrupt = true;
                    cache.problems.push(format!(
                        "tune cache {} is unreadable ({problem}); ignoring it (the next save keeps it as {})",
                        path.display(),
                        aside(path).display()
                    ));
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => cache
                .problems
                .push(format!("tune cache {}: {e}; ignoring it", path.display())),
        }
        cache
    }

    /// Entries parsed from `text` (shipped with kvcc, named `label`): problems
    /// are listed as for a file, and [`find`](Self::find) ignores the driver
    /// version.
    pub fn shipped(label: &str, text: &str) -> TuneCache {
        let mut cache = TuneCache {
            path: PathBuf::from(label),
            shipped: true,
            ..TuneCache::default()
        };
        match parse(text) {
            Ok((entries, problems)) => {
                cache.entries = entries;
                cache.problems = problems
                    .into_iter()
                    .map(|p| format!("shipped tune results {label}: {p}"))
                    .collect();
            }
            Err(problem) => cache.problems.push(format!(
                "shipped tune results {label}: {problem}; ignoring them"
            )),
        }
        cache
    }

    pub fn is_shipped(&self) -> bool {
        self.shipped
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }
    pub fn problems(&self) -> &[String] {
        &self.problems
    }

    pub fn find(&self, key: &TuneKey) -> Found<'_> {
        // Shipped results were measured on one driver; kernels time the same
        // on the next, and a user who re-tunes gets their own entry first.
        let matches = |e: &Entry| {
            let mut theirs = e.key.clone();
            if self.shipped {
                theirs.gpu.driver_version = key.gpu.driver_version;
            }
            theirs
        };
        if let Some(e) = self.entries.iter().find(|e| &matches(e) == key) {
            return Found::Hit(e);
        }
        match self
            .entries
            .iter()
            .find(|e| key.same_but_codegen(&matches(e)))
        {
            Some(e) => Found::Stale(e),
            None => Found::Miss,
        }
    }

    /// Winners of the other entries for `key`'s GPU, format, tier and query
    /// group (other context buckets, batches or generated code), each once:
    /// seeds for a search at `key`.
    pub fn related_winners(&self, key: &TuneKey) -> Vec<KernelConfig> {
        let mut winners = Vec::new();
        for e in &self.entries {
            let k = &e.key;
            let related = k != key
                && k.gpu == key.gpu
                && k.format == key.format
                && k.tier == key.tier
                && k.shape.query_group() == key.shape.query_group();
            if related && !winners.contains(&e.winner) {
                winners.push(e.winner);
            }
        }
        winners
    }

    /// Adds `entry`, replacing one with the same key and dropping stale ones
    /// it supersedes.
    pub fn insert(&mut self, entry: Entry) {
        self.merge(vec![entry]);
    }

    fn merge(&mut self, entries: Vec<Entry>) -> Merged {
        let mut merged = Merged::default();
        for entry in entries {
            let before = self.entries.len();
            self.entries
                .retain(|e| e.key != entry.key && !entry.key.same_but_codegen(&e.key));
            if self.entries.len() < before {
                merged.replaced += 1;
            } else {
                merged.added += 1;
            }
            self.entries.push(entry);
        }
        merged
    }

    /// Writes the cache to its path, merged over what is there now (another
    /// process may have tuned other tiers meanwhile; this cache's entries win).
    pub fn save(&mut self) -> Result<(), TuneError> {
        if self.shipped {
            return Err(TuneError::Io {
                path: self.path.display().to_string(),
                message: "the shipped tune results are read-only".into(),
            });
        }
        let on_disk = TuneCache::open(&self.path);
        if on_disk.corrupt || self.corrupt {
            if self.path.exists() {
                std::fs::rename(&self.path, aside(&self.path)).map_err(|e| io(&self.path, e))?;
            }
            self.corrupt = false;
        } else {
            let ours = std::mem::replace(&mut self.entries, on_disk.entries);
            self.merge(ours);
        }
        write_atomic(&self.path, &self.entries)
    }

    /// Writes the entries `keep` selects to `path` (for shipping with an
    /// application); returns how many.
    pub fn export(&self, path: &Path, keep: impl Fn(&Entry) -> bool) -> Result<usize, TuneError> {
        let entries: Vec<Entry> = self.entries.iter().filter(|e| keep(e)).cloned().collect();
        write_atomic(path, &entries)?;
        Ok(entries.len())
    }

    /// Merges an exported file into this cache (not saved yet). Unlike the
    /// cache itself, a file the user names must be readable.
    pub fn import(&mut self, path: &Path) -> Result<(Merged, Vec<String>), TuneError> {
        let text = std::fs::read_to_string(path).map_err(|e| io(path, e))?;
        let (entries, problems) = parse(&text).map_err(|message| TuneError::Io {
            path: path.display().to_string(),
            message,
        })?;
        Ok((self.merge(entries), problems))
    }
}

/// Entries of a cache file, and problems with single entries (skipped).
fn parse(text: &str) -> Result<(Vec<Entry>, Vec<String>), String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let version = value
        .get("kvcc_tune_cache")
        .and_then(serde_json::Value::as_u64)
        .ok_or("not a kvcc tune cache (no `kvcc_tune_cache` version field)")?;
    if version != u64::from(CACHE_VERSION) {
        return Err(format!(
            "cache version {version}, this kvcc reads version {CACHE_VERSION}"
        ));
    }
    let list = value
        .get("entries")
        .and_then(serde_json::Value::as_array)
        .ok_or("no `entries` list")?;
    let mut entries = Vec::new();
    let mut problems = Vec::new();
    for (i, item) in list.iter().enumerate() {
        match Entry::deserialize(item) {
            Ok(e) => entries.push(e),
            Err(e) => problems.push(format!("entry {i} is malformed ({e}); skipped")),
        }
    }
    Ok((entries, problems))
}

fn write_atomic(path: &Path, entries: &[Entry]) -> Result<(), TuneError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    }
    let text = serde_json::to_string_pretty(&FileOut {
        kvcc_tune_cache: CACHE_VERSION,
        entries,
    })
    .map_err(|e| io(path, std::io::Error::other(e)))?;
    let temporary = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&temporary, text).map_err(|e| io(&temporary, e))?;
    std::fs::rename(&temporary, path).map_err(|e| io(path, e))
}

/// Where an unreadable cache file is kept when a new one is written.
fn aside(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".corrupt");
    PathBuf::from(name)
}

fn io(path: &Path, e: std::io::Error) -> TuneError {
    TuneError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}
