//! The CPU live cache: pages encoded into a [`PagedCache`] and attended by
//! the JIT or the interpreter; exact rows scored here. Under the JIT
//! executor pages are compressed by each tier's compiled encoder
//! (`exec::page_encoder`), otherwise by `encode_page`: the same bytes.

use std::sync::{Arc, OnceLock};

use kvcc_compiler::back::clif::PageEncoder;
use kvcc_compiler::back::interp::{merge, select, Interpreter, Options, Softmax};
use kvcc_compiler::page::PageRef;
use kvcc_compiler::spec::ExactDtype;
use kvcc_compiler::Format;

use super::exact::{round, ExactPartial, ExactRows};
use super::pool::PagePool;
use super::{Append, Attention, CachePolicy, LiveError, LiveKv, SequenceKv};
use crate::cache::{self, PagedCache, Tables};
use crate::encode::{encode_page, encode_page_compiled, EncodeError, TrainOptions};
use crate::exec::{page_encoder, Executor, ExecutorKind, Request};

/// How a [`LiveCache`] is shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveOptions {
    pub policy: CachePolicy,
    pub kv_heads: usize,
    /// Page slots of every tier's pool (each kv head's page takes one).
    pub pages_per_tier: usize,
    /// The executor that attends the compressed pages.
    pub executor: ExecutorKind,
}

/// One sequence's exact rows, per kv head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceState {
    pub tokens: usize,
    pub sinks: Vec<ExactRows>,
    pub tail: Vec<ExactRows>,
}

/// Everything a call may change, comparable: a call that fails must leave it
/// equal to what it was.
#[derive(Debug, Clone, PartialEq)]
pub struct LiveState {
    pub sequences: Vec<SequenceState>,
    pub page_tables: Vec<Vec<Vec<PageRef>>>,
    pub pools: Vec<Vec<u8>>,
    pub pool: PagePool,
    pub policy: CachePolicy,
    pub summaries: Vec<Vec<u16>>,
}

pub struct LiveCache {
    pages: PagedCache,
    sequences: Vec<SequenceState>,
    pool: PagePool,
    policy: CachePolicy,
    /// Opened once: every decode step reuses it (a GPU executor holds its
    /// context and modules).
    executor: Box<dyn Executor>,
    /// Under the JIT executor: each tier's compiled page encoder, fetched
    /// on the first page of that tier.
    encoders: Option<Vec<OnceLock<Arc<PageEncoder>>>>,
    /// `[tier]`: each page's selection summary (`select::summarize`) at
    /// `page * values`, where the policy selects.
    summaries: Vec<Vec<u16>>,
}

impl std::fmt::Debug for LiveCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveCache")
            .field("pages", &self.pages)
            .field("sequences", &self.sequences)
            .field("pool", &self.pool)
            .field("policy", &self.policy)
            .field("executor", &self.executor.name())
            .finish()
    }
}

/// One sequence's change, computed before anything is touched.
struct Planned {
    sequence: usize,
    tokens: usize,
    sinks: Vec<ExactRows>,
    tail: Vec<ExactRows>,
    /// Per page compressed: per kv head, the page's bytes.
    pages: Vec<Vec<Vec<u8>>>,
    /// Per page compressed: per kv head, its selection summary (none
    /// without a selection).
    summaries: Vec<Vec<Vec<u16>>>,
}

impl LiveCache {
    /// An empty cache with given `tables` (`[tier][kv_head][table]`).
    pub fn new(
        format: &Format,
        options: &LiveOptions,
        tables: Tables,
    ) -> Result<LiveCache, LiveError> {
        let tiers = format.tiers().len();
        if options.policy.tier >= tiers {
            return Err(LiveError::PolicyTier {
                tier: options.policy.tier,
                tiers,
            });
        }
        Ok(LiveCache {
            pages: PagedCache::new(format, options.kv_heads, tables)?,
            sequences: Vec::new(),
            pool: PagePool::new(tiers, options.pages_per_tier),
            policy: options.policy,
            executor: options.executor.executor()?,
            encoders: (options.executor == ExecutorKind::Jit)
                .then(|| (0..tiers).map(|_| OnceLock::new()).collect()),
            summaries: vec![Vec::new(); tiers],
        })
    }

