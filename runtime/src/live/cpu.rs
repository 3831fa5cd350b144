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

use super::budget::{self, TierCost};
use super::exact::{round, ExactPartial, ExactRows};
use super::pool::PagePool;
use super::{Append, Attention, CachePolicy, LiveError, LiveKv, Queries, SequenceKv};
use crate::cache::{self, PagedCache, Tables};
use crate::encode::{encode_page, encode_page_compiled, EncodeError, TrainOptions};
use crate::exec::{page_encoder, Executor, ExecutorKind, Request};

/// How a [`LiveCache`] is shaped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LiveOptions {
    pub policy: CachePolicy,
    pub kv_heads: usize,
    /// Page slots of every tier's pool (each kv head's page takes one).
    pub pages_per_tier: usize,
    /// The executor that attends the compressed pages.
    pub executor: ExecutorKind,
}

/// One sequence's exact rows, per kv head, and under a `[cache.budget]`
/// its most recent queries per query head (`[row][head_dim]`, oldest first).
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceState {
    pub tokens: usize,
    pub sinks: Vec<ExactRows>,
    pub tail: Vec<ExactRows>,
    pub observed: Vec<Vec<f32>>,
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
    pub positions: Vec<Vec<Vec<u32>>>,
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
    /// `[tier][page]`: the token positions of each page's items, in item
    /// order (a `[cache.budget]` page holds any of its sequence's tokens).
    positions: Vec<Vec<Vec<u32>>>,
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
    observed: Vec<Vec<f32>>,
    /// `[kv_head]`: the pages compressed.
    pages: Vec<Vec<PlannedPage>>,
}

