//! `[cache.select]` on the GPU, in three kernels of one module: `summarize`
//! writes each compressed page's summary from its exact keys (launched with
//! the page encoder's jobs), `score` scores every listed page for its row's
//! query heads, and `choose` keeps each row's budget of highest scores as page
//! lists in the decode ABI (`abi::page_lists`), which the decode kernels read
//! as they read every page list. Every bit equals `back::interp::select`:
//! products rounded then summed in its order (`.rn`, no fma), ties to the
//! earlier page; the budget, not the context, sizes what the decode reads, so
//! a step's grid stays fixed as pages fill.

use super::abi::{self, DenseSource, Launch, Param, ParamType, ENCODE_JOB_WORDS, SHARED_SYMBOL};
use super::builder::{Axis, Bits32, Cmp, Global, Kernel, Reg, Shared, B16, F32, S32, U32, U64};
use super::encode::load_source_value;
use crate::layout::summary::SummaryLayout;
use crate::spec::{GroupScore, SelectMethod};

/// Parameters of the summary kernel, in order.
pub const SUMMARIZE_PARAMS: [Param; 4] = [
    abi::param(
        "summaries",
        ParamType::Pointer,
        "u16[pool pages][summary values]: f16 summaries of the compressed tier's pages, at the page's pool index",
    ),
    abi::param(
        "src_pool",
        ParamType::Pointer,
        "the exact pool the page encoder reads (`DenseSource`)",
    ),
    abi::param(
        "jobs",
        ParamType::Pointer,
        "u32[3 * job_count]: the page encoder's jobs (source page, destination page, kv head)",
    ),
    abi::param("job_count", ParamType::U32, "jobs (one CTA each)"),
];

/// Parameters of the score kernel, in order.
pub const SCORE_PARAMS: [Param; 7] = [
    abi::param(
        "summaries",
        ParamType::Pointer,
        "the summaries `summarize` wrote",
    ),
    abi::param(
        "queries",
        ParamType::Pointer,
        "f32[sequences][q_heads][head_dim]: the step's queries",
    ),
    abi::param(
        "page_offsets",
        ParamType::Pointer,
        "u32[rows + 1]: the compressed tier's full page lists (`abi::page_lists`)",
    ),
    abi::param("page_ids", ParamType::Pointer, "u32[entries]: their pages"),
    abi::param(
        "scores",
        ParamType::Pointer,
        "u32[entries]: each listed page's score as an ordered key (`order_key`)",
    ),
    abi::param(
        "rows",
        ParamType::U32,
        "(sequence, kv head) rows: sequences * kv_heads",
    ),
    abi::param(
        "kv_heads",
        ParamType::U32,
        "kv heads; query heads are kv_heads * the kernel's group",
    ),
];

/// Parameters of the choose kernel, in order.
pub const CHOOSE_PARAMS: [Param; 7] = [
    abi::param("scores", ParamType::Pointer, "the keys `score` wrote"),
    abi::param(
        "page_offsets",
        ParamType::Pointer,
        "the full page lists' offsets",
    ),
    abi::param("page_ids", ParamType::Pointer, "the full page lists' pages"),
    abi::param(
        "selected_offsets",
        ParamType::Pointer,
        "u32[rows + 1]: the chosen pages' lists, written",
    ),
    abi::param(
        "selected_ids",
        ParamType::Pointer,
        "u32[rows * budget]: the chosen pages of each row, ascending list order",
    ),
    abi::param(
        "rows",
        ParamType::U32,
        "(sequence, kv head) rows (one CTA each)",
    ),
    abi::param("budget", ParamType::U32, "pages a row keeps, at most"),
];

/// The selection kernels of one summary layout, query group and source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelectKernels {
    pub summarize: String,
    pub score: String,
    pub choose: String,
    pub summarize_threads: u32,
    /// Query heads per kv head the score kernel combines.
    pub group: u32,
    pub head_dim: u32,
    /// u16 values of one page's summary.
    pub summary_values: u32,
}

const SCORE_THREADS: u32 = 128;
const CHOOSE_THREADS: u32 = 256;
/// Bins of one radix pass of `choose` (8 bits of the key).
const BINS: u32 = 256;

