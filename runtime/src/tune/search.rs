//! The tuning space and the search over it. A search only sees a `measure`
//! function (milliseconds, or why a candidate could not run), so the strategy
//! is tested on the CPU with synthetic costs.

use std::collections::HashMap;

use kvcc_compiler::back::ptx::Schedule;
use serde::{Deserialize, Serialize};

use super::KernelConfig;

/// Values to try on each axis (each includes the default's value).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Space {
    pub page_items: Vec<u32>,
    pub warps: Vec<u32>,
    pub splits: Vec<Option<u32>>,
    pub tile_items: Vec<Option<u32>>,
    #[serde(default)]
    pub stages: Vec<u32>,
    #[serde(default)]
    pub tensor_cores: Vec<bool>,
    pub head_block: Vec<u32>,
    pub max_accumulators: Vec<u32>,
    #[serde(default)]
    pub pipeline: Vec<bool>,
    #[serde(default)]
    pub bulk_copies: Vec<Option<bool>>,
}

/// Axes (page, warps, splits, tile, stages, tensor cores, head block,
/// accumulators, pipeline, bulk copies): the fields of a [`KernelConfig`]
/// the space sweeps.
const AXES: usize = 10;

/// The axes coordinate descent sweeps together, in the order it visits
/// them: page size and warps first (they change occupancy the most); tile
/// and splits jointly, since a fixed split count suits one tile size only
/// (on an H200, kivi int8 at 32K: 64-item tiles were 9 % slower than whole
/// pages with 4 splits and 8 % faster with one wave's splits).
const MOVES: [&[usize]; 9] = [&[0], &[1], &[3, 2], &[4], &[5], &[6], &[7], &[8], &[9]];

/// `values` with `first` first (added when missing).
fn with_first<T: PartialEq + Copy, const N: usize>(first: T, values: [T; N]) -> Vec<T> {
    let mut all = vec![first];
    all.extend(values.into_iter().filter(|&v| v != first));
    all
}

impl Space {
    /// The standard space around `default`, with the page sizes to try.
    pub fn around(default: &KernelConfig, page_items: &[u32]) -> Space {
        let with = |mut values: Vec<u32>, v: u32| {
            values.push(v);
            values.sort_unstable();
            values.dedup();
            values
        };
        let tiles = [None, Some(16), Some(32), Some(64), Some(128)];
        Space {
            page_items: with(page_items.to_vec(), default.page_items),
            warps: with(vec![2, 4, 8], default.schedule.warps),
            splits: with_first(default.splits, [None, Some(2), Some(4), Some(8), Some(16)]),
            tile_items: with_first(default.schedule.tile_items, tiles),
            stages: with(vec![2, 3, 4], default.schedule.stages),
            tensor_cores: with_first(default.schedule.tensor_cores, [true, false]),
            head_block: with(vec![4, 8], default.schedule.head_block),
            max_accumulators: with(vec![16, 32], default.schedule.max_accumulators),
            pipeline: with_first(default.schedule.pipeline, [false, true]),
            bulk_copies: with_first(
                default.schedule.bulk_copies,
                [None, Some(true), Some(false)],
            ),
        }
    }

    /// The space without the values of the code-only axes (tensor cores,
    /// head block, accumulators, pipeline, bulk copies) that give the same
    /// kernel as `default`
    /// (`same` says whether a configuration does): for a tier the tensor
    /// cores do not serve, or whose phases all run on them, such values
    /// would only time one kernel again under another label.
    pub fn without_duplicates(
        mut self,
        default: KernelConfig,
        same: impl Fn(&KernelConfig) -> bool,
    ) -> Space {
        // Whether `default` with one axis changed by `set` gives another kernel.
        let differs = |set: &dyn Fn(&mut KernelConfig)| {
            let mut c = default;
            set(&mut c);
            !same(&c)
        };
        self.tensor_cores.retain(|&v| {
            v == default.schedule.tensor_cores || differs(&|c| c.schedule.tensor_cores = v)
        });
        self.head_block.retain(|&v| {
            v == default.schedule.head_block || differs(&|c| c.schedule.head_block = v)
        });
        self.max_accumulators.retain(|&v| {
            v == default.schedule.max_accumulators || differs(&|c| c.schedule.max_accumulators = v)
        });
        self.pipeline
            .retain(|&v| v == default.schedule.pipeline || differs(&|c| c.schedule.pipeline = v));
        self.bulk_copies.retain(|&v| {
            v == default.schedule.bulk_copies || differs(&|c| c.schedule.bulk_copies = v)
        });
        self
    }

