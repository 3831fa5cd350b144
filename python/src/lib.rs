//! `kvcc._kvcc`: the native half of the `kvcc` Python package. It is thin on
//! purpose: formats, table training, a one-shot paged cache and the live cache
//! behind [`LiveKv`], on contiguous f32 numpy arrays (torch CPU tensors share
//! their memory with them). The Python half (`python/kvcc/`) checks shapes,
//! dtypes and devices of torch tensors and calls into this module.
//!
//! Every error of the runtime reaches Python with the message the `kvcc`
//! command prints after `error: `.

mod device;
mod errors;

use std::sync::{Mutex, MutexGuard};

use numpy::{PyArray1, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

use kvcc_compiler::spec::ExactDtype;
use kvcc_compiler::Format as CoreFormat;
use kvcc_runtime::cache::{self, PagedCache, Tables as CoreTables};
use kvcc_runtime::encode::TrainOptions;
use kvcc_runtime::exec::{ExecutorKind, Request};
use kvcc_runtime::live::{Append, CachePolicy, LiveKv, LiveOptions, Queries, SequenceKv};

use device::{Backend, Device, DeviceRows};
use errors::{kvcc_error, to_py};
use kvcc_runtime::cuda::{DeviceAppend, StepIo};

/// The data of a contiguous f32 array (C order), or an error naming `what`.
fn slice<'a>(array: &'a PyReadonlyArrayDyn<'_, f32>, what: &str) -> PyResult<&'a [f32]> {
    array
        .as_slice()
        .map_err(|_| kvcc_error(format!("{what} must be a C-contiguous float32 array")))
}

/// An attention call's result: outputs (flat) and each row's log-sum-exp.
type OutLse<'py> = (Bound<'py, PyArray1<f32>>, Bound<'py, PyArray1<f32>>);

/// A compiled format.
#[pyclass(module = "kvcc._kvcc", frozen)]
struct Format {
    inner: CoreFormat,
}

#[pymethods]
impl Format {
    /// A spec file, or a bundled spec by name (`dense_f16`, `spherical`, ...),
    /// as `kvcc tune --spec` resolves it.
    #[staticmethod]
    fn load(name: &str) -> PyResult<Format> {
        kvcc_runtime::cli::tune::load_spec(name)
            .map(|inner| Format { inner })
            .map_err(|e| errors::spec_error(e.to_string()))
    }

    /// Spec text; `file` names it in error messages.
    #[staticmethod]
    #[pyo3(signature = (source, file = "<string>"))]
    fn parse(source: &str, file: &str) -> PyResult<Format> {
        CoreFormat::parse(source, file)
            .map(|inner| Format { inner })
            .map_err(|e| errors::spec_error(e.to_string()))
    }

    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    #[getter]
    fn head_dim(&self) -> usize {
        self.inner.head_dim() as usize
    }

    /// Tier names, in index order.
    #[getter]
    fn tiers(&self) -> Vec<String> {
        (0..self.inner.tiers().len())
            .map(|t| self.inner.layout(t).name.clone())
            .collect()
    }

    /// Index of the tier named `name`.
    fn tier_index(&self, name: &str) -> PyResult<usize> {
        self.inner.tier_index(name).ok_or_else(|| {
            kvcc_error(format!(
                "format {} has no tier `{name}`; its tiers: {}",
                self.inner.name(),
                self.tiers().join(", ")
            ))
        })
    }

    /// Tokens per page of tier `tier`.
    fn items_per_page(&self, tier: usize) -> PyResult<usize> {
        self.check_tier(tier)?;
        Ok(self.inner.layout(tier).items_per_page as usize)
    }

    /// Bytes of one page of tier `tier` (header, key and value streams, padding).
    fn page_bytes(&self, tier: usize) -> PyResult<usize> {
        self.check_tier(tier)?;
        Ok(self.inner.layout(tier).page_bytes as usize)
    }

    /// Bytes per token per kv head of a `context`-token sequence under the
    /// spec's `[cache]` policy with tier `tier` (tables amortized over it);
    /// `sinks`, `window` and `exact` replace the policy's where given.
    #[pyo3(signature = (tier, context, sinks = None, window = None, exact = None))]
    fn bytes_per_token(
        &self,
        tier: usize,
        context: usize,
        sinks: Option<usize>,
        window: Option<usize>,
        exact: Option<&str>,
    ) -> PyResult<f64> {
        self.check_tier(tier)?;
        let spec = CachePolicy::of(&self.inner);
        let policy = CachePolicy {
            tier,
            exact: exact.map(parse_exact).transpose()?.unwrap_or(spec.exact),
            ..spec.with_overrides(sinks, window)
        };
        Ok(policy.bytes_per_token(self.inner.layout(tier), context))
    }

    /// The spec's `[cache.budget]`: `(bytes_per_token, drop, score, protect,
    /// refresh, observe)`, or `None`.
    fn budget(&self) -> Option<(f64, bool, &'static str, f64, usize, usize)> {
        let b = CachePolicy::of(&self.inner).budget?;
        Some((
            b.bytes_per_token,
            b.drop,
            b.score.name(),
            b.protect,
            b.refresh,
            b.observe,
        ))
    }

    /// The spec's `[cache]` policy: `(sinks, window, exact dtype, tier)`.
    fn policy(&self) -> (usize, usize, &'static str, usize) {
        let p = CachePolicy::of(&self.inner);
        (p.sinks, p.window, p.exact.name(), p.tier)
    }

    /// Fits every tier's tables to `[kv_head][token][head_dim]` keys and values.
    #[pyo3(signature = (keys, values, kv_heads, seed = None))]
    fn train(
        &self,
        py: Python<'_>,
        keys: PyReadonlyArrayDyn<'_, f32>,
        values: PyReadonlyArrayDyn<'_, f32>,
        kv_heads: usize,
        seed: Option<u64>,
    ) -> PyResult<Tables> {
        let (k, v) = (slice(&keys, "keys")?, slice(&values, "values")?);
        let mut options = TrainOptions::default();
        if let Some(seed) = seed {
            options.seed = seed;
        }
        let format = &self.inner;
        let tables = py
            .detach(|| cache::train(format, k, v, kv_heads, &options))
            .map_err(to_py)?;
        Ok(Tables { inner: tables })
    }

    fn __repr__(&self) -> String {
        format!(
            "Format(name={:?}, head_dim={}, tiers={:?})",
            self.inner.name(),
            self.inner.head_dim(),
            self.tiers()
        )
    }
}

impl Format {
    fn check_tier(&self, tier: usize) -> PyResult<()> {
        let tiers = self.inner.tiers().len();
        if tier >= tiers {
            return Err(to_py(kvcc_runtime::encode::EncodeError::UnknownTier {
                tier,
                tiers,
            }));
        }
        Ok(())
    }
}

/// Trained tables of every tier and kv head: `[tier][kv_head][table]`.
#[pyclass(module = "kvcc._kvcc", frozen)]
#[derive(Clone)]
struct Tables {
    inner: CoreTables,
}

#[pymethods]
impl Tables {
    #[getter]
    fn tiers(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn kv_heads(&self) -> usize {
        self.inner.first().map_or(0, Vec::len)
    }

    /// The tables of tier `tier` and kv head `kv_head` as float32 arrays.
    fn arrays<'py>(
        &self,
        py: Python<'py>,
        tier: usize,
        kv_head: usize,
    ) -> PyResult<Vec<Bound<'py, PyArray1<f32>>>> {
        let head = self
            .inner
            .get(tier)
            .and_then(|t| t.get(kv_head))
            .ok_or_else(|| {
                kvcc_error(format!(
                    "no tables for tier {tier}, kv head {kv_head} ({} tiers, {} kv heads)",
                    self.tiers(),
                    self.kv_heads()
                ))
            })?;
        Ok(head.iter().map(|t| PyArray1::from_slice(py, t)).collect())
    }

    fn __repr__(&self) -> String {
        format!(
            "Tables(tiers={}, kv_heads={})",
            self.tiers(),
            self.kv_heads()
        )
    }
}

