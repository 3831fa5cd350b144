//! `kvcc`: check specs, run the demo, evaluate formats on dumped tensors.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressFinish, ProgressStyle};
use kvcc_compiler::Format;
use kvcc_runtime::cli::{self, bench, budget_eval, check, demo, eval, live_bench, policy};
use kvcc_runtime::cuda::measure::{DecodeShape, StepPlan, StepTiming};
use kvcc_runtime::cuda::Gpu;
use kvcc_runtime::exec::ExecutorKind;
use kvcc_runtime::live::CachePolicy;
use kvcc_runtime::sweep::{self, SearchOptions, TuneOptions};
use kvcc_runtime::tensor_io::load_qkv;
use kvcc_runtime::tune::TuneCache;

#[derive(Parser)]
#[command(
    name = "kvcc",
    version,
    about = "A compiler for compressed-domain attention over KV-cache code formats"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum CacheAction {
    /// Print the cache's location.
    Path,
    /// One line per entry: the user's, then the results shipped with kvcc.
    Show {
        #[arg(long)]
        json: bool,
    },
    /// Write the entries (of one GPU, if named) to a file to ship with an application.
    Export {
        file: PathBuf,
        /// Only entries of GPUs whose name contains this.
        #[arg(long)]
        gpu: Option<String>,
    },
    /// Merge an exported file into the cache.
    Import { file: PathBuf },
}