    fn len(&self, axis: usize) -> usize {
        match axis {
            0 => self.page_items.len(),
            1 => self.warps.len(),
            2 => self.splits.len(),
            3 => self.tile_items.len(),
            4 => self.stages.len(),
            5 => self.tensor_cores.len(),
            6 => self.head_block.len(),
            7 => self.max_accumulators.len(),
            8 => self.pipeline.len(),
            _ => self.bulk_copies.len(),
        }
    }

    /// `config` with axis `axis` set to its `i`-th value.
    fn set(&self, config: KernelConfig, axis: usize, i: usize) -> KernelConfig {
        let mut c = config;
        match axis {
            0 => c.page_items = self.page_items[i],
            1 => c.schedule.warps = self.warps[i],
            2 => c.splits = self.splits[i],
            3 => c.schedule.tile_items = self.tile_items[i],
            4 => c.schedule.stages = self.stages[i],
            5 => c.schedule.tensor_cores = self.tensor_cores[i],
            6 => c.schedule.head_block = self.head_block[i],
            7 => c.schedule.max_accumulators = self.max_accumulators[i],
            8 => c.schedule.pipeline = self.pipeline[i],
            _ => c.schedule.bulk_copies = self.bulk_copies[i],
        }
        c.normalized()
    }

    /// Every combination of the values of `axes`, the other axes as in
    /// `base` (normalized, deduplicated, in axis order).
    fn sweep(&self, base: KernelConfig, axes: &[usize]) -> Vec<KernelConfig> {
        let mut points = vec![base.normalized()];
        for &axis in axes {
            let mut next = Vec::new();
            for &p in &points {
                for i in 0..self.len(axis) {
                    let c = self.set(p, axis, i);
                    if !next.contains(&c) {
                        next.push(c);
                    }
                }
            }
            points = next;
        }
        points
    }

    /// Points in the space (before merging equivalent ones).
    pub fn size(&self) -> usize {
        (0..AXES).map(|a| self.len(a)).product()
    }

    /// Candidates a search is expected to measure (for a progress bar): every
    /// point when exhaustive; for descent, the seeds and two passes over the
    /// moves per descent (a second one starts from the fastest seed).
    pub fn expected_trials(
        &self,
        default: KernelConfig,
        seeds: usize,
        strategy: Strategy,
        exhaustive_limit: usize,
    ) -> usize {
        match strategy.resolve(self, exhaustive_limit) {
            Strategy::Descent => {
                seeds
                    + if seeds > 0 { 4 } else { 2 }
                        * MOVES
                            .iter()
                            .map(|axes| axes.iter().map(|&a| self.len(a)).product::<usize>())
                            .sum::<usize>()
            }
            _ => self.all(default).len(),
        }
    }

    /// Whether every axis of `config` takes one of the space's values.
    pub fn contains(&self, config: &KernelConfig) -> bool {
        let c = config.normalized();
        (0..AXES).all(|axis| (0..self.len(axis)).any(|i| self.set(c, axis, i) == c))
    }

    /// Every point, deduplicated after normalization.
    pub fn all(&self, default: KernelConfig) -> Vec<KernelConfig> {
        let axes: Vec<usize> = (0..AXES).collect();
        let mut points = self.sweep(default, &axes);
        // The default first: it is measured before anything else.
        let d = default.normalized();
        points.retain(|&c| c != d);
        points.insert(0, d);
        points
    }
}

impl KernelConfig {
    /// Equivalent configurations made equal: a tile of at least a page is the
    /// whole page.
    pub fn normalized(self) -> KernelConfig {
        KernelConfig {
            schedule: Schedule {
                tile_items: self.schedule.tile_items.filter(|&t| t < self.page_items),
                ..self.schedule
            },
            ..self
        }
    }
}