/// A paged cache whose every token is compressed, partial last pages
/// included: what one-shot fidelity measurements attend through.
#[pyclass(module = "kvcc._kvcc")]
struct Pages {
    inner: PagedCache,
    tier: usize,
    executor: ExecutorKind,
}

#[pymethods]
impl Pages {
    #[new]
    #[pyo3(signature = (format, tables, tier, executor = "jit"))]
    fn new(format: &Format, tables: &Tables, tier: usize, executor: &str) -> PyResult<Pages> {
        format.check_tier(tier)?;
        let executor = parse_executor(executor)?;
        let kv_heads = tables.kv_heads();
        let inner =
            PagedCache::new(&format.inner, kv_heads, tables.inner.clone()).map_err(to_py)?;
        Ok(Pages {
            inner,
            tier,
            executor,
        })
    }

    /// Adds one sequence, `[kv_head][token][head_dim]` keys and values, every
    /// page in this cache's tier; returns its index.
    fn append(
        &mut self,
        py: Python<'_>,
        keys: PyReadonlyArrayDyn<'_, f32>,
        values: PyReadonlyArrayDyn<'_, f32>,
    ) -> PyResult<usize> {
        let (k, v) = (slice(&keys, "keys")?, slice(&values, "values")?);
        let (inner, tier) = (&mut self.inner, self.tier);
        py.detach(|| inner.append_sequence(k, v, |_| tier))
            .map_err(to_py)
    }

