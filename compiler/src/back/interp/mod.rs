//! The reference interpreter: decode attention straight from packed pages by
//! evaluating each tier's IR. It defines what a format means; every other
//! backend is tested against it.
//!
//! Per (sequence, kv head, query head): run each tier's key prologue on the query;
//! stream the sequence's pages in page-table order with an online softmax, one
//! partial (m, l, acc) per tier; run each tier's value epilogue on its partial;
//! merge the partials with a log-sum-exp merge.

pub mod encode;
pub mod select;
// The Cranelift backend folds constants with these same functions.
pub(crate) mod eval;

use eval::{run_function, run_stage, Env, Value};

use crate::page::{CacheView, PageHeader, PageRef};
use crate::valid::ValidModule;

/// The interpreter has no tuning knobs; the struct keeps backends uniform.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Softmax scale; `None` means 1/sqrt(head_dim).
    pub softmax_scale: Option<f32>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DecodeError {
    #[error("queries hold {found} values; expected sequences {sequences} x query heads {q_heads} x head_dim {head_dim}")]
    QueryShape {
        found: usize,
        sequences: usize,
        q_heads: usize,
        head_dim: usize,
    },
    #[error("{q_heads} query heads is not a positive multiple of {kv_heads} kv heads")]
    Grouping { q_heads: usize, kv_heads: usize },
    #[error("sequence {sequence}: page table has {found} kv heads, the cache {kv_heads}")]
    KvHeads {
        sequence: usize,
        found: usize,
        kv_heads: usize,
    },
    #[error("the cache has {found} tiers, the format {expected}")]
    Tiers { found: usize, expected: usize },
    #[error("tier {tier}: tables for {found} kv heads, the cache has {kv_heads}")]
    TableHeads {
        tier: usize,
        found: usize,
        kv_heads: usize,
    },
    #[error("tier {tier}, kv head {kv_head}: {found} tables, the layout has {expected}")]
    TableCount {
        tier: usize,
        kv_head: usize,
        found: usize,
        expected: usize,
    },
    #[error("sequence {sequence}, kv head {kv_head} is outside the cache ({sequences} sequences, {kv_heads} kv heads)")]
    Row {
        sequence: usize,
        kv_head: usize,
        sequences: usize,
        kv_heads: usize,
    },
    #[error(
        "tier {tier}, kv head {kv_head}: table {table} has {found} values, the layout {expected}"
    )]
    TableLength {
        tier: usize,
        kv_head: usize,
        table: usize,
        found: usize,
        expected: u32,
    },
    #[error("sequence {sequence}, kv head {kv_head}, entry {entry}: {problem}")]
    PageTable {
        sequence: usize,
        kv_head: usize,
        entry: usize,
        problem: String,
    },
    #[error(
        "query contains a non-finite value at sequence {sequence}, head {head}, channel {channel}"
    )]
    NonFiniteQuery {
        sequence: usize,
        head: usize,
        channel: usize,
    },
}

/// Result of one query row: the attention output and the logits of every
/// token in page-table order (already multiplied by the softmax scale).
#[derive(Debug, Clone, PartialEq)]
pub struct Attended {
    pub output: Vec<f32>,
    pub logits: Vec<f32>,
}

pub struct Interpreter<'m> {
    tiers: &'m [ValidModule],
    head_dim: usize,
    scale: f32,
}

/// Online-softmax state of one partial: the running max and denominator.
/// Executors share it so every backend rescales in exactly the same order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Softmax {
    pub max: f32,
    pub sum: f32,
}

impl Default for Softmax {
    fn default() -> Self {
        Softmax {
            max: f32::NEG_INFINITY,
            sum: 0.0,
        }
    }
}

