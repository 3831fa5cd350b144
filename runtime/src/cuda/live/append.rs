//! Appending tokens to a [`DeviceLiveCache`]. An append is planned first
//! (slots, header counts, compress jobs, capacity) on copies of the appended
//! sequences' exact pages and of the pools, so a call that fails changes
//! nothing and the host's work per step does not grow with the cache.

use std::sync::atomic::Ordering;

use cudarc::driver::{sys, CudaView, DevicePtr, PushKernelArg};
use kvcc_compiler::back::ptx::abi;
use kvcc_compiler::page::PageRef;
use kvcc_compiler::Format;

use super::{capturing, DeviceAppend, DeviceLiveCache, ExactPart, Sequence};
use crate::cuda::During;
use crate::live::{check_exact, check_kv, LiveError, PagePool};

/// An append, planned without touching the books: the appended sequences'
/// new exact parts, the pages compressed, the pool after it, and the
/// device rounds.
struct Plan {
    touched: Vec<(usize, ExactPart)>,
    /// (sequence, kv head, page) in token order.
    compressed: Vec<(usize, usize, PageRef)>,
    pool: PagePool,
    /// Whether any page list changes (a page allocated or compressed).
    changed: bool,
    rounds: Vec<Round>,
}

/// One batch of device work: append kernel rows and headers, then compress jobs.
#[derive(Debug, Default)]
struct Round {
    /// (source row, exact item) pairs.
    rows: Vec<[u32; 2]>,
    /// (exact page, count) pairs.
    headers: Vec<[u32; 2]>,
    /// (exact page, compressed page, kv head) triples, into the policy's tier.
    jobs: Vec<[u32; 3]>,
}

impl DeviceLiveCache {
    /// Appends tokens whose K/V are on the device: `keys` and `values` hold,
    /// for each entry of `batch` in order, `[kv_head][token][head_dim]` f32.
    pub fn append_device(
        &mut self,
        keys: &CudaView<f32>,
        values: &CudaView<f32>,
        batch: &[DeviceAppend],
    ) -> Result<(), LiveError> {
        self.check_batch(batch.iter().map(|a| a.sequence))?;
        let new: Vec<(usize, usize)> = batch.iter().map(|a| (a.sequence, a.tokens)).collect();
        for (what, data) in [("keys", keys), ("values", values)] {
            self.check_rows(what, data.len(), &new)?;
        }
        let stream = &self.gpu.stream;
        let (keys, values) = (keys.device_ptr(stream).0, values.device_ptr(stream).0);
        self.run_append(keys, values, abi::RowDtype::F32, &new)
    }

    /// Appends tokens whose K/V lie in device memory the caller owns (a
    /// framework's tensors): `keys` and `values` hold, for each entry of
    /// `batch` in order, `[kv_head][token][head_dim]` rows of `input`.
    /// Nothing is checked for NaN here (the caller's tensors are not read on
    /// the host); rows are rounded to the exact dtype as the CPU rounds them.
    ///
    /// # Safety
    /// `keys` and `values` must be device pointers of this cache's context,
    /// each to `len` readable elements of `input` that stay unchanged until
    /// the work enqueued now is done (order the caller's stream with
    /// [`on_stream`](Self::on_stream)).
    pub unsafe fn append_rows(
        &mut self,
        keys: sys::CUdeviceptr,
        values: sys::CUdeviceptr,
        len: usize,
        input: abi::RowDtype,
        batch: &[DeviceAppend],
    ) -> Result<(), LiveError> {
        self.check_batch(batch.iter().map(|a| a.sequence))?;
        let new: Vec<(usize, usize)> = batch.iter().map(|a| (a.sequence, a.tokens)).collect();
        self.check_rows("keys and values each", len, &new)?;
        self.run_append(keys, values, input, &new)
    }

