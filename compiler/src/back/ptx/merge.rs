//! The merge kernel: the log-sum-exp combination of every partial of a
//! (sequence, query head) — across tiers and splits — into the output, the
//! same merge as the interpreter's:
//! `out = Σ_s exp(m_s − M) · out_s / Σ_s exp(m_s − M) · l_s` over the partials
//! with `l_s > 0`, `M` their largest `m`; zeros when there is none. Each of
//! [`MERGE_GROUPS`] thread groups folds its share of the slots in one pass
//! with a running `M` (sums rescaled when it grows), a group of records
//! loaded at once; the first group then folds the others' states from shared
//! memory. A row waits on a few load latencies instead of three dependent
//! loads per slot: one where it has at most `MERGE_GROUPS · SLOTS_IN_FLIGHT`
//! slots (a batch-1 step of many splits).

use super::abi::{ParamType, PartialLayout, MERGE_PARAMS, SHARED_SYMBOL};
use super::builder::{Axis, Cmp, Global, Kernel, Pred, Reg, Shared, F32, U32, U64};

/// Slots whose records a thread loads together: their loads are in flight
/// at once.
const SLOTS_IN_FLIGHT: u32 = 16;

/// Thread groups of a merge CTA, each folding every `MERGE_GROUPS`-th run of
/// [`SLOTS_IN_FLIGHT`] slots.
pub const MERGE_GROUPS: u32 = 4;

/// The block of a merge kernel: [`MERGE_GROUPS`] groups of `group_threads`
/// threads, each group covering the head's channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergeShape {
    pub head_dim: u32,
    pub group_threads: u32,
}

impl MergeShape {
    pub fn threads(&self) -> u32 {
        MERGE_GROUPS * self.group_threads
    }

    fn channels_per_thread(&self) -> u32 {
        self.head_dim.div_ceil(self.group_threads)
    }

    /// Floats a thread leaves for the first group: its `M`, its sum and its
    /// channels' sums.
    fn state_floats(&self) -> u32 {
        2 + self.channels_per_thread()
    }

    /// Dynamic shared memory: every thread's state, laid out
    /// `[group][field][thread of the group]` (consecutive threads, consecutive banks).
    pub fn shared_bytes(&self) -> u32 {
        4 * MERGE_GROUPS * self.state_floats() * self.group_threads
    }
}

/// One partial record of a group, its fields read under `inside`.
struct Slot {
    max: Reg<F32>,
    sum: Reg<F32>,
    values: Vec<Reg<F32>>,
    /// Whether the partial exists and saw any item (`l > 0`).
    live: Reg<Pred>,
}

impl Slot {
    fn new(k: &mut Kernel, max: Reg<F32>, sum: Reg<F32>, values: Vec<Reg<F32>>) -> Slot {
        let live = k.setp(Cmp::Gt, sum, 0.0f32);
        Slot {
            max,
            sum,
            values,
            live,
        }
    }
}

/// `dst = p ? value : dst`.
fn update_if(k: &mut Kernel, dst: Reg<F32>, value: Reg<F32>, p: Reg<Pred>) {
    let chosen = k.selp(value, dst, p);
    k.assign(dst, chosen);
}

/// Loads slot `s` of the row (a dead slot: m = −∞, l = 0 and values 0 when
/// `s` is past the row's slots).
fn load_slot(
    k: &mut Kernel,
    records: Reg<U64>,
    s: Reg<U32>,
    slots: Reg<U32>,
    channels: &[Reg<U32>],
    layout: &PartialLayout,
) -> Slot {
    let inside = k.setp(Cmp::Lt, s, slots);
    let record = Global::at(k.global_index(records, s, 4 * layout.record));
    let max = k.mov(f32::NEG_INFINITY);
    let sum = k.mov(0.0f32);
    let values: Vec<Reg<F32>> = channels.iter().map(|_| k.mov(0.0f32)).collect();
    let addresses: Vec<Global> = channels
        .iter()
        .map(|&d| Global::at(k.global_index(record.base, d, 4)))
        .collect();
    k.guarded(inside, true, |k| {
        k.ld_global_nc_to(max, record.plus(4 * i64::from(layout.max_offset())));
        k.ld_global_nc_to(sum, record.plus(4 * i64::from(layout.sum_offset())));
        for (&v, &at) in values.iter().zip(&addresses) {
            k.ld_global_nc_to(v, at);
        }
    });
    Slot::new(k, max, sum, values)
}