    #[getter]
    fn sequences(&self) -> usize {
        self.inner.sequences()
    }

    /// Bytes of the pages written.
    #[getter]
    fn page_bytes(&self) -> usize {
        self.inner.page_bytes()
    }

    /// Decode attention: `[sequence][q_head][head_dim]` queries, every
    /// sequence; returns the outputs (same shape, flat) and each row's
    /// log-sum-exp of its scaled logits.
    fn attend<'py>(
        &self,
        py: Python<'py>,
        queries: PyReadonlyArrayDyn<'_, f32>,
        q_heads: usize,
    ) -> PyResult<OutLse<'py>> {
        let q = slice(&queries, "queries")?;
        let (inner, kind) = (&self.inner, self.executor);
        let decoded = py
            .detach(|| {
                let executor = kind.executor()?;
                executor.execute(Request {
                    cache: inner,
                    queries: q,
                    q_heads,
                    logits: true,
                    rows: None,
                })
            })
            .map_err(to_py)?;
        let lse: Vec<f32> = decoded.logits.iter().map(|l| log_sum_exp(l)).collect();
        Ok((
            PyArray1::from_vec(py, decoded.outputs),
            PyArray1::from_vec(py, lse),
        ))
    }
}

/// `ln Σ exp(x)` in f64; `-inf` for no values.
fn log_sum_exp(values: &[f32]) -> f32 {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return f32::NEG_INFINITY;
    }
    let sum: f64 = values.iter().map(|&x| f64::from(x - max).exp()).sum();
    (f64::from(max) + sum.ln()) as f32
}

fn parse_executor(name: &str) -> PyResult<ExecutorKind> {
    name.parse().map_err(kvcc_error)
}

fn parse_exact(name: &str) -> PyResult<ExactDtype> {
    match name {
        "f16" => Ok(ExactDtype::F16),
        "bf16" => Ok(ExactDtype::Bf16),
        other => Err(kvcc_error(format!(
            "exact rows are stored as f16 or bf16, not `{other}`"
        ))),
    }
}

/// The live cache of one layer, on the device it was opened for. The mutex
/// makes any `Send` backend shareable (Python objects may be used from
/// several threads); calls do not contend in practice.
#[pyclass(module = "kvcc._kvcc")]
struct Live {
    inner: Mutex<Backend>,
}

/// A panic inside a call cannot leave the cache half changed (calls check
/// before they change anything), so a poisoned lock is still usable.
fn lock(backend: &Mutex<Backend>) -> MutexGuard<'_, Backend> {
    backend.lock().unwrap_or_else(|e| e.into_inner())
}

impl Live {
    fn lock(&self) -> MutexGuard<'_, Backend> {
        lock(&self.inner)
    }
}

