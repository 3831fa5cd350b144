//! `kvcc tune` and `kvcc tune-cache`: tables of a sweep's candidates and
//! winners, and of what the tune cache holds.

use std::path::Path;

use kvcc_compiler::Format;
use serde::Serialize;

use crate::builtin::SPECS;
use crate::sweep::{Origin, Tuned};
use crate::table::Table;
use crate::tune::{shipped, Entry, TuneCache};

/// A spec file, or a bundled spec by name (`dense_f16`, `spherical`, …).
pub fn load_spec(name: &str) -> Result<Format, Box<dyn std::error::Error>> {
    let path = Path::new(name);
    if path.exists() {
        return Ok(Format::load(path)?);
    }
    for (file, source) in SPECS {
        let stem = Path::new(file).file_stem().and_then(|s| s.to_str());
        if stem == Some(name) {
            return Ok(Format::parse(source, file)?);
        }
    }
    let bundled: Vec<_> = SPECS
        .iter()
        .filter_map(|(f, _)| Path::new(f).file_stem()?.to_str())
        .collect();
    Err(format!(
        "no spec file `{name}` and no bundled spec of that name (bundled: {})",
        bundled.join(", ")
    )
    .into())
}

#[derive(Debug, Serialize)]
pub struct TuneReport {
    pub cache: String,
    pub results: Vec<TunedJson>,
}

#[derive(Debug, Serialize)]
pub struct TunedJson {
    pub origin: Origin,
    pub speedup: Option<f64>,
    pub entry: Entry,
}

pub fn report(cache: &TuneCache, results: &[Tuned]) -> TuneReport {
    TuneReport {
        cache: cache.path().display().to_string(),
        results: results
            .iter()
            .map(|t| TunedJson {
                origin: t.origin,
                speedup: speedup(&t.entry),
                entry: t.entry.clone(),
            })
            .collect(),
    }
}

/// Default time over the winner's (confirmed when there was a confirmation).
fn speedup(entry: &Entry) -> Option<f64> {
    Some(entry.default_ms()? / entry.winner_ms()?)
}

fn ms(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.4}"))
}

/// Every candidate of one entry, in the order they were tried.
pub fn render_candidates(entry: &Entry) -> String {
    let mut table = Table::new(&[
        "#",
        "config",
        "ms",
        "min",
        "max",
        "vs default",
        "max err",
        "note",
    ]);
    for c in [0, 2, 3, 4, 5, 6] {
        table.right_align(c);
    }
    let default_ms = entry.ms_of(&entry.default);
    for (i, c) in entry.candidates.iter().enumerate() {
        let mut note = Vec::new();
        if c.config == entry.default {
            note.push("default".to_string());
        }
        if c.config == entry.winner {
            note.push("winner".to_string());
        }
        if let Some(reason) = &c.skipped {
            note.push(format!("skipped: {reason}"));
        }
        table.row(vec![
            (i + 1).to_string(),
            c.config.to_string(),
            ms(c.ms),
            ms(c.min_ms),
            ms(c.max_ms),
            match (default_ms, c.ms) {
                (Some(d), Some(t)) => format!("{:.2}x", d / t),
                _ => "-".into(),
            },
            c.max_rel_error.map_or("-".into(), |e| format!("{e:.1e}")),
            note.join("; "),
        ]);
    }
    format!(
        "{}/{} on {}, {}: {} search, {} of {} points tried in {:.1} s\n{}",
        entry.key.format,
        entry.key.tier,
        entry.key.gpu.name,
        entry.key.shape,
        format!("{:?}", entry.sweep.search).to_lowercase(),
        entry.candidates.len(),
        entry.sweep.space_size,
        entry.sweep.seconds,
        table
    )
}

/// One line per entry: default vs winner, and the spread of the candidates.
pub fn render_summary<'a>(entries: impl IntoIterator<Item = (&'a Entry, String)>) -> String {
    let mut table = Table::new(&[
        "format",
        "tier",
        "context",
        "batch",
        "heads q/kv",
        "tried",
        "seconds",
        "default ms",
        "tuned ms",
        "speedup",
        "best..worst ms",
        "winner",
        "source",
    ]);
    for c in [2, 3, 5, 6, 7, 8, 9, 10] {
        table.right_align(c);
    }
    for (e, origin) in entries {
        let shape = &e.key.shape;
        table.row(vec![
            e.key.format.clone(),
            e.key.tier.clone(),
            format!("{}..{}", shape.context.0, shape.context.1 - 1),
            format!("{}..{}", shape.batch.0, shape.batch.1 - 1),
            format!("{}/{}", shape.q_heads, shape.kv_heads),
            e.candidates.len().to_string(),
            format!("{:.1}", e.sweep.seconds),
            ms(e.default_ms()),
            ms(e.winner_ms()),
            speedup(e).map_or("-".into(), |s| format!("{s:.2}x")),
            e.spread()
                .map_or("-".into(), |(lo, hi)| format!("{lo:.4}..{hi:.4}")),
            e.winner.to_string(),
            origin,
        ]);
    }
    table.to_string()
}

pub fn render(cache: &TuneCache, results: &[Tuned]) -> String {
    let mut out = String::new();
    let swept = |t: &&Tuned| t.origin != Origin::Cached;
    for t in results.iter().filter(swept) {
        out.push_str(&render_candidates(&t.entry));
        out.push_str("\n\n");
    }
    let swept = results.iter().filter(swept).count();
    out.push_str(&format!(
        "tune cache {}: {} swept, {} found in the cache\nspeedup = default / tuned time, both timed alternately after the search\n",
        cache.path().display(),
        swept,
        results.len() - swept
    ));
    out.push_str(&render_summary(results.iter().map(|t| {
        let origin = match t.origin {
            Origin::Cached => "cache hit, no sweep",
            Origin::Swept => "swept",
            Origin::ReplacedStale => "swept, replaced a stale entry",
        };
        (&t.entry, origin.to_string())
    })));
    out
}

/// Where each entry the runtime may use comes from: the user's cache, then
/// the shipped results, with whether a shipped entry is for this build's
/// code (stale ones are ignored).
pub fn show(user: &TuneCache, shipped: &TuneCache) -> String {
    let own = user.entries().iter().map(|e| {
        (
            e,
            format!("{} (codegen {})", user.path().display(), e.key.codegen),
        )
    });
    let theirs = shipped.entries().iter().map(|e| {
        let status = match shipped::is_fresh(e) {
            Some(true) => "shipped",
            Some(false) => "shipped, stale (codegen changed): ignored",
            None => "shipped, not a bundled tier: ignored",
        };
        (e, status.to_string())
    });
    format!(
        "tune cache {}: {} entries; shipped with kvcc ({}): {} entries, the user's first\n{}",
        user.path().display(),
        user.entries().len(),
        shipped.path().display(),
        shipped.entries().len(),
        render_summary(own.chain(theirs))
    )
}