/// One (kv head, page) to write.
struct PlannedPage {
    tier: usize,
    bytes: Vec<u8>,
    /// Its selection summary, where the policy selects.
    summary: Option<Vec<u16>>,
    positions: Vec<u32>,
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
        if let Some(b) = &options.policy.budget {
            check_budget(format, b)?;
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
            positions: vec![Vec::new(); tiers],
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
            positions: self.positions.clone(),
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

    /// The sequence after `keys`/`values` arrive (and, for a prompt, its
    /// last tokens' `queries`), with its new pages encoded.
    fn plan(
        &self,
        sequence: usize,
        base: Option<&SequenceState>,
        keys: &[f32],
        values: &[f32],
        queries: Queries,
    ) -> Result<Planned, LiveError> {
        let format = self.pages.format();
        let d = format.head_dim() as usize;
        let kv_heads = self.pages.kv_heads();
        let new = check_kv(format, kv_heads, keys, values)?;
        check_exact(self.policy.exact, keys, values)?;
        let exact = self.policy.exact;
        let empty = || vec![ExactRows::default(); kv_heads];
        let (tokens, mut sinks, mut tail, observed) = match base {
            Some(s) => (
                s.tokens,
                s.sinks.clone(),
                s.tail.clone(),
                s.observed.clone(),
            ),
            None => (0, empty(), empty(), self.observed_prompt(queries, new)?),
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
        let tail_tokens = tail[0].tokens(d);
        // The position of the tail's first token.
        let front = (tokens + new - tail_tokens) as u32;
        let leaving = tail_tokens.saturating_sub(self.policy.window);
        let mut pages = Vec::with_capacity(kv_heads);
        match self.policy.budget {
            None => {
                let layout = format.layout(self.policy.tier);
                let items = layout.items_per_page as usize;
                for (h, rows) in tail.iter_mut().enumerate() {
                    let mut head = Vec::new();
                    for p in 0..leaving / items {
                        let (k, v) = rows.take_front(exact, items, d);
                        let at = front + (p * items) as u32;
                        head.push(self.planned_page(
                            self.policy.tier,
                            h,
                            &k,
                            &v,
                            at..at + items as u32,
                        )?);
                    }
                    pages.push(head);
                }
            }
            Some(b) => {
                // A prompt allocates every state leaving the window; appends
                // wait until `refresh` of them have gathered.
                let due = leaving > 0 && (base.is_none() || leaving >= b.refresh);
                for h in 0..kv_heads {
                    let head = match due {
                        true => {
                            self.allocate(h, &sinks[h], &mut tail[h], leaving, &observed, front)?
                        }
                        false => Vec::new(),
                    };
                    pages.push(head);
                }
            }
        }
        Ok(Planned {
            sequence,
            tokens: tokens + new,
            sinks,
            tail,
            observed,
            pages,
        })
    }

    /// One page of `tier` for kv head `h` holding `keys`/`values`, the
    /// tokens at `positions`.
    fn planned_page(
        &self,
        tier: usize,
        h: usize,
        keys: &[f32],
        values: &[f32],
        positions: impl IntoIterator<Item = u32>,
    ) -> Result<PlannedPage, LiveError> {
        Ok(PlannedPage {
            tier,
            bytes: self.encode(tier, h, keys, values)?,
            summary: (self.policy.select).map(|s| select::summarize(&s, keys)),
            positions: positions.into_iter().collect(),
        })
    }

    /// A page of `tier` for kv head `h` holding `keys`/`values`.
    fn encode(
        &self,
        tier: usize,
        h: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<Vec<u8>, LiveError> {
        let layout = self.pages.format().layout(tier);
        let mut bytes = vec![0u8; layout.page_bytes as usize];
        let tables = &self.pages.tables()[tier][h];
        match &self.encoder(tier)? {
            Some(e) => encode_page_compiled(e, layout, h, tables, keys, values, &mut bytes)?,
            None => encode_page(layout, tables, keys, values, &mut bytes)?,
        }
        Ok(bytes)
    }

    /// The `[cache.budget]` pages of kv head `h`: its tail's first `count`
    /// states (from position `front`) scored at every tier, allocated and
    /// packed; dropped states are gone.
    fn allocate(
        &self,
        h: usize,
        sinks: &ExactRows,
        tail: &mut ExactRows,
        count: usize,
        observed: &[Vec<f32>],
        front: u32,
    ) -> Result<Vec<PlannedPage>, LiveError> {
        let budget = self.policy.budget.expect("a budget allocates");
        let format = self.pages.format();
        let d = format.head_dim() as usize;
        let exact = self.policy.exact;
        let (keys, values) = tail.take_front(exact, count, d);
        let widen = |bits: &[u16]| -> Vec<f32> {
            bits.iter()
                .map(|&b| super::exact::from_bits(exact, b))
                .collect()
        };
        let (exact_keys, exact_values) = (
            [widen(&sinks.keys), widen(&tail.keys)].concat(),
            [widen(&sinks.values), widen(&tail.values)].concat(),
        );
        let group = observed.len() / self.pages.kv_heads().max(1);
        let queries: Vec<f32> = observed[h * group..(h + 1) * group].concat();
        if budget.needs_queries() && queries.is_empty() {
            return Err(LiveError::NoQueries {
                score: budget.score.name(),
            });
        }
        let states = budget::States {
            keys: &keys,
            values: &values,
            queries: &queries,
            exact_keys: &exact_keys,
            exact_values: &exact_values,
        };
        let tiers = format.tiers().len();
        let tables: Vec<&[Vec<f32>]> = (0..tiers).map(|t| &self.pages.tables()[t][h][..]).collect();
        let distortions =
            budget::distortions(format, &tables, budget.score, &states, |t, k, v| {
                let n = format.layout(t).items_per_page as usize * d;
                (k.chunks(n).zip(v.chunks(n)))
                    .map(|(k, v)| self.encode(t, h, k, v))
                    .collect()
            })?;
        let costs: Vec<TierCost> = (0..tiers).map(|t| TierCost::of(format, t)).collect();
        let allocation = budget::allocate(&distortions, &costs, &budget);
        let items = format.spec().page.items as usize;
        budget::pack(&allocation, tiers, items)
            .into_iter()
            .map(|(t, states)| {
                let gather = |data: &[f32]| -> Vec<f32> {
                    states
                        .iter()
                        .flat_map(|&i| &data[i * d..(i + 1) * d])
                        .copied()
                        .collect()
                };
                let positions = states.iter().map(|&i| front + i as u32);
                self.planned_page(t, h, &gather(&keys), &gather(&values), positions)
            })
            .collect()
    }

    /// A new sequence's observed queries per query head: the last
    /// `observe` rows of its prompt's `queries` (none without a budget).
    fn observed_prompt(&self, queries: Queries, tokens: usize) -> Result<Vec<Vec<f32>>, LiveError> {
        let Some(budget) = self.policy.budget else {
            return Ok(Vec::new());
        };
        if queries.data.is_empty() {
            return Ok(Vec::new());
        }
        let d = self.pages.format().head_dim() as usize;
        let kv_heads = self.pages.kv_heads();
        let q_heads = queries.q_heads;
        let rows = match q_heads {
            0 => 0,
            _ => queries.data.len() / (q_heads * d),
        };
        if q_heads == 0
            || !q_heads.is_multiple_of(kv_heads)
            || rows * q_heads * d != queries.data.len()
            || rows > tokens
        {
            return Err(LiveError::Budget(format!(
                "a prompt's queries are [q_head][row][head_dim] for a multiple of {kv_heads} \
                 query heads and at most its {tokens} tokens of {d}; got {} values for {q_heads} \
                 query heads",
                queries.data.len()
            )));
        }
        if let Some(x) = queries.data.iter().find(|x| !x.is_finite()) {
            return Err(LiveError::Budget(format!("a prompt's queries hold {x}")));
        }
        let keep = rows.min(budget.observe);
        Ok((0..q_heads)
            .map(|h| queries.data[(h * rows + rows - keep) * d..(h + 1) * rows * d].to_vec())
            .collect())
    }

    /// [`LiveKv::observe`]: keeps each sequence's last `observe` rows per query head.
    fn observe_queries(&mut self, queries: &[f32], q_heads: usize) -> Result<(), LiveError> {
        let format = self.pages.format();
        let d = format.head_dim() as usize;
        let interp = Interpreter::new(format.tiers(), Options::default());
        interp.check_queries(
            queries,
            self.sequences.len(),
            q_heads,
            self.pages.kv_heads(),
        )?;
        let Some(budget) = self.policy.budget else {
            return Ok(());
        };
        for (s, rows) in self.sequences.iter_mut().zip(queries.chunks(q_heads * d)) {
            if s.observed.len() != q_heads {
                s.observed = vec![Vec::new(); q_heads];
            }
            for (kept, q) in s.observed.iter_mut().zip(rows.chunks(d)) {
                kept.extend_from_slice(q);
                let excess = kept.len().saturating_sub(budget.observe * d);
                kept.drain(..excess);
            }
        }
        Ok(())
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
        let format = self.pages.format();
        let mut needed = vec![0usize; format.tiers().len()];
        for page in plans.iter().flat_map(|p| p.pages.iter().flatten()) {
            needed[page.tier] += 1;
        }
        for (tier, &needed) in needed.iter().enumerate() {
            let available = self.pool.available(tier);
            if needed > available {
                return Err(LiveError::Capacity {
                    tier: format.layout(tier).name.clone(),
                    needed,
                    available,
                    capacity: self.pool.capacity(tier),
                });
            }
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
                    observed: Vec::new(),
                });
            }
            for (h, pages) in plan.pages.into_iter().enumerate() {
                for planned in pages {
                    let tier = planned.tier;
                    let page = self.pool.allocate(tier);
                    self.pages.write_page(tier, page.page, &planned.bytes);
                    self.pages.page_tables_mut()[plan.sequence][h].push(page);
                    let slot = page.page as usize;
                    let positions = &mut self.positions[tier];
                    if positions.len() <= slot {
                        positions.resize(slot + 1, Vec::new());
                    }
                    positions[slot] = planned.positions;
                    if let Some(summary) = planned.summary {
                        let n = summary.len();
                        let at = slot * n;
                        let stored = &mut self.summaries[tier];
                        if stored.len() < at + n {
                            stored.resize(at + n, 0);
                        }
                        stored[at..at + n].copy_from_slice(&summary);
                    }
                }
            }
            self.sequences[plan.sequence] = SequenceState {
                tokens: plan.tokens,
                sinks: plan.sinks,
                tail: plan.tail,
                observed: plan.observed,
            };
        }
        Ok(())
    }
}

