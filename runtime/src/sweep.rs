//! `kvcc tune` on the GPU: per tier and context, search the space around the
//! default configuration, timing each candidate the way `kvcc bench` does, after
//! checking its output against the interpreter (a fast wrong kernel never
//! counts). The tier's winners at other shapes or for older code (the cache's
//! related entries) seed the search. Pages are re-encoded per page size.
//! Results go to the tune cache.

use std::collections::HashMap;
use std::time::Instant;

use kvcc_compiler::back::ptx;
use kvcc_compiler::Format;

use crate::cache::PagedCache;
use crate::cuda::measure::{
    decode_steps, source_cache, time_steps, upload_copies, DecodeShape, Reference, StepPlan,
    StepTiming, Timing, TOLERANCE,
};
use crate::cuda::{DeviceCache, FormatKernels, Gpu};
use crate::tune::config::with_page_items;
use crate::tune::search::{search, Measured, Space, Strategy};
use crate::tune::store::{Candidate, Confirmation, Entry, Found, SweepRecord, TuneCache};
use crate::tune::{model, shipped, KernelConfig, TuneKey};

#[derive(Debug, Clone)]
pub struct TuneOptions {
    pub shape: DecodeShape,
    pub contexts: Vec<usize>,
    /// Only this tier (by name); `None`: every tier.
    pub tier: Option<String>,
    /// Page sizes to try besides the spec's.
    pub page_items: Vec<u32>,
    pub search: SearchOptions,
    pub steps: StepPlan,
    pub seed: u64,
    /// Sweep even when the cache already has a result.
    pub force: bool,
}

impl Default for TuneOptions {
    fn default() -> Self {
        TuneOptions {
            shape: DecodeShape::default(),
            contexts: vec![8192, 32768],
            tier: None,
            page_items: vec![32, 64, 128, 256, 512],
            search: SearchOptions::default(),
            steps: StepPlan::new(5, 30, StepTiming::Queued),
            seed: 11,
            force: false,
        }
    }
}

/// How the sweep searches a tier's space and confirms its winner.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SearchOptions {
    pub strategy: Strategy,
    /// Largest space searched exhaustively under `Strategy::Auto`.
    pub exhaustive_limit: usize,
    /// Alternating default/winner timings after the search.
    pub confirm_rounds: usize,
    /// Fraction of the default's time a winner must save in the confirmation to
    /// replace it: smaller differences are run-to-run noise.
    pub min_gain: f64,
}

impl Default for SearchOptions {
    fn default() -> Self {
        SearchOptions {
            strategy: Strategy::Auto,
            exhaustive_limit: 48,
            confirm_rounds: 3,
            min_gain: 0.01,
        }
    }
}

/// One tier at one shape: the cache entry, and where it came from.
#[derive(Debug, Clone)]
pub struct Tuned {
    pub entry: Entry,
    pub origin: Origin,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// Found in the cache: no sweep ran.
    Cached,
    Swept,
    /// Swept because the cache's entry was for other generated code.
    ReplacedStale,
}

/// Where a sweep is, for a progress bar.
pub struct Progress<'a> {
    pub what: &'a str,
    pub tried: usize,
    pub estimate: usize,
}

/// Pages of the tier at one page size: the format, source pages to replicate
/// and the interpreter reference every candidate is checked against.
struct PageSetup {
    format: Format,
    source: PagedCache,
    reference: Reference,
}

/// Splits up to this many are checked at the count that is timed; the
/// reference's rows hold this many pages and a third.
const CHECKED_SPLITS: usize = 16;