    /// Adds sequences whose prompts lie in device memory (see
    /// [`append_rows`](Self::append_rows)): `tokens[i]` tokens of new
    /// sequence `i`, `[sequence][kv_head][token][head_dim]` in `keys` and
    /// `values`. Returns their indices.
    ///
    /// # Safety
    /// As for [`append_rows`](Self::append_rows).
    pub unsafe fn prefill_rows(
        &mut self,
        keys: sys::CUdeviceptr,
        values: sys::CUdeviceptr,
        len: usize,
        input: abi::RowDtype,
        tokens: &[usize],
    ) -> Result<Vec<usize>, LiveError> {
        let first = self.books.sequences.len();
        self.check_room(tokens.len())?;
        let new: Vec<(usize, usize)> = (tokens.iter().enumerate())
            .map(|(i, &n)| (first + i, n))
            .collect();
        self.check_rows("keys and values each", len, &new)?;
        self.run_append(keys, values, input, &new)?;
        Ok((first..first + tokens.len()).collect())
    }

    /// Refuses device K/V (`what`) whose length is not the batch's rows.
    fn check_rows(&self, what: &str, len: usize, new: &[(usize, usize)]) -> Result<(), LiveError> {
        let rows: usize = new.iter().map(|&(_, n)| n * self.kv_heads).sum();
        let d = self.format.head_dim() as usize;
        if len != rows * d {
            return Err(LiveError::Device(format!(
                "{what} hold {len} values; the batch's {rows} rows need {}",
                rows * d
            )));
        }
        Ok(())
    }

    pub(super) fn check_room(&self, new: usize) -> Result<(), LiveError> {
        let total = self.books.sequences.len() + new;
        if total > self.max_sequences {
            return Err(LiveError::Device(format!(
                "{total} sequences would exceed the cache's {} (max_sequences)",
                self.max_sequences
            )));
        }
        Ok(())
    }

    /// Plans `new` (sequence, tokens) in batch order, then runs the rounds
    /// over source rows `[entry][kv_head][token]` of `keys`/`values`
    /// (elements of `input`).
    fn run_append(
        &mut self,
        keys: sys::CUdeviceptr,
        values: sys::CUdeviceptr,
        input: abi::RowDtype,
        new: &[(usize, usize)],
    ) -> Result<(), LiveError> {
        if capturing(&self.gpu.stream)? {
            return Err(LiveError::Device(
                "an append cannot be captured in a CUDA graph (it is planned on the host): \
                 append outside the graph and replay the captured attend"
                    .into(),
            ));
        }
        let plan = self.plan(new)?;
        let rounds = &plan.rounds;
        let lists_len: usize = rounds
            .iter()
            .map(|r| 2 * r.rows.len() + 2 * r.headers.len() + 3 * r.jobs.len())
            .sum();
        let mut host = Vec::with_capacity(lists_len);
        for r in rounds {
            host.extend(r.rows.iter().flatten());
            host.extend(r.headers.iter().flatten());
            host.extend(r.jobs.iter().flatten());
        }
        // A step that only appends rows into pages already listed goes to the
        // side stream, where the exact tier's decode kernel follows it beside
        // the other tiers' (`launch_decode`); anything else runs in order on
        // the main stream, after whatever the side stream still holds.
        let steady = !plan.changed
            && rounds.iter().all(|r| r.jobs.is_empty())
            && self.lists.len() >= host.len();
        let main = self.gpu.stream.clone();
        let stream = if steady {
            (self.side_ready.record(&main))
                .and_then(|()| self.side.wait(&self.side_ready))
                .during(|| "ordering streams".into())?;
            self.side.clone()
        } else {
            self.join_side()?;
            main.clone()
        };
        if self.lists.len() < host.len() {
            self.lists = (stream.alloc_zeros::<u32>(host.len() + host.len() / 2))
                .during(|| "allocating append lists".into())?;
        }
        if !host.is_empty() {
            let mut part = self.lists.slice_mut(0..host.len());
            (stream.memcpy_htod(&host, &mut part)).during(|| "uploading append lists".into())?;
        }
        let exact = self.serving.exact_tier;
        let tier = self.policy.tier;
        let mut at = 0usize;
        for r in rounds {
            let rows = self.lists.slice(at..at + 2 * r.rows.len().max(1));
            at += 2 * r.rows.len();
            let headers = self.lists.slice(at..at + 2 * r.headers.len().max(1));
            at += 2 * r.headers.len();
            let jobs_at = at;
            at += 3 * r.jobs.len();
            let (function, kernel) = &self.append_kernels[input as usize];
            let launch = kernel.launch(r.rows.len() as u32, r.headers.len() as u32);
            let (row_count, header_count) = (r.rows.len() as u32, r.headers.len() as u32);
            if row_count + header_count > 0 {
                let mut args = stream.launch_builder(function);
                args.arg(self.device.pool_mut(exact))
                    .arg(&keys)
                    .arg(&values)
                    .arg(&rows)
                    .arg(&row_count)
                    .arg(&headers)
                    .arg(&header_count);
                // SAFETY: arguments follow abi::APPEND_PARAMS in order and
                // type; every source row and exact item was planned inside
                // its buffer.
                unsafe { args.launch(crate::cuda::config(launch)) }
                    .during(|| format!("launching {}", kernel.name))?;
            }
            if !r.jobs.is_empty() {
                let jobs = self.lists.slice(jobs_at..jobs_at + 3 * r.jobs.len());
                let (source, target, tables) = self.device.encode_buffers(exact, tier);
                self.encoders.launch(
                    &self.gpu,
                    tier,
                    source,
                    target,
                    tables,
                    &jobs,
                    r.jobs.len() as u32,
                )?;
                if let Some((pool, selection)) = self.device.summarize_buffers(exact) {
                    selection.summarize(&self.gpu, pool, &jobs, r.jobs.len() as u32)?;
                }
            }
        }
        if steady {
            self.beside.store(true, Ordering::Release);
        }
        let Plan {
            touched,
            compressed,
            pool,
            changed,
            ..
        } = plan;
        for (sequence, part) in touched {
            match self.books.sequences.get_mut(sequence) {
                Some(s) => s.exact = part,
                None => self.books.sequences.push(Sequence {
                    exact: part,
                    pages: vec![Vec::new(); self.kv_heads],
                }),
            }
        }
        for (sequence, h, page) in compressed {
            self.books.sequences[sequence].pages[h].push(page);
        }
        self.books.pool = pool;
        if changed {
            let tables: Vec<Vec<Vec<PageRef>>> = (self.books.sequences.iter())
                .map(|s| self.row_pages(s))
                .collect();
            self.device.set_page_lists(&self.gpu, &tables)?;
        }
        Ok(())
    }