impl SelectKernels {
    /// One CTA per page encoder job.
    pub fn summarize_launch(&self, jobs: u32) -> Launch {
        Launch {
            grid: [jobs.max(1), 1, 1],
            block: [self.summarize_threads, 1, 1],
            shared_bytes: 0,
        }
    }

    /// `slices` CTAs per row, each scoring every `slices`-th block of its
    /// row's pages; the group's queries in shared memory.
    pub fn score_launch(&self, slices: u32, rows: u32) -> Launch {
        Launch {
            grid: [slices.max(1), rows.max(1), 1],
            block: [SCORE_THREADS, 1, 1],
            shared_bytes: 4 * self.group * self.head_dim,
        }
    }

    /// One CTA per row.
    pub fn choose_launch(&self, rows: u32) -> Launch {
        Launch {
            grid: [rows.max(1), 1, 1],
            block: [CHOOSE_THREADS, 1, 1],
            shared_bytes: 4 * (BINS + 4 + 2 * (CHOOSE_THREADS / 32)),
        }
    }

    /// Pages one score CTA covers per pass.
    pub fn score_threads(&self) -> u32 {
        SCORE_THREADS
    }
}

/// The module of `summary`'s kernels for query groups of `group` heads,
/// reading exact keys laid out as `source`.
pub fn kernels(
    name: &str,
    summary: &SummaryLayout,
    source: &DenseSource,
    group: u32,
) -> (Vec<String>, SelectKernels) {
    let names = SelectKernels {
        summarize: format!("{name}_summarize"),
        score: format!("{name}_score_g{group}"),
        choose: format!("{name}_choose"),
        summarize_threads: summary.head_dim.div_ceil(32).clamp(1, 4) * 32,
        group,
        head_dim: summary.head_dim,
        summary_values: summary.values() as u32,
    };
    let entries = vec![
        summarize(summary, source, &names),
        score(summary, &names),
        choose(&names),
    ];
    (entries, names)
}

/// `f32` bits as a key whose unsigned order is `f32::total_cmp`'s.
fn order_key(k: &mut Kernel, bits: Reg<U32>) -> Reg<U32> {
    let sign: Reg<S32> = k.bfe_s32(bits, 31u32, 1u32);
    let mask: Reg<U32> = k.bitcast(sign);
    let mask = k.or(mask, 0x8000_0000u32);
    k.xor(bits, mask)
}

/// The `f32` whose [`order_key`] is `key`.
fn from_order_key(k: &mut Kernel, key: Reg<U32>) -> Reg<F32> {
    let top: Reg<S32> = k.bfe_s32(key, 31u32, 1u32);
    let top: Reg<U32> = k.bitcast(top);
    let mask = k.xor(top, 0xffff_ffffu32);
    let mask = k.or(mask, 0x8000_0000u32);
    let bits = k.xor(key, mask);
    k.bitcast(bits)
}

/// The 32-bit word `index` of the array at `base`.
fn load<T: Bits32>(k: &mut Kernel, base: Reg<U64>, index: Reg<U32>) -> Reg<T> {
    let at = Global::at(k.global_index(base, index, 4));
    k.ld_global_nc(at)
}