pub fn tune(
    gpu: &Gpu,
    format: &Format,
    options: &TuneOptions,
    cache: &mut TuneCache,
    progress: &mut dyn FnMut(Progress),
) -> Result<Vec<Tuned>, Box<dyn std::error::Error>> {
    let kv_heads = options.shape.kv_heads;
    if kv_heads == 0
        || options.shape.q_heads == 0
        || !options.shape.q_heads.is_multiple_of(kv_heads)
    {
        return Err(format!(
            "{} query heads is not a positive multiple of {kv_heads} kv heads",
            options.shape.q_heads
        )
        .into());
    }
    if options.shape.batch == 0 || options.contexts.contains(&0) || options.contexts.is_empty() {
        return Err("batch and every context must be at least 1".into());
    }
    if !(0.0..1.0).contains(&options.search.min_gain) {
        return Err(format!("min_gain {} is outside [0, 1)", options.search.min_gain).into());
    }
    let tiers: Vec<usize> = match &options.tier {
        Some(name) => vec![format.tier_index(name).ok_or_else(|| {
            let names: Vec<_> = format
                .spec()
                .tiers
                .iter()
                .map(|t| t.name.as_str())
                .collect();
            format!(
                "format {} has no tier `{name}`; its tiers: {}",
                format.name(),
                names.join(", ")
            )
        })?],
        None => (0..format.tiers().len()).collect(),
    };
    let id = gpu.id();
    let mut results = Vec::new();
    for tier in tiers {
        let mut pages: HashMap<u32, Result<PageSetup, String>> = HashMap::new();
        for &context in &options.contexts {
            let shape = options.shape.bucket(context);
            let key = TuneKey::new(&id, format, tier, shape);
            let origin = match cache.find(&key) {
                Found::Hit(entry) if !options.force => {
                    results.push(Tuned {
                        entry: entry.clone(),
                        origin: Origin::Cached,
                    });
                    continue;
                }
                Found::Stale(_) => Origin::ReplacedStale,
                _ => Origin::Swept,
            };
            // The shipped winner for this very key seeds the search as well:
            // another machine's best is a good start on this one.
            let mut seeds = cache.related_winners(&key);
            if let Found::Hit(entry) = shipped::cache().find(&key) {
                if !seeds.contains(&entry.winner) {
                    seeds.push(entry.winner);
                }
            }
            let mut sweep = Sweep {
                gpu,
                format,
                tier,
                context,
                options,
                pages: &mut pages,
                copies: HashMap::new(),
                kernels: HashMap::new(),
            };
            let entry = sweep.run(key, &seeds, progress)?;
            cache.insert(entry.clone());
            cache.save()?;
            results.push(Tuned { entry, origin });
        }
    }
    Ok(results)
}

struct Sweep<'a> {
    gpu: &'a Gpu,
    format: &'a Format,
    tier: usize,
    context: usize,
    options: &'a TuneOptions,
    pages: &'a mut HashMap<u32, Result<PageSetup, String>>,
    /// Device copies of the timed cache, per page size.
    copies: HashMap<u32, Vec<DeviceCache>>,
    /// Loaded kernels per configuration (splits aside: they are a launch parameter).
    kernels: HashMap<KernelConfig, Result<FormatKernels, String>>,
}