    /// Where every new row goes, planned on copies of the appended
    /// sequences' exact parts and of the pool: the plan, or the first error
    /// (nothing changed). New entries past the last sequence are new
    /// sequences, in order.
    fn plan(&self, new: &[(usize, usize)]) -> Result<Plan, LiveError> {
        let mut pool = self.books.pool.clone();
        let mut changed = false;
        let mut compressed = Vec::new();
        let items = self.format.spec().page.items as usize;
        let (exact, tier) = (self.serving.exact_tier, self.policy.tier);
        let kv_heads = self.kv_heads;
        let most = new.iter().map(|&(_, n)| n).max().unwrap_or(0);
        let mut rounds = Vec::new();
        // Source rows: entry e's rows start after the earlier entries'.
        let mut first_row = Vec::with_capacity(new.len());
        let mut next = 0usize;
        let mut touched = Vec::with_capacity(new.len());
        for &(sequence, tokens) in new {
            first_row.push(next);
            next += tokens * kv_heads;
            let part = match self.books.sequences.get(sequence) {
                Some(s) => s.exact.clone(),
                None => {
                    changed = true;
                    ExactPart::new(kv_heads)
                }
            };
            touched.push((sequence, part));
        }
        // Rounds of at most a page of tokens per sequence: before a round
        // the tail holds fewer than window + items tokens, so each round
        // compresses at most one page per kv head, and exact pages freed in
        // one round are free for the next (the stream orders them).
        for start in (0..most).step_by(items) {
            let mut round = Round::default();
            let mut freed = Vec::new();
            for (e, &(sequence, tokens)) in new.iter().enumerate() {
                let end = tokens.min(start + items);
                if start >= end {
                    continue;
                }
                let s = &mut touched[e].1;
                let mut touched: Vec<(usize, bool)> = Vec::new();
                for i in start..end {
                    let t = s.tokens;
                    let sink = t < self.policy.sinks;
                    let (list, at) = if sink {
                        (&mut s.sinks, t)
                    } else {
                        (&mut s.tail, s.tail_tokens)
                    };
                    let index = at / items;
                    for (h, pages) in list.iter_mut().enumerate() {
                        if pages.len() == index {
                            let page = allocate(&mut pool, exact, &self.serving.format)?;
                            pages.push(page);
                            changed = true;
                        }
                        let row = first_row[e] + h * tokens + i;
                        let slot = pages[index] as usize * items + at % items;
                        round.rows.push([row as u32, slot as u32]);
                    }
                    if touched.last() != Some(&(index, sink)) {
                        touched.push((index, sink));
                    }
                    s.tokens += 1;
                    if !sink {
                        s.tail_tokens += 1;
                    }
                }
                let sink_tokens = s.tokens.min(self.policy.sinks);
                for (index, sink) in touched {
                    let (list, held) = if sink {
                        (&s.sinks, sink_tokens)
                    } else {
                        (&s.tail, s.tail_tokens)
                    };
                    let count = (held - index * items).min(items) as u32;
                    for pages in list {
                        round.headers.push([pages[index], count]);
                    }
                }
                if s.tail_tokens >= self.policy.window + items {
                    for h in 0..kv_heads {
                        let source = s.tail[h].remove(0);
                        let target = allocate(&mut pool, tier, &self.format)?;
                        round.jobs.push([source, target, h as u32]);
                        let page = PageRef {
                            tier: tier as u32,
                            page: target,
                        };
                        compressed.push((sequence, h, page));
                        freed.push(source);
                        changed = true;
                    }
                    s.tail_tokens -= items;
                }
            }
            for page in freed {
                pool.release(PageRef {
                    tier: exact as u32,
                    page,
                });
            }
            rounds.push(round);
        }
        Ok(Plan {
            touched,
            compressed,
            pool,
            changed,
            rounds,
        })
    }