fn summarize(s: &SummaryLayout, source: &DenseSource, names: &SelectKernels) -> String {
    let threads = names.summarize_threads;
    let mut k = Kernel::new(&names.summarize, threads, SHARED_SYMBOL);
    let mut params = SUMMARIZE_PARAMS.iter().map(|p| p.name);
    let mut next = || {
        params
            .next()
            .expect("SUMMARIZE_PARAMS lists every parameter")
    };
    let summaries = k.param::<U64>(next());
    let pool = k.param::<U64>(next());
    let jobs = k.param::<U64>(next());
    let job_count = k.param::<U32>(next());
    let d = s.head_dim;
    let tid = k.tid_x();
    let job = k.ctaid(Axis::X);
    let job_count = k.ld_param(&job_count);
    let exit = k.label();
    let past = k.setp(Cmp::Ge, job, job_count);
    k.bra_if(past, true, exit);
    let jobs = k.ld_pointer(&jobs);
    let word = k.mul(job, ENCODE_JOB_WORDS);
    let entry = Global::at(k.global_index(jobs, word, 4));
    let source_page = k.ld_global_nc::<U32>(entry);
    let target_page = k.ld_global_nc::<U32>(entry.plus(4));
    let pool = k.ld_pointer(&pool);
    let page = k.global_index(pool, source_page, source.page_bytes);
    let summaries = k.ld_pointer(&summaries);
    let out = k.global_index(summaries, target_page, s.bytes());
    let items = source.items;
    for c0 in (0..d).step_by(threads as usize) {
        let c = k.add(tid, c0);
        let skip = k.label();
        let outside = k.setp(Cmp::Ge, c, d);
        k.bra_if(outside, true, skip);
        let channel = k.global_index(page, c, 2);
        let channel = Global::at(channel).plus(i64::from(source.key_offset));
        let key = |k: &mut Kernel, t: u32| -> Reg<F32> {
            let at = channel.plus(i64::from(t * source.key_stride));
            load_source_value(k, at, source.dtype)
        };
        let out_channel = Global::at(k.global_index(out, c, 2));
        match s.method {
            SelectMethod::Quest => {
                k.comment("quest: the channel's least and greatest key (total order)");
                let lo = k.mov(0xffff_ffffu32);
                let hi = k.mov(0u32);
                for t in 0..items {
                    let x = key(&mut k, t);
                    let bits: Reg<U32> = k.bitcast(x);
                    let ordered = order_key(&mut k, bits);
                    let (l, h) = (k.min(lo, ordered), k.max(hi, ordered));
                    k.assign(lo, l);
                    k.assign(hi, h);
                }
                let limit = f32::from(half::f16::MAX);
                for (ordered, row, up) in [(lo, 0u32, false), (hi, 1, true)] {
                    let x = from_order_key(&mut k, ordered);
                    let x = k.max(x, -limit);
                    let x = k.min(x, limit);
                    let bits: Reg<B16> = match up {
                        true => k.f32_to_f16_up(x),
                        false => k.f32_to_f16_down(x),
                    };
                    k.st_global_b16(out_channel.plus(i64::from(2 * row * d)), bits);
                }
            }
            SelectMethod::BlockMean => {
                k.comment("block mean: each block's keys summed in token order");
                for b in 0..s.rows {
                    let sum = k.mov(0.0f32);
                    for t in b * s.block..(b + 1) * s.block {
                        let x = key(&mut k, t);
                        k.add_to(sum, sum, x);
                    }
                    let mean = k.div_f32(sum, s.block as f32);
                    let bits = k.f32_to_f16(mean);
                    k.st_global_b16(out_channel.plus(i64::from(2 * b * d)), bits);
                }
            }
        }
        k.place(skip);
    }
    k.place(exit);
    k.ret();
    k.finish()
}

/// Channels a score thread loads at once: eight f16 (16 bytes) where rows
/// stay 16-byte aligned, else one.
fn chunk(head_dim: u32) -> u32 {
    if head_dim.is_multiple_of(8) {
        8
    } else {
        1
    }
}

/// `count` f16 of a summary row from `at`, widened.
fn load_halves(k: &mut Kernel, at: Global, count: u32) -> Vec<Reg<F32>> {
    match count {
        8 => {
            let words = k.ld_global_nc_v4::<U32>(at);
            let mut out = Vec::with_capacity(8);
            for w in words {
                let (lo, hi) = k.split_halves(w);
                out.push(k.f16_to_f32(lo));
                out.push(k.f16_to_f32(hi));
            }
            out
        }
        _ => {
            let half = k.ld_global_nc_narrow(at, 16);
            let bits = k.low16(half);
            vec![k.f16_to_f32(bits)]
        }
    }
}