/// How the space is searched (`--search auto|exhaustive|descent`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Exhaustive when the space has at most `--exhaustive-limit` points, else descent.
    Auto,
    /// Every point of the space.
    Exhaustive,
    /// Coordinate descent from the default, and again from the fastest
    /// seed: sweep one move's axes at a time with the others at the best so
    /// far; repeat until a pass changes nothing.
    Descent,
}

impl Strategy {
    /// `Auto` made concrete for `space`.
    fn resolve(self, space: &Space, exhaustive_limit: usize) -> Strategy {
        match self {
            Strategy::Auto if space.size() <= exhaustive_limit => Strategy::Exhaustive,
            Strategy::Auto => Strategy::Descent,
            s => s,
        }
    }
}

/// A candidate's measurement: its median time, or why it did not count.
pub type Measured = Result<f64, String>;

#[derive(Debug, Clone)]
pub struct SearchReport {
    /// The strategy that ran (`Auto` resolved).
    pub strategy: Strategy,
    /// Points in the space.
    pub space_size: usize,
    /// Every candidate measured, in order (the default first).
    pub trials: Vec<(KernelConfig, Measured)>,
    /// Index into `trials` of the fastest candidate that ran.
    pub best: Option<usize>,
}

/// Most descent passes: each pass can only lower the best time, so this only
/// bounds pathological plateaus.
const MAX_PASSES: usize = 4;