/// A running merge: the largest `m` so far, `Σ l · exp(m − M)` and the
/// channels' `Σ exp(m − M) · out`.
struct Running {
    best: Reg<F32>,
    total: Reg<F32>,
    acc: Vec<Reg<F32>>,
}

impl Running {
    fn new(k: &mut Kernel, channels: usize) -> Running {
        Running {
            best: k.mov(f32::NEG_INFINITY),
            total: k.mov(0.0f32),
            acc: (0..channels).map(|_| k.mov(0.0f32)).collect(),
        }
    }

    /// Folds `records` in (a group's state is a record of the same form:
    /// its `M`, its sums): `M` grows once, then each live record adds in.
    fn fold(&self, k: &mut Kernel, records: &[Slot]) {
        let next = k.mov(self.best);
        for slot in records {
            let larger = k.max(next, slot.max);
            update_if(k, next, larger, slot.live);
        }
        // Equal references (−∞ before any live slot) keep the sums as they are.
        let decay = k.exp_diff(self.best, next);
        let same = k.setp(Cmp::Eq, self.best, next);
        let decay = k.selp(1.0f32, decay, same);
        k.mul_to(self.total, self.total, decay);
        for &o in &self.acc {
            k.mul_to(o, o, decay);
        }
        for slot in records {
            let w = k.exp_diff(slot.max, next);
            let term = k.mul(slot.sum, w);
            let sum = k.add(self.total, term);
            update_if(k, self.total, sum, slot.live);
            for (&o, &x) in self.acc.iter().zip(&slot.values) {
                let term = k.mul(w, x);
                let sum = k.add(o, term);
                update_if(k, o, sum, slot.live);
            }
        }
        k.assign(self.best, next);
    }

    /// Its floats, in [`MergeShape::shared_bytes`]' order.
    fn floats(&self) -> Vec<Reg<F32>> {
        [self.best, self.total]
            .into_iter()
            .chain(self.acc.iter().copied())
            .collect()
    }
}