/// How `demo` and `eval` decode and report.
#[derive(Args)]
struct FidelityArgs {
    /// Tokens to amortize page headers, partial pages and tables over
    /// (default: the data's own token count).
    #[arg(long)]
    context: Option<u32>,
    /// Executor that decodes the queries (interp, jit, cuda).
    #[arg(long, default_value = "jit")]
    executor: ExecutorKind,
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a spec and print each tier's layout and byte accounting.
    Check {
        spec: PathBuf,
        /// Tokens to amortize page headers and tables over.
        #[arg(long, default_value_t = 32_768)]
        context: u32,
        #[arg(long)]
        json: bool,
    },
    /// Every bundled spec on structured synthetic K/V: bytes, ratio, attention error.
    Demo {
        /// Run the specs in this folder instead of the bundled ones.
        #[arg(long)]
        specs: Option<PathBuf>,
        #[arg(long, default_value_t = 7)]
        seed: u64,
        #[arg(long, default_value_t = 1000)]
        tokens: usize,
        #[command(flatten)]
        fidelity: FidelityArgs,
        #[command(flatten)]
        policy: PolicyArgs,
    },
    /// Time the generated GPU kernels against dense decode baselines (needs a GPU).
    Bench {
        /// Run the specs in this folder instead of the bundled ones.
        #[arg(long)]
        specs: Option<PathBuf>,
        /// Only formats whose name is listed (comma-separated).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        #[command(flatten)]
        shape: DecodeShape,
        /// Context lengths (tokens per sequence), comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "8192,32768,131072")]
        ctx: Vec<usize>,
        #[arg(long, default_value_t = 10)]
        warmup: usize,
        #[arg(long, default_value_t = 50)]
        iters: usize,
        /// How steps are launched and timed.
        #[arg(long, default_value = "queued")]
        timing: StepTiming,
        /// JSON written by benches/gpu/baseline.py in the same session.
        #[arg(long)]
        baseline: Option<PathBuf>,
        /// Time the default kernel configurations, not the tune cache's.
        #[arg(long)]
        no_tune: bool,
        /// A serving loop on the live cache: every step appends one token per
        /// sequence and decodes (baselines from benches/gpu/live_baseline.py).
        #[arg(long)]
        live: bool,
        /// With --live: timed steps (rounded up to whole pages).
        #[arg(long, default_value_t = 256)]
        steps: usize,
        #[command(flatten)]
        policy: PolicyArgs,
        /// Also write the report as JSON to this file.
        #[arg(long)]
        save: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Autotune page size, tile shape, warps and splits of each tier's GPU kernel
    /// at a serving shape; results go to the tune cache the runtime reads.
    Tune {
        /// Spec file, or a bundled spec by name (comma-separated for several).
        #[arg(long, value_delimiter = ',', required = true)]
        spec: Vec<String>,
        /// Only this tier.
        #[arg(long)]
        tier: Option<String>,
        #[command(flatten)]
        shape: DecodeShape,
        /// Context lengths, comma-separated; each is tuned for its power-of-two bucket.
        #[arg(long, value_delimiter = ',', default_value = "8192,32768")]
        ctx: Vec<usize>,
        /// Page sizes to try besides the spec's (items per page).
        #[arg(long, value_delimiter = ',', default_value = "32,64,128,256,512")]
        pages: Vec<u32>,
        /// How the space is searched.
        #[arg(long, default_value = "auto")]
        search: kvcc_runtime::tune::Strategy,
        #[arg(long, default_value_t = 48)]
        exhaustive_limit: usize,
        #[arg(long, default_value_t = 5)]
        warmup: usize,
        #[arg(long, default_value_t = 30)]
        iters: usize,
        /// How steps are launched and timed.
        #[arg(long, default_value = "queued")]
        timing: StepTiming,
        /// Least time a winner must save over the default (in the alternating
        /// confirmation) to replace it, as a fraction; below it is noise.
        #[arg(long, default_value_t = 0.01)]
        min_gain: f64,
        /// Sweep again even when the cache has a result.
        #[arg(long)]
        force: bool,
        /// Also write the report as JSON to this file.
        #[arg(long)]
        save: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Inspect, export or import the tune cache ($KVCC_TUNE_CACHE or ~/.cache/kvcc/tune-cache.json).
    TuneCache {
        #[command(subcommand)]
        action: CacheAction,
    },
    /// Fidelity of every tier on K/V/Q dumped from a model.
    Eval {
        spec: PathBuf,
        /// A .safetensors file with `<prefix>.q/.k/.v`, or `<stem>.{q,k,v}.npy`.
        #[arg(long)]
        qkv: PathBuf,
        /// Tensor name prefix (found automatically when unique).
        #[arg(long)]
        prefix: Option<String>,
        /// Query rows per (layer, head), evenly spaced.
        #[arg(long, default_value_t = 64)]
        max_queries: usize,
        #[command(flatten)]
        fidelity: FidelityArgs,
        #[command(flatten)]
        policy: PolicyArgs,
    },
}

/// Overrides of the spec's `[cache]` policy: each tier is also scored held by
/// a live cache that keeps these tokens exact.
#[derive(Args)]
struct PolicyArgs {
    /// First tokens of every sequence kept exact (default: the spec's `cache.sinks`).
    #[arg(long)]
    sinks: Option<usize>,
    /// Most recent tokens kept exact (default: the spec's `cache.window`).
    #[arg(long)]
    window: Option<usize>,
    /// Compressed pages a step reads per sequence and kv head, where the
    /// spec has a `[cache.select]` (default: its budget).
    #[arg(long)]
    select_pages: Option<u32>,
    /// Average page bytes per compressed state, comma-separated: the
    /// `[cache.budget]` controller over every tier beside each tier alone
    /// and KIVI int8/int4 alone at each budget (in place of the tier table).
    #[arg(long, value_delimiter = ',')]
    budget: Vec<f64>,
}

fn bar(total: u64, message: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:30}] {pos}/{len} {elapsed}")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(message.to_string());
    bar
}

/// Runs `work` under a bar of `total` steps, each named on the bar as `work`
/// reports it; the bar is cleared when `work` returns.
fn with_steps<T>(total: usize, message: &str, work: impl FnOnce(&mut dyn FnMut(&str)) -> T) -> T {
    let progress = bar(total as u64, message);
    let out = work(&mut |what: &str| {
        progress.set_message(what.to_string());
        progress.inc(1);
    });
    progress.finish_and_clear();
    out
}