fn score(s: &SummaryLayout, names: &SelectKernels) -> String {
    let mut k = Kernel::new(&names.score, SCORE_THREADS, SHARED_SYMBOL);
    let mut params = SCORE_PARAMS.iter().map(|p| p.name);
    let mut next = || params.next().expect("SCORE_PARAMS lists every parameter");
    let summaries = k.param::<U64>(next());
    let queries = k.param::<U64>(next());
    let offsets = k.param::<U64>(next());
    let ids = k.param::<U64>(next());
    let scores = k.param::<U64>(next());
    let rows = k.param::<U32>(next());
    let kv_heads = k.param::<U32>(next());
    let (d, group) = (s.head_dim, names.group);
    let tid = k.tid_x();
    let slice = k.ctaid(Axis::X);
    let row = k.ctaid(Axis::Y);
    let rows = k.ld_param(&rows);
    let exit = k.label();
    let past = k.setp(Cmp::Ge, row, rows);
    k.bra_if(past, true, exit);
    k.comment("the row's query heads into shared memory");
    let kv_heads = k.ld_param(&kv_heads);
    let sequence = k.div_u32(row, kv_heads);
    let head = k.rem_u32(row, kv_heads);
    let heads = k.mul(kv_heads, group);
    let first = k.mad_lo(sequence, heads, 0u32);
    let first_head = k.mad_lo(head, group, first);
    let first_value = k.mul(first_head, d);
    let queries = k.ld_pointer(&queries);
    let smem = k.shared_base();
    let (values, step) = (k.mov(group * d), k.mov(SCORE_THREADS));
    k.counted(tid, values, step, |k, i| {
        let at = k.add(first_value, i);
        let q = load::<F32>(k, queries, at);
        let to = k.mad_lo(i, 4u32, smem);
        k.st_shared(Shared::at(to), q);
    });
    k.bar_sync();
    let offsets = k.ld_pointer(&offsets);
    let at = Global::at(k.global_index(offsets, row, 4));
    let begin = k.ld_global_nc::<U32>(at);
    let end = k.ld_global_nc::<U32>(at.plus(4));
    let slices = k.nctaid(Axis::X);
    let stride = k.mul(slices, SCORE_THREADS);
    let start = k.mad_lo(slice, SCORE_THREADS, begin);
    let start = k.add(start, tid);
    let (ids, summaries, scores) = (
        k.ld_pointer(&ids),
        k.ld_pointer(&summaries),
        k.ld_pointer(&scores),
    );
    k.counted(start, end, stride, |k, entry| {
        let page = load::<U32>(k, ids, entry);
        let summary = k.global_index(summaries, page, s.bytes());
        let total = page_score(k, s, group, summary, smem);
        let bits: Reg<U32> = k.bitcast(total);
        let key = order_key(k, bits);
        let to = Global::at(k.global_index(scores, entry, 4));
        k.st_global(to, key);
    });
    k.place(exit);
    k.ret();
    k.finish()
}

/// One page's score (`select::score`) from its summary at `summary` and the
/// group's queries at shared `smem` (`[head][head_dim]` f32).
fn page_score(
    k: &mut Kernel,
    s: &SummaryLayout,
    group: u32,
    summary: Reg<U64>,
    smem: Reg<U32>,
) -> Reg<F32> {
    let d = s.head_dim;
    let width = chunk(d);
    let query = |k: &mut Kernel, h: u32, c: u32| -> Reg<F32> {
        k.ld_shared::<F32>(Shared::at(smem).plus(i64::from(4 * (h * d + c))))
    };
    let heads: Vec<Reg<F32>> = match s.method {
        SelectMethod::Quest => {
            let sums: Vec<Reg<F32>> = (0..group).map(|_| k.mov(0.0f32)).collect();
            for c0 in (0..d).step_by(width as usize) {
                let row = |r: u32| Global::at(summary).plus(i64::from(2 * (r * d + c0)));
                let lo = load_halves(k, row(0), width);
                let hi = load_halves(k, row(1), width);
                for (h, &sum) in sums.iter().enumerate() {
                    for (j, (&lo, &hi)) in lo.iter().zip(&hi).enumerate() {
                        // max(q lo, q hi) is q times the bound its sign picks.
                        let q = query(k, h as u32, c0 + j as u32);
                        let up = k.setp(Cmp::Ge, q, 0.0f32);
                        let bound = k.selp(hi, lo, up);
                        let product = k.mul(q, bound);
                        k.add_to(sum, sum, product);
                    }
                }
            }
            sums
        }
        SelectMethod::BlockMean => {
            // Blocks in a loop: unrolled, ptxas hoists every block's loads.
            let best: Vec<Reg<F32>> = (0..group).map(|_| k.mov(f32::NEG_INFINITY)).collect();
            let (first, blocks) = (k.mov(0u32), k.mov(s.rows));
            k.counted(first, blocks, 1u32, |k, b| {
                let row = k.mul(b, 2 * d);
                let row = k.u32_to_u64(row);
                let row = k.add(summary, row);
                let sums: Vec<Reg<F32>> = (0..group).map(|_| k.mov(0.0f32)).collect();
                for c0 in (0..d).step_by(width as usize) {
                    let at = Global::at(row).plus(i64::from(2 * c0));
                    let mean = load_halves(k, at, width);
                    for (h, &sum) in sums.iter().enumerate() {
                        for (j, &m) in mean.iter().enumerate() {
                            let q = query(k, h as u32, c0 + j as u32);
                            let product = k.mul(q, m);
                            k.add_to(sum, sum, product);
                        }
                    }
                }
                for (&best, &sum) in best.iter().zip(&sums) {
                    let m = k.max(best, sum);
                    k.assign(best, m);
                }
            });
            best
        }
    };
    let total = match s.group {
        GroupScore::Max => k.mov(f32::NEG_INFINITY),
        GroupScore::Sum => k.mov(0.0f32),
    };
    for h in heads {
        let next = match s.group {
            GroupScore::Max => k.max(total, h),
            GroupScore::Sum => k.add(total, h),
        };
        k.assign(total, next);
    }
    total
}