    /// Checks host K/V entries (`[kv_head][token][head_dim]` each), uploads
    /// them to the staging buffers and appends them.
    pub(super) fn append_host(
        &mut self,
        entries: &[(usize, &[f32], &[f32])],
    ) -> Result<(), LiveError> {
        let mut new = Vec::with_capacity(entries.len());
        let mut host = [Vec::new(), Vec::new()];
        for &(sequence, k, v) in entries {
            let tokens = check_kv(&self.format, self.kv_heads, k, v)?;
            check_exact(self.policy.exact, k, v)?;
            host[0].extend_from_slice(k);
            host[1].extend_from_slice(v);
            new.push((sequence, tokens));
        }
        let len = host[0].len().max(1);
        let stream = self.gpu.stream.clone();
        let mut staged = match self.staged.take() {
            Some(buffers) if buffers[0].len() >= len => buffers,
            _ => {
                let alloc =
                    || (stream.alloc_zeros::<f32>(len)).during(|| "allocating staged K/V".into());
                [alloc()?, alloc()?]
            }
        };
        for (buffer, data) in staged.iter_mut().zip(&host) {
            if !data.is_empty() {
                let mut part = buffer.slice_mut(0..data.len());
                (stream.memcpy_htod(data, &mut part)).during(|| "uploading K/V".into())?;
            }
        }
        let (keys, values) = (
            staged[0].device_ptr(&stream).0,
            staged[1].device_ptr(&stream).0,
        );
        let result = self.run_append(keys, values, abi::RowDtype::F32, &new);
        self.staged = Some(staged);
        result
    }
}

/// A page of `tier`, or the capacity error.
fn allocate(pool: &mut PagePool, tier: usize, format: &Format) -> Result<u32, LiveError> {
    if pool.available(tier) == 0 {
        let name = (format.spec().tiers.get(tier)).map_or("exact", |t| t.name.as_str());
        return Err(LiveError::Capacity {
            tier: name.to_string(),
            needed: 1,
            available: 0,
            capacity: pool.capacity(tier),
        });
    }
    Ok(pool.allocate(tier).page)
}