#[pymethods]
impl Live {
    /// Opens a live cache: `policy` is `(sinks, window, exact, tier)`,
    /// `pages_per_tier` the page slots of every tier's pool, `device`
    /// `"cpu"` or `"cuda:N"`; on CUDA, `batch` sequences at most and kernels
    /// first loaded for `q_heads` query heads.
    #[new]
    #[pyo3(signature = (format, tables, kv_heads, pages_per_tier, policy, device = "cpu", executor = "jit", batch = 1, q_heads = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        format: &Format,
        tables: &Tables,
        kv_heads: usize,
        pages_per_tier: usize,
        policy: (usize, usize, String, usize),
        device: &str,
        executor: &str,
        batch: usize,
        q_heads: Option<usize>,
    ) -> PyResult<Live> {
        let (sinks, window, exact, tier) = policy;
        let options = LiveOptions {
            policy: CachePolicy {
                sinks,
                window,
                exact: parse_exact(&exact)?,
                tier,
                // The spec's `[cache.select]`, as every other backend reads it.
                select: CachePolicy::of(&format.inner).select,
                budget: CachePolicy::of(&format.inner).budget,
            },
            kv_heads,
            pages_per_tier,
            executor: parse_executor(executor)?,
        };
        let device = Device::parse(device)?;
        let q_heads = q_heads.unwrap_or(kv_heads);
        let inner = device::open(
            device,
            &format.inner,
            &options,
            tables.inner.clone(),
            batch,
            q_heads,
        )?;
        Ok(Live {
            inner: Mutex::new(inner),
        })
    }

    #[getter]
    fn kv_heads(&self) -> usize {
        self.lock().live().kv_heads()
    }

    /// `(sinks, window, exact, tier)` in force.
    #[getter]
    fn policy(&self) -> (usize, usize, &'static str, usize) {
        let live = self.lock();
        let p = live.live().policy();
        (p.sinks, p.window, p.exact.name(), p.tier)
    }

    /// Tokens of every sequence.
    fn lengths(&self) -> Vec<usize> {
        self.lock().live().lengths()
    }

    /// Adds sequences: per sequence `[kv_head][token][head_dim]` keys and
    /// values, and for a `[cache.budget]` the `[q_head][row][head_dim]`
    /// queries of its last tokens (unit-scaled) with their query heads.
    /// Returns their indices.
    #[pyo3(signature = (sequences, queries = None))]
    fn prefill(
        &self,
        py: Python<'_>,
        sequences: Vec<(PyReadonlyArrayDyn<'_, f32>, PyReadonlyArrayDyn<'_, f32>)>,
        queries: Option<Vec<(PyReadonlyArrayDyn<'_, f32>, usize)>>,
    ) -> PyResult<Vec<usize>> {
        if let Some(q) = &queries {
            if q.len() != sequences.len() {
                return Err(kvcc_error(format!(
                    "{} sequences but queries for {}",
                    sequences.len(),
                    q.len()
                )));
            }
        }
        let mut kv = Vec::with_capacity(sequences.len());
        for (i, (k, v)) in sequences.iter().enumerate() {
            let queries = match &queries {
                Some(q) => Queries {
                    data: slice(&q[i].0, "queries")?,
                    q_heads: q[i].1,
                },
                None => Queries::default(),
            };
            kv.push(SequenceKv {
                keys: slice(k, "keys")?,
                values: slice(v, "values")?,
                queries,
            });
        }
        let inner = &self.inner;
        py.detach(|| lock(inner).live_mut().prefill(&kv))
            .map_err(to_py)
    }

    /// Adds tokens: `(sequence, keys, values)` with `[kv_head][token][head_dim]` blocks.
    fn append(
        &self,
        py: Python<'_>,
        batch: Vec<(
            usize,
            PyReadonlyArrayDyn<'_, f32>,
            PyReadonlyArrayDyn<'_, f32>,
        )>,
    ) -> PyResult<()> {
        let mut appends = Vec::with_capacity(batch.len());
        for (sequence, k, v) in &batch {
            appends.push(Append {
                sequence: *sequence,
                keys: slice(k, "keys")?,
                values: slice(v, "values")?,
            });
        }
        let inner = &self.inner;
        py.detach(|| lock(inner).live_mut().append(&appends))
            .map_err(to_py)
    }

    /// One decode step over every sequence: `[sequence][q_head][head_dim]`
    /// queries; returns the outputs (flat, same order) and each row's
    /// log-sum-exp.
    fn attend<'py>(
        &self,
        py: Python<'py>,
        queries: PyReadonlyArrayDyn<'_, f32>,
        q_heads: usize,
    ) -> PyResult<OutLse<'py>> {
        if queries.ndim() == 0 {
            return Err(kvcc_error("queries must be an array"));
        }
        let q = slice(&queries, "queries")?;
        let inner = &self.inner;
        let attention = py
            .detach(|| lock(inner).live().attend(q, q_heads))
            .map_err(to_py)?;
        Ok((
            PyArray1::from_vec(py, attention.outputs),
            PyArray1::from_vec(py, attention.lse),
        ))
    }

    /// Records one decode step's `[sequence][q_head][head_dim]` queries
    /// (unit-scaled) for a `[cache.budget]`'s next allocation.
    fn observe(
        &self,
        py: Python<'_>,
        queries: PyReadonlyArrayDyn<'_, f32>,
        q_heads: usize,
    ) -> PyResult<()> {
        let q = slice(&queries, "queries")?;
        let inner = &self.inner;
        py.detach(|| lock(inner).live_mut().observe(q, q_heads))
            .map_err(to_py)
    }

    /// Drops sequence `sequence`; later sequences move down by one. On CUDA,
    /// ordered against `stream` (torch's current stream).
    #[pyo3(signature = (sequence, stream = 0))]
    fn release(&self, sequence: usize, stream: usize) -> PyResult<()> {
        let mut backend = self.lock();
        match &mut *backend {
            Backend::Cuda(live) => device::on_stream(live, stream, |live| live.release(sequence)),
            Backend::Host(live) => live.release(sequence).map_err(to_py),
        }
    }

    /// The tier pages compressed from now on go to.
    fn set_tier(&self, tier: usize) -> PyResult<()> {
        self.lock().live_mut().set_tier(tier).map_err(to_py)
    }

    /// Whether the cache lives on a CUDA device.
    #[getter]
    fn on_cuda(&self) -> bool {
        matches!(&*self.lock(), Backend::Cuda(_))
    }

    /// Bumped by every change of the page lists (CUDA caches; 0 on the CPU).
    #[getter]
    fn generation(&self) -> u64 {
        match &*self.lock() {
            Backend::Cuda(live) => live.generation(),
            Backend::Host(_) => 0,
        }
    }

    /// Adds sequences from device memory: `keys`/`values` are data pointers
    /// of `len` elements of `dtype` each, `[sequence][kv_head][token][head_dim]`
    /// with `tokens[i]` tokens for new sequence `i`. Ordered on `stream`.
    #[allow(clippy::too_many_arguments)]
    fn prefill_device(
        &self,
        py: Python<'_>,
        keys: u64,
        values: u64,
        len: usize,
        dtype: &str,
        tokens: Vec<usize>,
        stream: usize,
    ) -> PyResult<Vec<usize>> {
        let rows = DeviceRows {
            keys,
            values,
            len,
            dtype: device::row_dtype(dtype)?,
        };
        let inner = &self.inner;
        py.detach(|| device::prefill(lock(inner).cuda()?, stream, rows, &tokens))
    }

    /// Adds tokens from device memory: `tokens[i]` tokens to `sequences[i]`,
    /// rows laid out as for `prefill_device`.
    #[allow(clippy::too_many_arguments)]
    fn append_device(
        &self,
        py: Python<'_>,
        sequences: Vec<usize>,
        tokens: Vec<usize>,
        keys: u64,
        values: u64,
        len: usize,
        dtype: &str,
        stream: usize,
    ) -> PyResult<()> {
        if sequences.len() != tokens.len() {
            return Err(kvcc_error(format!(
                "{} sequences but {} token counts",
                sequences.len(),
                tokens.len()
            )));
        }
        let rows = DeviceRows {
            keys,
            values,
            len,
            dtype: device::row_dtype(dtype)?,
        };
        let batch: Vec<DeviceAppend> = (sequences.iter().zip(&tokens))
            .map(|(&sequence, &tokens)| DeviceAppend { sequence, tokens })
            .collect();
        let inner = &self.inner;
        py.detach(|| device::append(lock(inner).cuda()?, stream, rows, &batch))
    }

    /// One decode step on device memory: f32 `[sequence][q_head][head_dim]`
    /// queries at `queries`, outputs written to `out` (same shape) and
    /// `[sequence][q_head]` log-sum-exps to `lse`. Allocates nothing and
    /// waits for nothing, so it can be captured in a CUDA graph on `stream`.
    fn attend_device(
        &self,
        py: Python<'_>,
        queries: u64,
        q_heads: usize,
        out: u64,
        lse: u64,
        stream: usize,
    ) -> PyResult<()> {
        let io = StepIo {
            queries,
            output: out,
            lse,
        };
        let inner = &self.inner;
        py.detach(|| device::attend(lock(inner).cuda()?, stream, io, q_heads))
    }
}