impl Softmax {
    /// Folds in one logit and returns `(decay, weight)`: the partial's
    /// accumulator becomes `acc * decay + weight * v` (two products and a sum,
    /// not fused).
    pub fn push(&mut self, logit: f32) -> (f32, f32) {
        let max = self.max.max(logit);
        // exp(0) is exactly 1; skipping it is worth it (most logits leave the
        // max where it is), and it is only 0 when the max is finite.
        let decay = if max == self.max && max.is_finite() {
            1.0
        } else {
            (self.max - max).exp()
        };
        let weight = (logit - max).exp();
        self.max = max;
        self.sum = self.sum * decay + weight;
        (decay, weight)
    }
}

/// The log-sum-exp merge of finished partials `(softmax, epilogue output)`,
/// in tier order, into one head_dim output.
pub fn merge(finished: &[(Softmax, Vec<f32>)], head_dim: usize) -> Vec<f32> {
    let mut merged = vec![0.0f32; head_dim];
    let global = finished
        .iter()
        .map(|f| f.0.max)
        .fold(f32::NEG_INFINITY, f32::max);
    let total: f32 = finished
        .iter()
        .map(|(s, _)| s.sum * (s.max - global).exp())
        .sum();
    for (s, out) in finished {
        let w = (s.max - global).exp() / total;
        for (o, x) in merged.iter_mut().zip(out) {
            *o += w * x;
        }
    }
    merged
}

/// Running softmax state of one tier.
struct Partial {
    softmax: Softmax,
    acc: Vec<f32>,
}