impl Sweep<'_> {
    fn run(
        &mut self,
        key: TuneKey,
        seeds: &[KernelConfig],
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Entry, Box<dyn std::error::Error>> {
        let started = Instant::now();
        // The search starts from, and is confirmed against, what the runtime
        // launches untuned.
        let shape = self.options.shape.bucket(self.context);
        let default = model::config(self.format, self.tier, shape, self.gpu.machine());
        let target = self.gpu.target();
        let group = (self.options.shape.q_heads / self.options.shape.kv_heads) as u32;
        let module = &self.format.tiers()[self.tier];
        let kernel = |config: &KernelConfig| {
            ptx::write_tier(module, group, &config.options(target, group)).map(|k| k.ptx)
        };
        let reference = kernel(&default).ok();
        let space = Space::around(&default, &self.options.page_items)
            .without_duplicates(default, |config| kernel(config).ok() == reference);
        let what = format!("{}/{} @{}", key.format, key.tier, self.context);
        let estimate = space.expected_trials(
            default,
            seeds.len(),
            self.options.search.strategy,
            self.options.search.exhaustive_limit,
        );
        let mut candidates: Vec<Candidate> = Vec::new();
        let report = search(
            &space,
            default,
            seeds,
            self.options.search.strategy,
            self.options.search.exhaustive_limit,
            |config| {
                progress(Progress {
                    what: &what,
                    tried: candidates.len(),
                    estimate: estimate.max(candidates.len() + 1),
                });
                let candidate = self.measure(config);
                let measured: Measured = candidate
                    .ms
                    .ok_or_else(|| candidate.skipped.clone().unwrap_or_default());
                candidates.push(candidate);
                measured
            },
        );
        let mut winner = report.best.map_or(default, |b| report.trials[b].0);
        let mut confirmation = None;
        if winner != default && candidates[0].ms.is_some() {
            let (default_ms, winner_ms) = self.confirm(default, winner)?;
            confirmation = Some(Confirmation {
                default_ms,
                winner_ms,
                rounds: self.options.search.confirm_rounds.max(1),
            });
            if winner_ms > default_ms * (1.0 - self.options.search.min_gain) {
                winner = default;
            }
        }
        Ok(Entry {
            key,
            default,
            winner,
            confirmation,
            candidates,
            sweep: SweepRecord::now(
                report.strategy,
                report.space_size,
                started.elapsed().as_secs_f64(),
            ),
        })
    }

    /// Generates, checks and times one candidate; any failure is the reason it
    /// is skipped.
    fn measure(&mut self, config: &KernelConfig) -> Candidate {
        let mut candidate = Candidate {
            config: *config,
            ms: None,
            min_ms: None,
            max_ms: None,
            max_rel_error: None,
            skipped: None,
        };
        match self.check_and_time(config, &mut candidate.max_rel_error) {
            Ok(t) => {
                candidate.ms = Some(t.ms);
                candidate.min_ms = Some(t.min_ms);
                candidate.max_ms = Some(t.max_ms);
            }
            Err(reason) => candidate.skipped = Some(reason),
        }
        candidate
    }

    fn check_and_time(
        &mut self,
        config: &KernelConfig,
        error: &mut Option<f64>,
    ) -> Result<Timing, String> {
        self.setup(config.page_items)?;
        let generated = self.load(config)?;
        if !self.copies.contains_key(&config.page_items) {
            let setup = self.pages[&config.page_items]
                .as_ref()
                .map_err(String::clone)?;
            let kernels = self.kernels[&generated].as_ref().map_err(String::clone)?;
            let host = setup
                .source
                .replicate(self.options.shape.batch, self.context)
                .map_err(|e| e.to_string())?;
            let copies = upload_copies(self.gpu, kernels, &host, self.options.steps.rotate_bytes)
                .map_err(|e| format!("uploading pages: {e}"))?;
            self.copies.insert(config.page_items, copies);
        }
        let setup = self.pages[&config.page_items]
            .as_ref()
            .map_err(String::clone)?;
        let kernels = self.kernels[&generated].as_ref().map_err(String::clone)?;
        let caches = &self.copies[&config.page_items];
        let mut steps = decode_steps(
            self.gpu,
            kernels,
            caches,
            self.options.shape.q_heads,
            self.options.seed,
        )
        .map_err(|e| e.to_string())?;
        // Checked at the split count that is timed (rows of the reference hold
        // CHECKED_SPLITS pages and a third, so larger counts are checked at that).
        let timed_splits = steps[0].splits.clone();
        let e = setup
            .reference
            .check(self.gpu, kernels, Some(timed_splits))
            .map_err(|e| format!("launch: {e}"))?;
        *error = Some(e);
        if e > TOLERANCE {
            return Err(format!(
                "output differs from the interpreter (max relative error {e:.2e})"
            ));
        }
        time_steps(
            self.gpu,
            kernels,
            caches,
            &mut steps,
            self.options.steps.warmup,
            self.options.steps.iters,
            self.options.steps.timing,
        )
        .map_err(|e| format!("launch: {e}"))
    }

    /// Encodes the tier's pages at `items` per page and computes the reference.
    fn setup(&mut self, items: u32) -> Result<(), String> {
        if !self.pages.contains_key(&items) {
            let setup = (|| -> Result<PageSetup, Box<dyn std::error::Error>> {
                let format = with_page_items(self.format, items)?;
                let source = source_cache(
                    &format,
                    self.tier,
                    self.options.shape.kv_heads,
                    self.options.seed,
                )?;
                let tokens = (CHECKED_SPLITS * items as usize + items as usize / 3).max(1);
                let reference = Reference::new(
                    &source,
                    self.options.shape.q_heads,
                    tokens,
                    self.options.seed ^ 0x51,
                )?;
                Ok(PageSetup {
                    format,
                    source,
                    reference,
                })
            })()
            .map_err(|e| format!("pages of {items} items: {e}"));
            self.pages.insert(items, setup);
        }
        self.pages[&items]
            .as_ref()
            .map(|_| ())
            .map_err(String::clone)
    }

    /// Kernels for `config` (every tier at it; only the tuned tier has pages),
    /// set to launch `config.splits`; returns their key in `self.kernels`
    /// (the configuration without splits, which do not change the code).
    fn load(&mut self, config: &KernelConfig) -> Result<KernelConfig, String> {
        let generated = KernelConfig {
            splits: None,
            ..*config
        };
        if !self.kernels.contains_key(&generated) {
            let setup = self.pages[&config.page_items]
                .as_ref()
                .map_err(String::clone)?;
            let configs = vec![generated; setup.format.tiers().len()];
            let group = (self.options.shape.q_heads / self.options.shape.kv_heads) as u32;
            let kernels = FormatKernels::load_configs(self.gpu, &setup.format, &configs, group)
                .map_err(|e| format!("codegen/load: {e}"));
            self.kernels.insert(generated, kernels);
        }
        let kernels = self
            .kernels
            .get_mut(&generated)
            .expect("inserted above")
            .as_mut()
            .map_err(|e| e.clone())?;
        kernels.splits[self.tier] = config.splits;
        Ok(generated)
    }

    /// Default and winner timed alternately; the median of each one's medians.
    fn confirm(
        &mut self,
        default: KernelConfig,
        winner: KernelConfig,
    ) -> Result<(f64, f64), Box<dyn std::error::Error>> {
        let rounds = self.options.search.confirm_rounds.max(1);
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..rounds {
            for (slot, config) in [default, winner].iter().enumerate() {
                let mut error = None;
                let t = self.check_and_time(config, &mut error)?;
                times[slot].push(t.ms);
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        Ok((median(&mut times[0]), median(&mut times[1])))
    }
}