/// Shared words of `choose`: the histogram, then the pass state, then two
/// scans' warp totals.
const STATE: u32 = BINS;
const PREFIX: u32 = STATE;
const WANT: u32 = STATE + 1;
const BASE: u32 = STATE + 2;
const TOTALS: u32 = STATE + 4;

/// The sum of `x` over lanes `0..=lane` of the warp (all 32 lanes take part).
fn warp_inclusive_sum(k: &mut Kernel, x: Reg<U32>, lane: Reg<U32>) -> Reg<U32> {
    let inclusive = k.mov(x);
    for step in [1u32, 2, 4, 8, 16] {
        let from = k.max(lane, step);
        let from = k.sub(from, step);
        let got = k.shfl_idx(inclusive, from);
        let inside = k.setp(Cmp::Ge, lane, step);
        let got = k.selp(got, 0u32, inside);
        k.add_to(inclusive, inclusive, got);
    }
    inclusive
}

/// The exclusive prefix sum over the CTA's threads (thread order) of `x`,
/// and the total, through `TOTALS`-area words from `area`.
fn block_scan(
    k: &mut Kernel,
    x: Reg<U32>,
    tid: Reg<U32>,
    smem: Reg<U32>,
    area: u32,
) -> (Reg<U32>, Reg<U32>) {
    let warps = CHOOSE_THREADS / 32;
    let lane = k.and(tid, 31u32);
    let warp = k.shr(tid, 5u32);
    let inclusive = warp_inclusive_sum(k, x, lane);
    let last = k.setp(Cmp::Eq, lane, 31u32);
    let slot = k.mad_lo(warp, 4u32, smem);
    k.guarded(last, true, |k| {
        k.st_shared(Shared::at(slot).plus(i64::from(4 * area)), inclusive)
    });
    k.bar_sync();
    let (before, total) = (k.mov(0u32), k.mov(0u32));
    for w in 0..warps {
        let t = k.ld_shared::<U32>(Shared::at(smem).plus(i64::from(4 * (area + w))));
        let earlier = k.setp(Cmp::Gt, warp, w);
        let add = k.selp(t, 0u32, earlier);
        k.add_to(before, before, add);
        k.add_to(total, total, t);
    }
    let exclusive = k.add(before, inclusive);
    let exclusive = k.sub(exclusive, x);
    (exclusive, total)
}