/// The merge kernel; with `dependent`, it may be launched before the decode
/// kernels finish (programmatic dependent launch) and waits for their
/// partials after its setup.
pub fn merge(shape: MergeShape, name: &str, dependent: bool) -> String {
    let MergeShape {
        head_dim,
        group_threads,
    } = shape;
    let mut k = Kernel::new(name, shape.threads(), SHARED_SYMBOL);
    let mut params = MERGE_PARAMS.iter();
    let mut take = |ty: ParamType| {
        let p = params.next().expect("MERGE_PARAMS lists every parameter");
        assert_eq!(p.ty, ty, "parameter {}", p.name);
        p.name
    };
    let partials = k.param::<U64>(take(ParamType::Pointer));
    let output = k.param::<U64>(take(ParamType::Pointer));
    let lse = k.param::<U64>(take(ParamType::Pointer));
    let q_heads = k.param::<U32>(take(ParamType::U32));
    let slot_count = k.param::<U32>(take(ParamType::U32));

    let layout = PartialLayout::new(head_dim);
    let tid = k.tid_x();
    let group = k.div_u32(tid, group_threads);
    let lane = k.rem_u32(tid, group_threads);
    let q_head = k.ctaid(Axis::X);
    let sequence = k.ctaid(Axis::Y);
    let partials = k.ld_pointer(&partials);
    let output = k.ld_pointer(&output);
    let lse = k.ld_pointer(&lse);
    let q_heads = k.ld_param(&q_heads);
    let slots = k.ld_param(&slot_count);
    let row = k.mad_lo(sequence, q_heads, q_head);
    let first = k.mul(row, slots);
    let records = k.global_index(partials, first, 4 * layout.record);

    let per_thread = shape.channels_per_thread();
    let channels: Vec<Reg<U32>> = (0..per_thread)
        .map(|c| {
            let d = k.add(lane, c * group_threads);
            k.min(d, head_dim - 1)
        })
        .collect();
    if dependent {
        k.comment("the decode kernels' partials are complete and visible");
        k.wait_for_prerequisites();
    }
    k.comment("each group, one pass over its runs of SLOTS_IN_FLIGHT records: running M,");
    k.comment("total = sum of l * exp(m - M) and acc = sum of exp(m - M) * out_s");
    let running = Running::new(&mut k, channels.len());
    let s = k.mul(group, SLOTS_IN_FLIGHT);
    let (top, end) = (k.label(), k.label());
    k.place(top);
    let done = k.setp(Cmp::Ge, s, slots);
    k.bra_if(done, true, end);
    let run: Vec<Slot> = (0..SLOTS_IN_FLIGHT)
        .map(|j| {
            let at = k.add(s, j);
            load_slot(&mut k, records, at, slots, &channels, &layout)
        })
        .collect();
    running.fold(&mut k, &run);
    k.add_to(s, s, MERGE_GROUPS * SLOTS_IN_FLIGHT);
    k.bra(top);
    k.place(end);

    k.comment("the other groups' states, folded by the first");
    let fields = shape.state_floats();
    let base = k.shared_base();
    let lane_at = k.mad_lo(lane, 4u32, base);
    // Field `f` of group `g`'s thread `lane`.
    let field_at =
        |g: u32, f: u32| Shared::at(lane_at).plus(i64::from(4 * (g * fields + f) * group_threads));
    let own = k.mad_lo(group, 4 * fields * group_threads, lane_at);
    for (f, value) in (0u32..).zip(running.floats()) {
        k.st_shared(
            Shared::at(own).plus(i64::from(4 * f * group_threads)),
            value,
        );
    }
    k.bar_sync();
    let first_group = k.setp(Cmp::Eq, group, 0u32);
    let folds = k.label();
    k.bra_if(first_group, true, folds);
    k.ret();
    k.place(folds);
    let others: Vec<Slot> = (1..MERGE_GROUPS)
        .map(|g| {
            let mut at = |f| k.ld_shared::<F32>(field_at(g, f));
            let (max, sum) = (at(0), at(1));
            let values = (0..per_thread).map(|c| at(2 + c)).collect();
            Slot::new(&mut k, max, sum, values)
        })
        .collect();
    running.fold(&mut k, &others);
    let Running { best, total, acc } = running;

    k.comment("lse = M + ln(total): -inf when no partial saw an item (ln 0 = -inf)");
    let first_thread = k.setp(Cmp::Eq, tid, 0u32);
    let log2_total = k.lg2(total);
    let ln_total = k.mul(log2_total, std::f32::consts::LN_2);
    let row_lse = k.add(best, ln_total);
    let lse_at = Global::at(k.global_index(lse, row, 4));
    k.guarded(first_thread, true, |k| k.st_global(lse_at, row_lse));
    k.comment("out = acc / total; zeros when no partial saw an item");
    let any = k.setp(Cmp::Gt, total, 0.0f32);
    for &o in &acc {
        let scaled = k.div_f32(o, total);
        update_if(&mut k, o, scaled, any);
    }
    let out_row = k.mul(row, head_dim);
    for (c, &o) in acc.iter().enumerate() {
        let d = k.add(lane, c as u32 * group_threads);
        let element = k.add(out_row, d);
        let at = Global::at(k.global_index(output, element, 4));
        if (c as u32 + 1) * group_threads <= head_dim {
            k.st_global(at, o);
        } else {
            let inside = k.setp(Cmp::Lt, d, head_dim);
            k.guarded(inside, true, |k| k.st_global(at, o));
        }
    }
    k.ret();
    k.finish()
}