/// Checks that `budget` can be met by `format`'s tiers: without drops, the
/// budget must reach the cheapest tier's bytes per state.
fn check_budget(format: &Format, budget: &budget::BudgetPolicy) -> Result<(), LiveError> {
    if budget.drop {
        return Ok(());
    }
    let cheapest = (0..format.tiers().len())
        .map(|t| {
            let layout = format.layout(t);
            (
                f64::from(layout.page_bytes) / f64::from(layout.items_per_page),
                t,
            )
        })
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .expect("a format has a tier");
    if budget.bytes_per_token < cheapest.0 {
        return Err(LiveError::Budget(format!(
            "[cache.budget] bytes_per_token = {} is below the cheapest tier `{}` ({:.2} B per \
             state) and drop = false: no allocation can meet it",
            budget.bytes_per_token,
            format.layout(cheapest.1).name,
            cheapest.0
        )));
    }
    Ok(())
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
            .map(|(i, s)| self.plan(first + i, None, s.keys, s.values, s.queries))
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
                    Queries::default(),
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

    fn observe(&mut self, queries: &[f32], q_heads: usize) -> Result<(), LiveError> {
        self.observe_queries(queries, q_heads)
    }

    fn set_tier(&mut self, tier: usize) -> Result<(), LiveError> {
        if self.policy.budget.is_some() {
            return Err(LiveError::Budget(
                "a [cache.budget] cache chooses each state's tier itself; set_tier does not apply"
                    .to_string(),
            ));
        }
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
            // Token order: sinks, the pages' tokens where their positions
            // say (-inf for tokens not read or dropped), then the tail.
            let mut row_logits =
                vec![f32::NEG_INFINITY; sequence.tokens - (exact.logits.len() - sinks)];
            row_logits[..sinks].copy_from_slice(&exact.logits[..sinks]);
            if let Some(decoded) = &compressed {
                if let Some(lse) = log_sum_exp(&decoded.logits[row]) {
                    let output = decoded.outputs[row * d..(row + 1) * d].to_vec();
                    finished.push((Softmax { max: lse, sum: 1.0 }, output));
                }
                let read = match &selected {
                    None => &self.pages.view().page_tables[row / q_heads][kv_head],
                    Some(rows) => &rows[row / q_heads][kv_head],
                };
                let positions = read
                    .iter()
                    .flat_map(|r| &self.positions[r.tier as usize][r.page as usize]);
                for (&at, &logit) in positions.zip(&decoded.logits[row]) {
                    row_logits[at as usize] = logit;
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
    /// The token positions of page `page` of tier `tier`'s items, in item
    /// order; `None` for a page never written.
    pub fn page_positions(&self, tier: usize, page: u32) -> Option<&[u32]> {
        self.positions
            .get(tier)?
            .get(page as usize)
            .map(Vec::as_slice)
    }

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

/// `ln Σ exp(x)`, computed in f64; `None` for no values.
fn log_sum_exp(values: &[f32]) -> Option<f32> {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return None;
    }
    let sum: f64 = values.iter().map(|&x| f64::from(x - max).exp()).sum();
    Some((f64::from(max) + sum.ln()) as f32)
}