fn choose(names: &SelectKernels) -> String {
    let mut k = Kernel::new(&names.choose, CHOOSE_THREADS, SHARED_SYMBOL);
    let mut params = CHOOSE_PARAMS.iter().map(|p| p.name);
    let mut next = || params.next().expect("CHOOSE_PARAMS lists every parameter");
    let scores = k.param::<U64>(next());
    let offsets = k.param::<U64>(next());
    let ids = k.param::<U64>(next());
    let selected_offsets = k.param::<U64>(next());
    let selected_ids = k.param::<U64>(next());
    let rows = k.param::<U32>(next());
    let budget = k.param::<U32>(next());
    let tid = k.tid_x();
    let row = k.ctaid(Axis::X);
    let rows = k.ld_param(&rows);
    let budget = k.ld_param(&budget);
    let exit = k.label();
    let past = k.setp(Cmp::Ge, row, rows);
    k.bra_if(past, true, exit);
    let smem = k.shared_base();
    let word = |w: u32| Shared::at(smem).plus(i64::from(4 * w));
    let (offsets, ids, scores) = (
        k.ld_pointer(&offsets),
        k.ld_pointer(&ids),
        k.ld_pointer(&scores),
    );
    let at = Global::at(k.global_index(offsets, row, 4));
    let begin = k.ld_global_nc::<U32>(at);
    let end = k.ld_global_nc::<U32>(at.plus(4));
    let n = k.sub(end, begin);
    let first = k.setp(Cmp::Eq, tid, 0u32);
    k.guarded(first, true, |k| k.st_shared(word(BASE), 0u32));
    k.bar_sync();
    k.comment("where this row's list starts: the earlier rows' kept pages");
    let kept = k.mov(0u32);
    let step = k.mov(CHOOSE_THREADS);
    k.counted(tid, row, step, |k, r| {
        let at = Global::at(k.global_index(offsets, r, 4));
        let (a, b) = (k.ld_global_nc::<U32>(at), k.ld_global_nc::<U32>(at.plus(4)));
        let count = k.sub(b, a);
        let count = k.min(count, budget);
        k.add_to(kept, kept, count);
    });
    k.red_shared_add(word(BASE), kept);
    k.bar_sync();
    let base = k.ld_shared::<U32>(word(BASE));
    let count = k.min(n, budget);
    let selected_offsets = k.ld_pointer(&selected_offsets);
    let selected_ids = k.ld_pointer(&selected_ids);
    k.guarded(first, true, |k| {
        let at = Global::at(k.global_index(selected_offsets, row, 4));
        let end = k.add(base, count);
        k.st_global(at.plus(4), end);
    });
    let first_of_all = k.setp(Cmp::Eq, row, 0u32);
    let first_of_all = k.and_pred(first_of_all, first);
    k.guarded(first_of_all, true, |k| {
        k.st_global(Global::at(selected_offsets), 0u32)
    });
    let out = k.global_index(selected_ids, base, 4);
    let (all, done) = (k.label(), k.label());
    let fits = k.setp(Cmp::Le, n, budget);
    k.bra_if(fits, true, all);

    k.comment("the budget-th greatest key, 8 bits a pass (radix select)");
    k.guarded(first, true, |k| {
        k.st_shared(word(PREFIX), 0u32);
        k.st_shared(word(WANT), budget);
    });
    let from = k.add(begin, tid);
    for shift in [24u32, 16, 8, 0] {
        let bin_at = k.mad_lo(tid, 4u32, smem);
        k.st_shared(Shared::at(bin_at), 0u32);
        k.bar_sync();
        let prefix = k.ld_shared::<U32>(word(PREFIX));
        let high = k.shr(prefix, shift + 8);
        k.counted(from, end, step, |k, e| {
            let key = load::<U32>(k, scores, e);
            let key_high = k.shr(key, shift + 8);
            let same = k.setp(Cmp::Eq, key_high, high);
            let bin = k.bfe_u32(key, shift, 8u32);
            let bin_at = k.mad_lo(bin, 4u32, smem);
            k.guarded(same, true, |k| k.red_shared_add(Shared::at(bin_at), 1u32));
        });
        k.bar_sync();
        k.comment("warp 0: lane l holds bins 255 - 8l down to 248 - 8l");
        let warp0 = k.setp(Cmp::Lt, tid, 32u32);
        let skip = k.label();
        k.bra_if(warp0, false, skip);
        let want = k.ld_shared::<U32>(word(WANT));
        let top = k.mov(BINS - 1);
        let eight = k.shl(tid, 3u32);
        let lane_top = k.sub(top, eight);
        let mut counts = Vec::with_capacity(8);
        let lane_sum = k.mov(0u32);
        for j in 0..8u32 {
            let bin = k.sub(lane_top, j);
            let at = k.mad_lo(bin, 4u32, smem);
            let h = k.ld_shared::<U32>(Shared::at(at));
            k.add_to(lane_sum, lane_sum, h);
            counts.push((bin, h));
        }
        let inclusive = warp_inclusive_sum(&mut k, lane_sum, tid);
        // Every lane has read `want` and the bins before the owner rewrites them.
        k.bar_warp_sync();
        let below = k.sub(inclusive, lane_sum);
        let reaches = k.setp(Cmp::Ge, inclusive, want);
        let short = k.setp(Cmp::Lt, below, want);
        let mine = k.and_pred(reaches, short);
        let owner = k.label();
        k.bra_if(mine, false, owner);
        let cum = k.mov(below);
        let found = k.mov(false);
        for (bin, h) in counts {
            let with = k.add(cum, h);
            let hit = k.setp(Cmp::Ge, with, want);
            let not_found = k.not_pred(found);
            let here = k.and_pred(hit, not_found);
            k.guarded(here, true, |k| {
                let prefix = k.ld_shared::<U32>(word(PREFIX));
                let bits = k.shl(bin, shift);
                let prefix = k.or(prefix, bits);
                k.st_shared(word(PREFIX), prefix);
                let left = k.sub(want, cum);
                k.st_shared(word(WANT), left);
            });
            let f = k.or_pred(found, here);
            k.assign(found, f);
            k.assign(cum, with);
        }
        k.place(owner);
        k.place(skip);
        k.bar_sync();
    }
    let threshold = k.ld_shared::<U32>(word(PREFIX));
    let want = k.ld_shared::<U32>(word(WANT));

    k.comment("keep keys above the threshold and its first `want` ties, in list order");
    let per = k.add(n, CHOOSE_THREADS - 1);
    let per = k.div_u32(per, CHOOSE_THREADS);
    let lo = k.mad_lo(tid, per, 0u32);
    let lo = k.min(lo, n);
    let hi = k.add(lo, per);
    let hi = k.min(hi, n);
    let (lo, hi) = (k.add(lo, begin), k.add(hi, begin));
    let (greater, equal) = (k.mov(0u32), k.mov(0u32));
    let one = k.mov(1u32);
    k.counted(lo, hi, one, |k, e| {
        let key = load::<U32>(k, scores, e);
        let gt = k.setp(Cmp::Gt, key, threshold);
        let eq = k.setp(Cmp::Eq, key, threshold);
        let g = k.selp(1u32, 0u32, gt);
        let q = k.selp(1u32, 0u32, eq);
        k.add_to(greater, greater, g);
        k.add_to(equal, equal, q);
    });
    let (ties_before, _) = block_scan(&mut k, equal, tid, smem, TOTALS);
    let left = k.max(want, ties_before);
    let left = k.sub(left, ties_before);
    let ties = k.min(left, equal);
    let mine = k.add(greater, ties);
    let (at, _) = block_scan(&mut k, mine, tid, smem, TOTALS + CHOOSE_THREADS / 32);
    let slot = k.mov(at);
    k.counted(lo, hi, one, |k, e| {
        let key = load::<U32>(k, scores, e);
        let gt = k.setp(Cmp::Gt, key, threshold);
        let eq = k.setp(Cmp::Eq, key, threshold);
        let spare = k.setp(Cmp::Gt, ties, 0u32);
        let tie = k.and_pred(eq, spare);
        let keep = k.or_pred(gt, tie);
        let used = k.selp(1u32, 0u32, tie);
        let fewer = k.sub(ties, used);
        k.assign(ties, fewer);
        let page = load::<U32>(k, ids, e);
        let to = Global::at(k.global_index(out, slot, 4));
        k.guarded(keep, true, |k| k.st_global(to, page));
        let step = k.selp(1u32, 0u32, keep);
        k.add_to(slot, slot, step);
    });
    k.bra(done);

    k.place(all);
    k.comment("at most a budget of pages: every one, in list order");
    k.counted(tid, n, step, |k, i| {
        let e = k.add(begin, i);
        let page = load::<U32>(k, ids, e);
        let to = Global::at(k.global_index(out, i, 4));
        k.st_global(to, page);
    });
    k.place(done);
    k.place(exit);
    k.ret();
    k.finish()
}