    /// Trains every tier's tables on the prompts' keys and values, then
    /// prefills them; returns the cache and the prompts' sequence indices.
    pub fn train(
        format: &Format,
        options: &LiveOptions,
        prompts: &[SequenceKv],
        train: &TrainOptions,
    ) -> Result<(LiveCache, Vec<usize>), LiveError> {
        let tables = train_tables(format, options.kv_heads, prompts, train)?;
        let mut live = LiveCache::new(format, options, tables)?;
        let indices = live.prefill(prompts)?;
        Ok((live, indices))
    }

    /// The compressed pages as a paged cache (page tables and pools).
    pub fn pages(&self) -> &PagedCache {
        &self.pages
    }

    pub fn tables(&self) -> &Tables {
        self.pages.tables()
    }

    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    pub fn sequence(&self, sequence: usize) -> Option<&SequenceState> {
        self.sequences.get(sequence)
    }

    pub fn state(&self) -> LiveState {
        let view = self.pages.view();
        LiveState {
            sequences: self.sequences.clone(),
            page_tables: view.page_tables.to_vec(),
            pools: view.tiers.iter().map(|t| t.pool.to_vec()).collect(),
            pool: self.pool.clone(),
            policy: self.policy,
            summaries: self.summaries.clone(),
        }
    }

    /// Bytes held: exact rows, pages in use and every tier's tables.
    pub fn bytes(&self) -> usize {
        let format = self.pages.format();
        let exact: usize = self
            .sequences
            .iter()
            .flat_map(|s| s.sinks.iter().chain(&s.tail))
            .map(|rows| 2 * (rows.keys.len() + rows.values.len()))
            .sum();
        let pages: usize = (0..format.tiers().len())
            .map(|t| self.pool.used(t) * format.layout(t).page_bytes as usize)
            .sum();
        let tables = (0..format.tiers().len())
            .map(|t| format.layout(t).table_bytes() as usize * self.pages.kv_heads())
            .sum::<usize>();
        let summaries: usize = (0..format.tiers().len())
            .map(|t| self.pool.used(t))
            .sum::<usize>()
            * self.policy.select.map_or(0, |s| s.bytes() as usize);
        exact + pages + tables + summaries
    }

    /// The sequence after `keys`/`values` arrive, with its new pages encoded.
    fn plan(
        &self,
        sequence: usize,
        base: Option<&SequenceState>,
        keys: &[f32],
        values: &[f32],
    ) -> Result<Planned, LiveError> {
        let format = self.pages.format();
        let d = format.head_dim() as usize;
        let kv_heads = self.pages.kv_heads();
        let new = check_kv(format, kv_heads, keys, values)?;
        check_exact(self.policy.exact, keys, values)?;
        let exact = self.policy.exact;
        let empty = || vec![ExactRows::default(); kv_heads];
        let (tokens, mut sinks, mut tail) = match base {
            Some(s) => (s.tokens, s.sinks.clone(), s.tail.clone()),
            None => (0, empty(), empty()),
        };
        let to_sinks = self.policy.sinks.saturating_sub(tokens).min(new);
        for h in 0..kv_heads {
            let rows = |data: &[f32], from: usize, to: usize| -> Vec<f32> {
                data[(h * new + from) * d..(h * new + to) * d].to_vec()
            };
            sinks[h].push(exact, &rows(keys, 0, to_sinks), &rows(values, 0, to_sinks));
            tail[h].push(
                exact,
                &rows(keys, to_sinks, new),
                &rows(values, to_sinks, new),
            );
        }
        let layout = format.layout(self.policy.tier);
        let encoder = self.encoder(self.policy.tier)?;
        let items = layout.items_per_page as usize;
        let count = tail[0].tokens(d).saturating_sub(self.policy.window) / items;
        let mut pages = Vec::with_capacity(count);
        let mut summaries = Vec::with_capacity(count);
        for _ in 0..count {
            let mut heads = Vec::with_capacity(kv_heads);
            let mut summary = Vec::new();
            for (h, rows) in tail.iter_mut().enumerate() {
                let (k, v) = rows.take_front(exact, items, d);
                if let Some(layout) = &self.policy.select {
                    summary.push(select::summarize(layout, &k));
                }
                let mut page = vec![0u8; layout.page_bytes as usize];
                let tables = &self.pages.tables()[self.policy.tier][h];
                match &encoder {
                    Some(e) => encode_page_compiled(e, layout, h, tables, &k, &v, &mut page)?,
                    None => encode_page(layout, tables, &k, &v, &mut page)?,
                }
                heads.push(page);
            }
            pages.push(heads);
            summaries.push(summary);
        }
        Ok(Planned {
            sequence,
            tokens: tokens + new,
            sinks,
            tail,
            pages,
            summaries,
        })
    }

