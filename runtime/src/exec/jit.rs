//! The Cranelift JIT as an executor: each tier's programs compiled to native
//! code (`kvcc_compiler::back::clif`), run in parallel across (sequence,
//! kv head).
//!
//! The skeleton is the interpreter's, step for step: per query head, the
//! sequence's pages in page-table order, one online-softmax partial per tier
//! (the interpreter's own `Softmax::push`), each tier's epilogue on its
//! partial, then the interpreter's log-sum-exp `merge`. The kernels serve the
//! query heads of a GQA group together, so a page is read from memory once per
//! group and its items are decoded once for all of the group's heads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use kvcc_compiler::back::clif::{self, Kernels, PageEncoder, Tables};
use kvcc_compiler::back::interp::{merge, Interpreter, Options, Softmax};
use kvcc_compiler::page::CacheView;
use kvcc_compiler::Format;

use super::{Decoded, ExecError, Executor, Request};
use crate::cache::PagedCache;

#[derive(Debug, Clone, Default)]
pub struct JitExecutor {
    /// Code generation options; `heads` is the most query heads one kernel
    /// call serves (a group is covered in chunks of it).
    pub options: clif::Options,
}

/// (spec, tier, options): the spec as its `Debug` text, so two specs share
/// kernels only if they are the same spec.
type Key = (String, usize, clif::Options);

/// Kernels compiled in this process.
fn compiled() -> &'static Mutex<HashMap<Key, Arc<Kernels>>> {
    static KERNELS: OnceLock<Mutex<HashMap<Key, Arc<Kernels>>>> = OnceLock::new();
    KERNELS.get_or_init(Default::default)
}

/// Tier `tier`'s kernels for `options`, compiled on first use.
fn kernels(
    format: &Format,
    spec: &str,
    tier: usize,
    options: &clif::Options,
) -> Result<Arc<Kernels>, ExecError> {
    let key = (spec.to_string(), tier, options.clone());
    if let Some(k) = compiled().lock().expect("kernel cache lock").get(&key) {
        return Ok(k.clone());
    }
    // Compiled outside the lock: other formats need not wait. A race compiles
    // twice and keeps one.
    let k = Arc::new(clif::compile(&format.tiers()[tier], options).map_err(|e| {
        ExecError::Backend {
            executor: "jit",
            format: e.format,
            tier: e.tier,
            message: e.kind.to_string(),
        }
    })?);
    Ok(compiled()
        .lock()
        .expect("kernel cache lock")
        .entry(key)
        .or_insert(k)
        .clone())
}

/// (spec, tier) -> page encoder, keyed as kernels are.
type Encoders = Mutex<HashMap<(String, usize), Arc<PageEncoder>>>;

/// Page encoders compiled in this process.
fn compiled_encoders() -> &'static Encoders {
    static ENCODERS: OnceLock<Encoders> = OnceLock::new();
    ENCODERS.get_or_init(Default::default)
}

/// Tier `tier`'s page encoder (`clif::compile_encoder`), compiled on first
/// use in this process.
pub fn page_encoder(format: &Format, tier: usize) -> Result<Arc<PageEncoder>, ExecError> {
    let key = (format!("{:?}", format.spec()), tier);
    if let Some(e) = compiled_encoders()
        .lock()
        .expect("encoder cache lock")
        .get(&key)
    {
        return Ok(e.clone());
    }
    // Compiled outside the lock, as kernels are.
    let encoder = clif::compile_encoder(format.name(), format.layout(tier), &[]).map_err(|e| {
        ExecError::Backend {
            executor: "jit",
            format: e.format,
            tier: e.tier,
            message: e.kind.to_string(),
        }
    })?;
    Ok(compiled_encoders()
        .lock()
        .expect("encoder cache lock")
        .entry(key)
        .or_insert(Arc::new(encoder))
        .clone())
}