/// Where `tokens` tokens of one sequence are under a policy of `sinks` and
/// `window` with `items`-token pages: `(sinks, pages, tail)`, the runtime's
/// own split (what paged-cache glue must agree with).
#[pyfunction]
fn policy_split(
    sinks: usize,
    window: usize,
    tokens: usize,
    items: usize,
) -> PyResult<(usize, usize, usize)> {
    if items == 0 {
        return Err(kvcc_error("a page holds at least one token"));
    }
    let policy = CachePolicy {
        sinks,
        window,
        ..CachePolicy::compress_all(0)
    };
    let split = policy.split(tokens, items);
    Ok((split.sinks, split.pages, split.tail))
}

/// `(file name, TOML source)` of every bundled spec.
#[pyfunction]
fn bundled_specs() -> Vec<(&'static str, &'static str)> {
    kvcc_runtime::builtin::SPECS.to_vec()
}

#[pymodule]
fn _kvcc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Format>()?;
    m.add_class::<Tables>()?;
    m.add_class::<Pages>()?;
    m.add_class::<Live>()?;
    m.add_function(wrap_pyfunction!(bundled_specs, m)?)?;
    m.add_function(wrap_pyfunction!(policy_split, m)?)?;
    m.add_function(wrap_pyfunction!(device::check_device, m)?)?;
    errors::register(m)?;
    Ok(())
}