    /// Tier `tier`'s compiled page encoder under the JIT executor (compiled
    /// once per process and format), `None` under the others.
    fn encoder(&self, tier: usize) -> Result<Option<Arc<PageEncoder>>, LiveError> {
        let Some(cells) = &self.encoders else {
            return Ok(None);
        };
        if let Some(e) = cells[tier].get() {
            return Ok(Some(e.clone()));
        }
        let e = page_encoder(self.pages.format(), tier)?;
        Ok(Some(cells[tier].get_or_init(|| e).clone()))
    }

    /// Checks that the planned pages fit, then applies every plan.
    fn commit(&mut self, plans: Vec<Planned>) -> Result<(), LiveError> {
        let tier = self.policy.tier;
        let needed: usize = plans
            .iter()
            .map(|p| p.pages.len() * self.pages.kv_heads())
            .sum();
        let available = self.pool.available(tier);
        if needed > available {
            return Err(LiveError::Capacity {
                tier: self.pages.format().layout(tier).name.clone(),
                needed,
                available,
                capacity: self.pool.capacity(tier),
            });
        }
        let kv_heads = self.pages.kv_heads();
        for plan in plans {
            if plan.sequence == self.sequences.len() {
                self.pages
                    .page_tables_mut()
                    .push(vec![Vec::new(); kv_heads]);
                self.sequences.push(SequenceState {
                    tokens: 0,
                    sinks: Vec::new(),
                    tail: Vec::new(),
                });
            }
            for (heads, summaries) in plan.pages.iter().zip(&plan.summaries) {
                for (h, bytes) in heads.iter().enumerate() {
                    let page = self.pool.allocate(tier);
                    self.pages.write_page(tier, page.page, bytes);
                    self.pages.page_tables_mut()[plan.sequence][h].push(page);
                    if let Some(summary) = summaries.get(h) {
                        let n = summary.len();
                        let at = page.page as usize * n;
                        let stored = &mut self.summaries[tier];
                        if stored.len() < at + n {
                            stored.resize(at + n, 0);
                        }
                        stored[at..at + n].copy_from_slice(summary);
                    }
                }
            }
            self.sequences[plan.sequence] = SequenceState {
                tokens: plan.tokens,
                sinks: plan.sinks,
                tail: plan.tail,
            };
        }
        Ok(())
    }
}

/// Trains every tier's tables on the prompts' keys and values together.
pub(crate) fn train_tables(
    format: &Format,
    kv_heads: usize,
    prompts: &[SequenceKv],
    train: &TrainOptions,
) -> Result<Tables, LiveError> {
    let d = format.head_dim() as usize;
    let mut blocks = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        blocks.push(check_kv(format, kv_heads, prompt.keys, prompt.values)?);
    }
    if blocks.iter().sum::<usize>() == 0 {
        return Err(LiveError::NoTrainingData);
    }
    // [kv_head][every prompt's tokens][head_dim], what `cache::train` takes.
    let joined = |pick: for<'s> fn(&SequenceKv<'s>) -> &'s [f32]| -> Vec<f32> {
        (0..kv_heads)
            .flat_map(|h| {
                prompts.iter().zip(&blocks).flat_map(move |(p, &tokens)| {
                    pick(p)[h * tokens * d..(h + 1) * tokens * d]
                        .iter()
                        .copied()
                })
            })
            .collect()
    };
    Ok(cache::train(
        format,
        &joined(|p| p.keys),
        &joined(|p| p.values),
        kv_heads,
        train,
    )?)
}

/// Checks a `[kv_head][token][head_dim]` pair of blocks (same token count,
/// finite); returns its token count.
pub(crate) fn check_kv(
    format: &Format,
    kv_heads: usize,
    keys: &[f32],
    values: &[f32],
) -> Result<usize, LiveError> {
    let tokens = [
        cache::check_block(format, "keys", keys, kv_heads)?,
        cache::check_block(format, "values", values, kv_heads)?,
    ];
    if tokens[0] != tokens[1] {
        return Err(EncodeError::KeysValues {
            keys: tokens[0],
            values: tokens[1],
        }
        .into());
    }
    Ok(tokens[0])
}