impl<'m> Interpreter<'m> {
    /// `tiers[t]` is tier t's module; all share one head_dim.
    pub fn new(tiers: &'m [ValidModule], options: Options) -> Interpreter<'m> {
        let head_dim = tiers.first().map_or(0, |m| m.module().head_dim as usize);
        Interpreter {
            tiers,
            head_dim,
            scale: options
                .softmax_scale
                .unwrap_or(1.0 / (head_dim as f32).sqrt()),
        }
    }

    /// The softmax scale logits are multiplied by.
    pub fn softmax_scale(&self) -> f32 {
        self.scale
    }

    /// Checks tables and every page reference against the format.
    pub fn check_cache(&self, cache: &CacheView) -> Result<(), DecodeError> {
        let kv_heads = cache.kv_heads;
        if cache.tiers.len() != self.tiers.len() {
            return Err(DecodeError::Tiers {
                found: cache.tiers.len(),
                expected: self.tiers.len(),
            });
        }
        for (tier, (view, module)) in cache.tiers.iter().zip(self.tiers).enumerate() {
            if view.tables.len() != kv_heads {
                return Err(DecodeError::TableHeads {
                    tier,
                    found: view.tables.len(),
                    kv_heads,
                });
            }
            let decls: Vec<_> = module.module().tables.iter().map(|(_, d)| d.len).collect();
            for (kv_head, tables) in view.tables.iter().enumerate() {
                if tables.len() != decls.len() {
                    return Err(DecodeError::TableCount {
                        tier,
                        kv_head,
                        found: tables.len(),
                        expected: decls.len(),
                    });
                }
                for (table, (values, &len)) in tables.iter().zip(&decls).enumerate() {
                    if values.len() != len as usize {
                        return Err(DecodeError::TableLength {
                            tier,
                            kv_head,
                            table,
                            found: values.len(),
                            expected: len,
                        });
                    }
                }
            }
        }
        for (sequence, heads) in cache.page_tables.iter().enumerate() {
            if heads.len() != kv_heads {
                return Err(DecodeError::KvHeads {
                    sequence,
                    found: heads.len(),
                    kv_heads,
                });
            }
            for (kv_head, refs) in heads.iter().enumerate() {
                for (entry, page_ref) in refs.iter().enumerate() {
                    self.check_page(cache, *page_ref).map_err(|problem| {
                        DecodeError::PageTable {
                            sequence,
                            kv_head,
                            entry,
                            problem,
                        }
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Checks a `[sequence][q_head][head_dim]` query block.
    pub fn check_queries(
        &self,
        queries: &[f32],
        sequences: usize,
        q_heads: usize,
        kv_heads: usize,
    ) -> Result<(), DecodeError> {
        if kv_heads == 0 || q_heads == 0 || !q_heads.is_multiple_of(kv_heads) {
            return Err(DecodeError::Grouping { q_heads, kv_heads });
        }
        if queries.len() != sequences * q_heads * self.head_dim {
            return Err(DecodeError::QueryShape {
                found: queries.len(),
                sequences,
                q_heads,
                head_dim: self.head_dim,
            });
        }
        if let Some(at) = queries.iter().position(|x| !x.is_finite()) {
            let row = at / self.head_dim;
            return Err(DecodeError::NonFiniteQuery {
                sequence: row / q_heads,
                head: row % q_heads,
                channel: at % self.head_dim,
            });
        }
        Ok(())
    }

    fn check_page(&self, cache: &CacheView, page_ref: PageRef) -> Result<(), String> {
        let tier = page_ref.tier as usize;
        let module = self
            .tiers
            .get(tier)
            .ok_or_else(|| format!("tier {tier} does not exist ({} tiers)", self.tiers.len()))?;
        let layout = &module.module().layout;
        let pages = cache.tiers[tier].pool.len() / layout.page_bytes as usize;
        if page_ref.page as usize >= pages {
            return Err(format!(
                "page {} is outside tier {tier}'s pool of {pages} pages",
                page_ref.page
            ));
        }
        let header = PageHeader::read(layout, page(cache, page_ref, layout.page_bytes))
            .ok_or("page shorter than its header")?;
        if header.tier != page_ref.tier {
            return Err(format!(
                "page {} of tier {tier} has a header for tier {}",
                page_ref.page, header.tier
            ));
        }
        if header.count > layout.items_per_page {
            return Err(format!(
                "page {} holds {} items, more than the {} a page has room for",
                page_ref.page, header.count, layout.items_per_page
            ));
        }
        if let Some(slot) = header.scales.iter().position(|s| !s.is_finite()) {
            return Err(format!(
                "page {} has a non-finite scale in slot {slot}",
                page_ref.page
            ));
        }
        Ok(())
    }

    /// Decode attention for every sequence and query head. `queries` and the
    /// result are `[sequence][q_head][head_dim]`.
    pub fn decode(
        &self,
        cache: &CacheView,
        queries: &[f32],
        q_heads: usize,
    ) -> Result<Vec<f32>, DecodeError> {
        self.check_cache(cache)?;
        self.check_queries(queries, cache.page_tables.len(), q_heads, cache.kv_heads)?;
        let group = q_heads / cache.kv_heads;
        let mut out = Vec::with_capacity(queries.len());
        for (sequence, rows) in queries.chunks(q_heads * self.head_dim).enumerate() {
            for (head, query) in rows.chunks(self.head_dim).enumerate() {
                out.extend(
                    self.attend_checked(cache, sequence, head / group, query)
                        .output,
                );
            }
        }
        Ok(out)
    }

    /// One query row against one (sequence, kv head), with its logits.
    pub fn attend(
        &self,
        cache: &CacheView,
        sequence: usize,
        kv_head: usize,
        query: &[f32],
    ) -> Result<Attended, DecodeError> {
        self.check_cache(cache)?;
        if sequence >= cache.page_tables.len() || kv_head >= cache.kv_heads {
            return Err(DecodeError::Row {
                sequence,
                kv_head,
                sequences: cache.page_tables.len(),
                kv_heads: cache.kv_heads,
            });
        }
        self.check_queries(query, 1, 1, 1)?;
        Ok(self.attend_checked(cache, sequence, kv_head, query))
    }

    fn attend_checked(
        &self,
        cache: &CacheView,
        sequence: usize,
        kv_head: usize,
        query: &[f32],
    ) -> Attended {
        let refs = &cache.page_tables[sequence][kv_head];
        let mut values: Vec<Value> = Vec::new();
        let mut arrays: Vec<Vec<Vec<f32>>> = vec![Vec::new(); self.tiers.len()];
        let mut partials: Vec<Option<Partial>> = (0..self.tiers.len()).map(|_| None).collect();
        let mut logits = Vec::new();
        for page_ref in refs {
            let t = page_ref.tier as usize;
            let module = self.tiers[t].module();
            let layout = &module.layout;
            let tables = &cache.tiers[t].tables[kv_head];
            if arrays[t].is_empty() {
                arrays[t] = module
                    .arrays
                    .iter()
                    .map(|(_, d)| vec![0.0; d.len as usize])
                    .collect();
                arrays[t][module.query.index()].copy_from_slice(query);
                run_kernel(
                    &module.key.prologue.stages,
                    tables,
                    &mut arrays[t],
                    0.0,
                    &mut values,
                );
            }
            let partial = partials[t].get_or_insert_with(|| Partial {
                softmax: Softmax::default(),
                acc: vec![0.0; module.value.dims as usize],
            });
            let bytes = page(cache, *page_ref, layout.page_bytes);
            let header = PageHeader::read(layout, bytes).expect("checked page");
            for item in 0..header.count as usize {
                let key = stream_item(bytes, layout.key_stream_offset, layout.key.stride, item);
                let value =
                    stream_item(bytes, layout.value_stream_offset, layout.value.stride, item);
                let env = Env {
                    item: key,
                    header_scales: &header.scales,
                    tables,
                    arrays: &arrays[t],
                    channel: 0,
                    iteration: 0,
                    denominator: 0.0,
                };
                let logit = run_function(&module.key.score, &env, &mut values) * self.scale;
                logits.push(logit);
                let (decay, weight) = partial.softmax.push(logit);
                for (channel, acc) in partial.acc.iter_mut().enumerate() {
                    let env = Env {
                        item: value,
                        channel: channel as u32,
                        ..env
                    };
                    let v = run_function(&module.value.accumulate, &env, &mut values);
                    *acc = *acc * decay + weight * v;
                }
            }
        }
        // Epilogue per tier, then the log-sum-exp merge of the partials.
        let finished: Vec<(Softmax, Vec<f32>)> = partials
            .into_iter()
            .enumerate()
            .filter_map(|(t, p)| p.map(|p| (t, p)))
            .filter(|(_, p)| p.softmax.sum > 0.0)
            .map(|(t, p)| {
                let module = self.tiers[t].module();
                let tables = &cache.tiers[t].tables[kv_head];
                arrays[t][module.value.accumulator.index()].copy_from_slice(&p.acc);
                run_kernel(
                    &module.value.epilogue.stages,
                    tables,
                    &mut arrays[t],
                    p.softmax.sum,
                    &mut values,
                );
                (p.softmax, arrays[t][module.value.output.index()].clone())
            })
            .collect();
        Attended {
            output: merge(&finished, self.head_dim),
            logits,
        }
    }
}

fn page<'a>(cache: &CacheView<'a>, page_ref: PageRef, page_bytes: u32) -> &'a [u8] {
    let start = page_ref.page as usize * page_bytes as usize;
    &cache.tiers[page_ref.tier as usize].pool[start..start + page_bytes as usize]
}

fn stream_item(page: &[u8], offset: u32, stride: u32, item: usize) -> &[u8] {
    let start = offset as usize + item * stride as usize;
    &page[start..start + stride as usize]
}

fn run_kernel(
    stages: &[crate::ir::Stage],
    tables: &[Vec<f32>],
    arrays: &mut [Vec<f32>],
    denominator: f32,
    values: &mut Vec<Value>,
) {
    for stage in stages {
        let env = Env {
            item: &[],
            header_scales: &[],
            tables,
            arrays,
            channel: 0,
            iteration: 0,
            denominator,
        };
        for (array, index, value) in run_stage(stage, &env, values) {
            arrays[array][index] = value;
        }
    }
}