/// Writes `report` as JSON to `save` if given, and prints it as JSON or as
/// `render`'s table.
fn emit<T: serde::Serialize>(
    report: &T,
    save: Option<PathBuf>,
    json: bool,
    render: impl FnOnce() -> String,
) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(path) = save {
        std::fs::write(&path, serde_json::to_string_pretty(report)?)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        println!("{}", render());
    }
    Ok(())
}

/// The tune cache at its default location; what is wrong with it is a warning.
fn open_tune_cache() -> TuneCache {
    let cache = TuneCache::open_default();
    for problem in cache.problems() {
        eprintln!("warning: {problem}");
    }
    cache
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    match cli.command {
        Command::Check {
            spec,
            context,
            json,
        } => {
            let format = Format::load(&spec)?;
            let report = check::report(&format, context);
            emit(&report, None, json, || {
                format!(
                    "{}\n{}",
                    check::render(&report),
                    policy::render(&format, &report.cache)
                )
            })?;
        }
        Command::Demo {
            specs,
            seed,
            tokens,
            fidelity,
            policy,
        } => {
            let formats = demo::formats(specs.as_deref())?;
            let options = demo::DemoOptions {
                seed,
                tokens,
                context: fidelity.context,
                executor: fidelity.executor,
                sinks: policy.sinks,
                window: policy.window,
                ..Default::default()
            };
            let rows = with_steps(formats.len(), "demo", |step| {
                demo::run(&formats, &options, step)
            })?;
            emit(&rows, None, fidelity.json, || demo::render(&rows, &options))?;
        }
        Command::Bench {
            specs,
            only,
            shape,
            ctx,
            warmup,
            iters,
            timing,
            baseline,
            no_tune,
            live,
            steps,
            policy,
            save,
            json,
        } => {
            let mut formats = demo::formats(specs.as_deref())?;
            if !only.is_empty() {
                formats.retain(|f| only.iter().any(|o| o == f.name()));
            }
            let baselines = baseline.map(|p| bench::Baselines::load(&p)).transpose()?;
            if live {
                let options = live_bench::LiveBenchOptions {
                    shape,
                    contexts: ctx,
                    warmup,
                    steps,
                    sinks: policy.sinks,
                    window: policy.window,
                    ..Default::default()
                };
                let tiers: usize = formats.iter().map(|f| f.tiers().len()).sum();
                let report = with_steps(tiers * options.contexts.len(), "bench --live", |step| {
                    live_bench::run(&formats, baselines, &options, step)
                })?;
                return emit(&report, save, json, || live_bench::render(&report));
            }
            let options = bench::BenchOptions {
                shape,
                contexts: ctx,
                steps: StepPlan::new(warmup, iters, timing),
                tuned: !no_tune,
                ..Default::default()
            };
            let tiers: usize = formats.iter().map(|f| f.tiers().len()).sum();
            let report = with_steps(tiers * options.contexts.len(), "bench", |step| {
                bench::run(&formats, baselines, &options, step)
            })?;
            emit(&report, save, json, || bench::render(&report))?;
        }
        Command::Tune {
            spec,
            tier,
            shape,
            ctx,
            pages,
            search,
            exhaustive_limit,
            warmup,
            iters,
            timing,
            min_gain,
            force,
            save,
            json,
        } => {
            let formats = spec
                .iter()
                .map(|s| cli::tune::load_spec(s))
                .collect::<Result<Vec<_>, _>>()?;
            let options = TuneOptions {
                shape,
                contexts: ctx,
                tier,
                page_items: pages,
                search: SearchOptions {
                    strategy: search,
                    exhaustive_limit,
                    min_gain,
                    ..Default::default()
                },
                steps: StepPlan::new(warmup, iters, timing),
                force,
                ..Default::default()
            };
            let gpu = Gpu::open()?;
            let mut cache = open_tune_cache();
            let progress = bar(1, "tune");
            let mut results = Vec::new();
            for format in &formats {
                results.extend(sweep::tune(&gpu, format, &options, &mut cache, &mut |p| {
                    progress.set_message(p.what.to_string());
                    progress.set_length(p.estimate as u64);
                    progress.set_position(p.tried as u64);
                })?);
            }
            progress.finish_and_clear();
            let report = cli::tune::report(&cache, &results);
            emit(&report, save, json, || cli::tune::render(&cache, &results))?;
        }
        Command::TuneCache { action } => {
            let mut cache = open_tune_cache();
            match action {
                CacheAction::Path => println!("{}", cache.path().display()),
                CacheAction::Show { json } => {
                    let shipped = kvcc_runtime::tune::shipped::cache();
                    if json {
                        let entries = serde_json::json!({
                            "user": { "path": cache.path(), "entries": cache.entries() },
                            "shipped": {
                                "path": shipped.path(),
                                "entries": shipped.entries().iter().map(|e| serde_json::json!({
                                    "fresh": kvcc_runtime::tune::shipped::is_fresh(e),
                                    "entry": e,
                                })).collect::<Vec<_>>(),
                            },
                        });
                        println!("{}", serde_json::to_string_pretty(&entries)?);
                    } else {
                        println!("{}", cli::tune::show(&cache, shipped));
                    }
                }
                CacheAction::Export { file, gpu } => {
                    let n = cache.export(&file, |e| {
                        gpu.as_ref()
                            .is_none_or(|g| e.key.gpu.name.contains(g.as_str()))
                    })?;
                    println!(
                        "exported {n} entries from {} to {}",
                        cache.path().display(),
                        file.display()
                    );
                }
                CacheAction::Import { file } => {
                    let (merged, problems) = cache.import(&file)?;
                    for problem in problems {
                        eprintln!("warning: {}: {problem}", file.display());
                    }
                    cache.save()?;
                    println!(
                        "imported {} into {}: {} added, {} replaced",
                        file.display(),
                        cache.path().display(),
                        merged.added,
                        merged.replaced
                    );
                }
            }
        }
        Command::Eval {
            spec,
            qkv,
            prefix,
            max_queries,
            fidelity,
            policy,
        } => {
            let format = Format::load(&spec)?;
            let loading = ProgressBar::new_spinner()
                .with_finish(ProgressFinish::AndClear)
                .with_message(format!("reading {}", qkv.display()));
            loading.enable_steady_tick(Duration::from_millis(200));
            let data = load_qkv(&qkv, prefix.as_deref())?;
            loading.finish_and_clear();
            let budgets = policy.budget.clone();
            let policy = CachePolicy::of(&format)
                .with_overrides(policy.sinks, policy.window)
                .with_select_budget(policy.select_pages);
            let progress = bar(0, "eval").with_finish(ProgressFinish::AndClear);
            progress.enable_steady_tick(Duration::from_millis(200));
            if !budgets.is_empty() {
                if let Some(b) = budgets.iter().find(|b| !(b.is_finite() && **b > 0.0)) {
                    return Err(
                        format!("--budget {b}: a budget is a number of bytes above 0").into(),
                    );
                }
                let report = budget_eval::run(
                    &format,
                    &data,
                    &budgets,
                    policy,
                    max_queries.max(1),
                    fidelity.executor,
                    |done, total| {
                        progress.set_length(total as u64);
                        progress.set_position(done as u64);
                    },
                )?;
                progress.finish_and_clear();
                emit(&report, None, fidelity.json, || {
                    budget_eval::render(&report)
                })?;
                return Ok(());
            }
            let report = eval::run(
                &format,
                &data,
                max_queries.max(1),
                fidelity.context,
                fidelity.executor,
                (policy.keeps_exact() || policy.select.is_some()).then_some(policy),
                |done, total| {
                    progress.set_length(total as u64);
                    progress.set_position(done as u64);
                },
            )?;
            progress.finish_and_clear();
            emit(&report, None, fidelity.json, || eval::render(&report))?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            ExitCode::FAILURE
        }
    }
}