impl LiveKv for LiveCache {
    fn format(&self) -> &Format {
        self.pages.format()
    }

    fn policy(&self) -> &CachePolicy {
        &self.policy
    }

    fn kv_heads(&self) -> usize {
        self.pages.kv_heads()
    }

    fn lengths(&self) -> Vec<usize> {
        self.sequences.iter().map(|s| s.tokens).collect()
    }

    fn prefill(&mut self, sequences: &[SequenceKv]) -> Result<Vec<usize>, LiveError> {
        let first = self.sequences.len();
        let plans = sequences
            .iter()
            .enumerate()
            .map(|(i, s)| self.plan(first + i, None, s.keys, s.values))
            .collect::<Result<Vec<_>, _>>()?;
        self.commit(plans)?;
        Ok((first..first + sequences.len()).collect())
    }

    fn append(&mut self, batch: &[Append]) -> Result<(), LiveError> {
        super::check_batch(self.sequences.len(), batch.iter().map(|a| a.sequence))?;
        let plans = batch
            .iter()
            .map(|a| {
                self.plan(
                    a.sequence,
                    Some(&self.sequences[a.sequence]),
                    a.keys,
                    a.values,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.commit(plans)
    }

    fn attend(&self, queries: &[f32], q_heads: usize) -> Result<Attention, LiveError> {
        Ok(self.decode(queries, q_heads)?.0)
    }

    fn release(&mut self, sequence: usize) -> Result<(), LiveError> {
        if sequence >= self.sequences.len() {
            return Err(LiveError::UnknownSequence {
                sequence,
                sequences: self.sequences.len(),
            });
        }
        for refs in self.pages.page_tables_mut().remove(sequence) {
            for page in refs {
                self.pool.release(page);
            }
        }
        self.sequences.remove(sequence);
        Ok(())
    }

    fn set_tier(&mut self, tier: usize) -> Result<(), LiveError> {
        let tiers = self.pages.format().tiers().len();
        if tier >= tiers {
            return Err(EncodeError::UnknownTier { tier, tiers }.into());
        }
        self.policy.tier = tier;
        Ok(())
    }
}

impl LiveCache {
    /// [`attend`](LiveKv::attend) with every row's scaled logits in token
    /// order (sinks, pages, tail): what fidelity metrics compare. Tokens of
    /// pages a selection did not read have logit -inf.
    pub fn attend_with_logits(
        &self,
        queries: &[f32],
        q_heads: usize,
    ) -> Result<(Attention, Vec<Vec<f32>>), LiveError> {
        self.decode(queries, q_heads)
    }

    fn decode(
        &self,
        queries: &[f32],
        q_heads: usize,
    ) -> Result<(Attention, Vec<Vec<f32>>), LiveError> {
        let format = self.pages.format();
        let d = format.head_dim() as usize;
        let kv_heads = self.pages.kv_heads();
        let interp = Interpreter::new(format.tiers(), Options::default());
        interp.check_queries(queries, self.sequences.len(), q_heads, kv_heads)?;
        let scale = interp.softmax_scale();
        let group = q_heads / kv_heads;
        let any_pages = self
            .pages
            .view()
            .page_tables
            .iter()
            .any(|heads| heads.iter().any(|refs| !refs.is_empty()));
        let selected = self.select_pages(queries, q_heads);
        let compressed = if any_pages {
            Some(self.executor.execute(Request {
                cache: &self.pages,
                queries,
                q_heads,
                logits: true,
                rows: selected.as_deref(),
            })?)
        } else {
            None
        };
        let mut out = Attention {
            outputs: Vec::with_capacity(queries.len()),
            lse: Vec::with_capacity(queries.len() / d),
        };
        let mut logits = Vec::with_capacity(queries.len() / d);
        for (row, query) in queries.chunks(d).enumerate() {
            let sequence = &self.sequences[row / q_heads];
            let kv_head = row % q_heads / group;
            let mut exact = ExactPartial::new(d);
            exact.push(self.policy.exact, &sequence.sinks[kv_head], query, scale);
            let sinks = exact.logits.len();
            exact.push(self.policy.exact, &sequence.tail[kv_head], query, scale);
            let mut finished = Vec::with_capacity(2);
            let mut row_logits = exact.logits[..sinks].to_vec();
            if let Some(decoded) = &compressed {
                if let Some(lse) = log_sum_exp(&decoded.logits[row]) {
                    let output = decoded.outputs[row * d..(row + 1) * d].to_vec();
                    finished.push((Softmax { max: lse, sum: 1.0 }, output));
                }
                match &selected {
                    None => row_logits.extend(&decoded.logits[row]),
                    Some(rows) => {
                        let all = &self.pages.view().page_tables[row / q_heads][kv_head];
                        let read = &rows[row / q_heads][kv_head];
                        let items = format.spec().page.items as usize;
                        row_logits.extend(unread_as_minus_infinity(
                            all,
                            read,
                            &decoded.logits[row],
                            items,
                        ));
                    }
                }
            }
            row_logits.extend(&exact.logits[sinks..]);
            logits.push(row_logits);
            if exact.softmax.sum > 0.0 {
                finished.push((exact.softmax, exact.acc));
            }
            out.outputs.extend(merge(&finished, d));
            let parts: Vec<f32> = finished.iter().map(|(s, _)| s.max + s.sum.ln()).collect();
            out.lse
                .push(log_sum_exp(&parts).unwrap_or(f32::NEG_INFINITY));
        }
        Ok((out, logits))
    }
}

impl LiveCache {
    /// The selection summary of page `page` of tier `tier`; `None` without
    /// a selection or for a page never compressed.
    pub fn page_summary(&self, tier: usize, page: u32) -> Option<&[u16]> {
        let n = self.policy.select?.values();
        let at = page as usize * n;
        self.summaries.get(tier)?.get(at..at + n)
    }

    /// The compressed pages each (sequence, kv head) reads under the
    /// policy's selection (`[sequence][kv_head]`, token order): the
    /// budget's highest-scoring pages for that kv head's query heads.
    /// `None` without a selection: every page.
    pub fn select_pages(&self, queries: &[f32], q_heads: usize) -> Option<Vec<Vec<Vec<PageRef>>>> {
        let layout = self.policy.select?;
        let d = layout.head_dim as usize;
        let kv_heads = self.pages.kv_heads();
        let group = q_heads / kv_heads;
        let view = self.pages.view();
        let rows = (view.page_tables.iter().enumerate())
            .map(|(s, heads)| {
                (heads.iter().enumerate())
                    .map(|(h, refs)| {
                        let first = (s * q_heads + h * group) * d;
                        let group_queries = &queries[first..first + group * d];
                        let scores: Vec<f32> = (refs.iter())
                            .map(|r| {
                                let n = layout.values();
                                let at = r.page as usize * n;
                                let summary = &self.summaries[r.tier as usize][at..at + n];
                                let tokens = layout.items_per_page as usize;
                                select::score(&layout, summary, tokens, group_queries)
                            })
                            .collect();
                        (select::choose(&scores, layout.budget_pages as usize).into_iter())
                            .map(|i| refs[i])
                            .collect()
                    })
                    .collect()
            })
            .collect();
        Some(rows)
    }
}

/// Rejects finite inputs the exact dtype cannot hold (f16 overflows past 65504).
pub(crate) fn check_exact(
    exact: ExactDtype,
    keys: &[f32],
    values: &[f32],
) -> Result<(), LiveError> {
    for (what, data) in [("keys", keys), ("values", values)] {
        if let Some(&value) = data.iter().find(|&&x| !round(exact, x).is_finite()) {
            return Err(LiveError::ExactRange {
                what,
                value,
                dtype: exact.name(),
            });
        }
    }
    Ok(())
}

/// The logits of every token of `all` pages (whole pages of `items`) from
/// those of the `read` ones (a subsequence of `all`): -inf, weight 0, for
/// tokens not read.
fn unread_as_minus_infinity(
    all: &[PageRef],
    read: &[PageRef],
    logits: &[f32],
    items: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(all.len() * items);
    let mut next = read.iter().zip(logits.chunks(items)).peekable();
    for page in all {
        match next.peek() {
            Some((r, page_logits)) if *r == page => {
                out.extend_from_slice(page_logits);
                next.next();
            }
            _ => out.extend(std::iter::repeat_n(f32::NEG_INFINITY, items)),
        }
    }
    out
}

/// `ln Σ exp(x)`, computed in f64; `None` for no values.
fn log_sum_exp(values: &[f32]) -> Option<f32> {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return None;
    }
    let sum: f64 = values.iter().map(|&x| f64::from(x - max).exp()).sum();
    Some((f64::from(max) + sum.ln()) as f32)
}