/// The kernels of every tier for calls of `heads` query heads.
fn tier_kernels(
    format: &Format,
    spec: &str,
    options: &clif::Options,
    heads: usize,
) -> Result<Vec<Arc<Kernels>>, ExecError> {
    let options = clif::Options {
        heads: heads as u32,
        ..options.clone()
    };
    (0..format.tiers().len())
        .map(|t| kernels(format, spec, t, &options))
        .collect()
}

impl Executor for JitExecutor {
    fn name(&self) -> &'static str {
        "jit"
    }

    fn execute(&self, r: Request<'_>) -> Result<Decoded, ExecError> {
        self.run(r.cache, &r.view(), (r.queries, r.q_heads), r.logits)
    }
}

impl JitExecutor {
    fn run(
        &self,
        cache: &PagedCache,
        view: &CacheView,
        (queries, q_heads): (&[f32], usize),
        logits: bool,
    ) -> Result<Decoded, ExecError> {
        let format = cache.format();
        let interp = Interpreter::new(format.tiers(), Options::default());
        interp.check_cache(view)?;
        interp.check_queries(queries, view.page_tables.len(), q_heads, view.kv_heads)?;
        let group = q_heads / view.kv_heads;
        let chunk = group.min(self.options.heads.clamp(1, clif::MAX_HEADS) as usize);
        let spec = format!("{:?}", format.spec());
        let full = tier_kernels(format, &spec, &self.options, chunk)?;
        let rest = match group % chunk {
            0 => None,
            r => Some(tier_kernels(format, &spec, &self.options, r)?),
        };
        // A group's heads in calls of `chunk`, the last call taking what is left.
        let calls: Vec<&[Arc<Kernels>]> = std::iter::repeat_n(full.as_slice(), group / chunk)
            .chain(rest.as_deref())
            .collect();
        let job = Job {
            view,
            queries,
            q_heads,
            group,
            head_dim: format.head_dim() as usize,
            scale: interp.softmax_scale(),
            calls: &calls,
            logits,
        };
        let tasks = view.page_tables.len() * view.kv_heads;
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(tasks);
        let next = AtomicUsize::new(0);
        let work = || {
            let mut done = Vec::new();
            loop {
                let task = next.fetch_add(1, Ordering::Relaxed);
                if task >= tasks {
                    return done;
                }
                done.push((task, job.attend(task / view.kv_heads, task % view.kv_heads)));
            }
        };
        let mut results: Vec<(usize, Group)> = if threads <= 1 {
            work()
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..threads).map(|_| s.spawn(work)).collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().expect("decode worker"))
                    .collect()
            })
        };
        // Task (sequence, kv head) holds rows sequence·q_heads + kv_head·group..+group.
        results.sort_by_key(|r| r.0);
        let mut decoded = Decoded {
            outputs: Vec::with_capacity(queries.len()),
            logits: Vec::new(),
        };
        for (_, group) in results {
            decoded.outputs.extend(group.outputs);
            decoded.logits.extend(group.logits);
        }
        Ok(decoded)
    }
}

/// What one (sequence, kv head) task produces: its group's output rows and,
/// when asked for, their logits.
struct Group {
    outputs: Vec<f32>,
    logits: Vec<Vec<f32>>,
}

/// One decode call, shared by the workers.
struct Job<'a> {
    view: &'a CacheView<'a>,
    queries: &'a [f32],
    q_heads: usize,
    group: usize,
    head_dim: usize,
    scale: f32,
    /// Per kernel call over a group: the tiers' kernels.
    calls: &'a [&'a [Arc<Kernels>]],
    /// Whether to keep every row's logits.
    logits: bool,
}

/// One tier's state for the heads of one call.
struct Partials {
    /// `heads × arrays_len`: each head's shared arrays.
    arrays: Vec<f32>,
    logits: Vec<f32>,
    weights: Vec<f32>,
    decays: Vec<f32>,
    acc: Vec<f32>,
    softmax: Vec<Softmax>,
}