/// Searches `space`, measuring `default` first. `seeds` (e.g. earlier
/// winners of the tier) are measured next, and a descent from the fastest
/// one follows the descent from the default: the result then depends less on
/// either path, and is never slower than the default's descent or a seed.
pub fn search(
    space: &Space,
    default: KernelConfig,
    seeds: &[KernelConfig],
    strategy: Strategy,
    exhaustive_limit: usize,
    mut measure: impl FnMut(&KernelConfig) -> Measured,
) -> SearchReport {
    let strategy = strategy.resolve(space, exhaustive_limit);
    let mut trials: Vec<(KernelConfig, Measured)> = Vec::new();
    let mut seen: HashMap<KernelConfig, usize> = HashMap::new();
    let mut trial = |config: KernelConfig, trials: &mut Vec<(KernelConfig, Measured)>| -> usize {
        *seen.entry(config).or_insert_with(|| {
            trials.push((config, measure(&config)));
            trials.len() - 1
        })
    };
    let ms = |trials: &[(KernelConfig, Measured)], i: usize| trials[i].1.clone().ok();
    let faster = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => a < b,
        (Some(_), None) => true,
        _ => false,
    };
    match strategy {
        Strategy::Exhaustive | Strategy::Auto => {
            for config in space.all(default) {
                trial(config, &mut trials);
            }
        }
        Strategy::Descent => {
            let from_default = trial(default.normalized(), &mut trials);
            let mut from_seed: Option<usize> = None;
            for seed in seeds.iter().filter(|seed| space.contains(seed)) {
                let t = trial(seed.normalized(), &mut trials);
                if from_seed.is_none_or(|best| faster(ms(&trials, t), ms(&trials, best))) {
                    from_seed = Some(t);
                }
            }
            let mut descend = |mut current: usize, trials: &mut Vec<(KernelConfig, Measured)>| {
                for _ in 0..MAX_PASSES {
                    let pass_start = current;
                    for axes in MOVES {
                        for config in space.sweep(trials[current].0, axes) {
                            let t = trial(config, trials);
                            if faster(ms(trials, t), ms(trials, current)) {
                                current = t;
                            }
                        }
                    }
                    if current == pass_start {
                        break;
                    }
                }
            };
            descend(from_default, &mut trials);
            if let Some(seed) = from_seed {
                descend(seed, &mut trials);
            }
        }
    }
    let best = (0..trials.len())
        .filter(|&i| trials[i].1.is_ok())
        .min_by(|&a, &b| ms(&trials, a).unwrap().total_cmp(&ms(&trials, b).unwrap()));
    SearchReport {
        strategy,
        space_size: space.size(),
        trials,
        best,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn default() -> KernelConfig {
        KernelConfig {
            page_items: 64,
            splits: None,
            schedule: Schedule::default(),
        }
    }

    /// A separable cost with its minimum at p128 w8 splits 8, 3 stages, hb 4.
    fn cost(c: &KernelConfig) -> Measured {
        let axis = |v: f64, best: f64| (v.log2() - best.log2()).abs();
        Ok(1.0
            + axis(c.page_items as f64, 128.0)
            + axis(c.schedule.warps as f64, 8.0)
            + axis(c.splits.unwrap_or(6) as f64, 8.0)
            + axis(c.schedule.head_block as f64, 4.0)
            + if c.schedule.tile_items.is_some() {
                0.5
            } else {
                0.0
            }
            + axis(c.schedule.stages as f64, 3.0)
            + if c.schedule.max_accumulators == 16 {
                0.25
            } else {
                0.0
            })
    }

    fn space() -> Space {
        Space::around(&default(), &[32, 64, 128, 256])
    }

    #[test]
    fn the_space_holds_the_default_and_merges_equivalent_tiles() {
        let s = space();
        assert_eq!(s.size(), 4 * 3 * 5 * 5 * 3 * 2 * 2 * 2 * 2 * 3);
        let all = s.all(default());
        assert_eq!(all[0], default());
        // Tiles of at least a page are the whole page: on 32-item pages, tiles
        // 32, 64 and 128 merge with the whole page (16 stays).
        let on = |items: u32| all.iter().filter(move |c| c.page_items == items).count();
        let others = 3 * 5 * 3 * 2 * 2 * 2 * 2 * 3;
        assert_eq!(on(32), 2 * others);
        assert_eq!(on(64), 3 * others);
        assert_eq!(on(128), 4 * others);
        assert_eq!(on(256), 5 * others);
        assert_eq!(all.len(), 14 * others);
    }

    #[test]
    fn axes_that_leave_the_kernel_unchanged_are_not_swept() {
        // A tier whose kernel ignores the tensor-core switch and the head
        // block: only the accumulators change it.
        let same =
            |c: &KernelConfig| c.schedule.max_accumulators == default().schedule.max_accumulators;
        let s = space().without_duplicates(default(), same);
        assert_eq!(s.tensor_cores, vec![true]);
        assert_eq!(s.head_block, vec![8]);
        assert_eq!(s.max_accumulators, vec![16, 32]);
        assert_eq!(s.pipeline, vec![false]);
        assert_eq!(s.bulk_copies, vec![None]);
        assert_eq!(s.all(default())[0], default());
        // Every code-only value changes the kernel: nothing is dropped.
        let all_differ = space().without_duplicates(default(), |c| *c == default());
        assert_eq!(all_differ, space());
        // None does: each of the five axes keeps the default's value only.
        let none_differ = space().without_duplicates(default(), |_| true);
        assert_eq!(none_differ.size(), space().size() / 48);
    }

    #[test]
    fn exhaustive_search_finds_the_minimum() {
        let report = search(&space(), default(), &[], Strategy::Exhaustive, 0, cost);
        let (best, ms) = &report.trials[report.best.unwrap()];
        assert_eq!(report.trials[0].0, default());
        assert_eq!(report.trials.len(), space().all(default()).len());
        assert_eq!(best.page_items, 128);
        assert_eq!(best.schedule.warps, 8);
        assert_eq!(best.splits, Some(8));
        assert_eq!(*ms.as_ref().unwrap(), 1.0);
    }

    #[test]
    fn descent_finds_a_separable_minimum_with_few_candidates() {
        let report = search(&space(), default(), &[], Strategy::Auto, 64, cost);
        assert_eq!(report.strategy, Strategy::Descent);
        let (best, ms) = &report.trials[report.best.unwrap()];
        assert_eq!(*ms.as_ref().unwrap(), 1.0, "{best}");
        // Two passes over the moves at most, a small part of the space.
        let expected = space().expected_trials(default(), 0, Strategy::Descent, 0);
        assert!(
            report.trials.len() <= expected && expected < space().size() / 20,
            "{} candidates, {expected} expected",
            report.trials.len()
        );
        assert_eq!(report.trials[0].0, default());
    }

    #[test]
    fn descent_finds_a_tile_that_wins_only_with_its_own_splits() {
        // As measured for kivi int8: 64-item tiles lose at the splits the
        // whole page prefers (4) and win at one wave's (auto).
        let coupled = |c: &KernelConfig| -> Measured {
            Ok(match (c.schedule.tile_items, c.splits) {
                (Some(64), None) => 0.5,
                (Some(64), _) => 1.2,
                (_, Some(4)) => 0.9,
                _ => 1.0,
            } + if c.page_items == 128 { 0.0 } else { 0.1 })
        };
        let report = search(&space(), default(), &[], Strategy::Descent, 0, coupled);
        let (best, _) = report.trials[report.best.unwrap()];
        assert_eq!(
            (best.page_items, best.schedule.tile_items, best.splits),
            (128, Some(64), None)
        );
        assert!(report.trials.len() <= space().expected_trials(default(), 0, Strategy::Descent, 0));
    }

    #[test]
    fn descent_runs_again_from_the_fastest_seed() {
        // A minimum no single move reaches from the default: fewer warps pay
        // only with small tiles and many splits (as KIVI int4 measured).
        let hidden = |c: &KernelConfig| -> Measured {
            Ok(match (c.schedule.warps, c.schedule.tile_items, c.splits) {
                (2, Some(32), Some(16)) => 0.5,
                (2, _, _) => 1.3,
                _ => 1.0,
            })
        };
        let best_of = |seeds: &[KernelConfig]| {
            let report = search(&space(), default(), seeds, Strategy::Descent, 0, hidden);
            assert_eq!(report.trials[0].0, default());
            report.trials[report.best.unwrap()].clone()
        };
        assert_eq!(best_of(&[]).1, Ok(1.0));
        let seed = KernelConfig {
            splits: Some(16),
            schedule: Schedule {
                warps: 2,
                tile_items: Some(32),
                ..default().schedule
            },
            ..default()
        };
        assert_eq!(best_of(&[seed]), (seed, Ok(0.5)));
        // The default's own descent still runs: a point it reaches wins over
        // the seed's basin.
        let both = |c: &KernelConfig| match (c.page_items, c.schedule.warps) {
            (128, 4) => Ok(0.4),
            _ => hidden(c),
        };
        let report = search(&space(), default(), &[seed], Strategy::Descent, 0, both);
        let (best, ms) = &report.trials[report.best.unwrap()];
        assert_eq!(
            (best.page_items, best.schedule.warps, ms),
            (128, 4, &Ok(0.4))
        );
        assert_eq!(report.trials[1].0, seed);
        // Seeds outside the space are not measured.
        let outside = KernelConfig {
            schedule: Schedule {
                warps: 3,
                ..seed.schedule
            },
            ..seed
        };
        let report = search(
            &space(),
            default(),
            &[outside],
            Strategy::Descent,
            0,
            hidden,
        );
        assert!(report.trials.iter().all(|(c, _)| c.schedule.warps != 3));
        assert!(!space().contains(&outside) && space().contains(&seed));
    }

    #[test]
    fn candidates_that_fail_never_win() {
        // The fastest point fails to run; the search keeps going around it.
        let failing = |c: &KernelConfig| {
            if c.schedule.warps == 8 {
                Err("too many registers".to_string())
            } else {
                cost(c)
            }
        };
        for strategy in [Strategy::Exhaustive, Strategy::Descent] {
            let report = search(&space(), default(), &[], strategy, 0, failing);
            let (best, _) = report.trials[report.best.unwrap()];
            assert_ne!(best.schedule.warps, 8);
            assert!(report
                .trials
                .iter()
                .any(|(c, m)| c.schedule.warps == 8 && m.is_err()));
        }
        let none = search(&space(), default(), &[], Strategy::Descent, 0, |_| {
            Err("no".into())
        });
        assert_eq!(none.best, None);
    }
}