impl Job<'_> {
    /// The output rows (and logits) of the group of `kv_head` in `sequence`.
    fn attend(&self, sequence: usize, kv_head: usize) -> Group {
        let d = self.head_dim;
        let tiers = self.view.tiers.len();
        let first_head = sequence * self.q_heads + kv_head * self.group;
        let tables: Vec<Tables> = (0..tiers)
            .map(|t| self.calls[0][t].tables(&self.view.tiers[t].tables[kv_head]))
            .collect();
        // [call][tier], created when the tier's first page comes (as the
        // interpreter runs a prologue only for tiers the sequence uses).
        let mut state: Vec<Vec<Option<Partials>>> = self
            .calls
            .iter()
            .map(|_| (0..tiers).map(|_| None).collect())
            .collect();
        let mut logits = vec![Vec::new(); if self.logits { self.group } else { 0 }];
        for page_ref in &self.view.page_tables[sequence][kv_head] {
            let t = page_ref.tier as usize;
            let mut head = first_head;
            for (call, kernels) in self.calls.iter().enumerate() {
                let k = &kernels[t];
                let shape = k.shape();
                let heads = shape.heads;
                let p = state[call][t].get_or_insert_with(|| {
                    let mut arrays = vec![0.0; heads * shape.arrays_len];
                    for (h, block) in arrays.chunks_mut(shape.arrays_len).enumerate() {
                        let q = (head + h) * d;
                        block[shape.query()].copy_from_slice(&self.queries[q..q + d]);
                        k.prologue(&tables[t], block);
                    }
                    Partials {
                        arrays,
                        logits: vec![0.0; heads * shape.items_stride],
                        weights: vec![0.0; heads * shape.items_stride],
                        decays: vec![0.0; heads * shape.items_stride],
                        acc: vec![0.0; heads * shape.dims_stride],
                        softmax: vec![Softmax::default(); heads],
                    }
                });
                let start = page_ref.page as usize * shape.page_bytes;
                let page = &self.view.tiers[t].pool[start..start + shape.page_bytes];
                let count = k.score(page, &tables[t], &p.arrays, &mut p.logits);
                for (h, softmax) in p.softmax.iter_mut().enumerate() {
                    let at = h * shape.items_stride;
                    for i in at..at + count {
                        let logit = p.logits[i] * self.scale;
                        let (decay, weight) = softmax.push(logit);
                        p.decays[i] = decay;
                        p.weights[i] = weight;
                        if self.logits {
                            logits[head - first_head + h].push(logit);
                        }
                    }
                }
                k.accumulate(page, &tables[t], &p.weights, &p.decays, &mut p.acc);
                head += heads;
            }
        }
        // Per head: each tier's epilogue, then the merge, in tier order.
        let mut out = Vec::with_capacity(self.group * d);
        for (call, kernels) in self.calls.iter().enumerate() {
            for h in 0..kernels[0].shape().heads {
                let finished: Vec<(Softmax, Vec<f32>)> = state[call]
                    .iter_mut()
                    .enumerate()
                    .filter_map(|(t, p)| p.as_mut().map(|p| (t, p)))
                    .filter(|(_, p)| p.softmax[h].sum > 0.0)
                    .map(|(t, p)| {
                        let shape = kernels[t].shape();
                        let arrays =
                            &mut p.arrays[h * shape.arrays_len..(h + 1) * shape.arrays_len];
                        let acc = h * shape.dims_stride;
                        arrays[shape.accumulator()].copy_from_slice(&p.acc[acc..acc + shape.dims]);
                        kernels[t].epilogue(&tables[t], arrays, p.softmax[h].sum);
                        (p.softmax[h], arrays[shape.output()].to_vec())
                    })
                    .collect();
                out.extend(merge(&finished, d));
            }
        }
        Group {
            outputs: out,
            logits,
        }
    }
}
