//! The merge kernel: the log-sum-exp combination of every partial of a
//! (sequence, query head) — across tiers and splits — into the output, the
//! same merge as the interpreter's:
//! `out = Σ_s exp(m_s − M) · out_s / Σ_s exp(m_s − M) · l_s` over the partials
//! with `l_s > 0`, `M` their largest `m`; zeros when there is none. It is
//! computed in one pass with a running `M` (sums rescaled when it grows), a
//! group of records loaded at once, so a row waits on a few load latencies
//! instead of three dependent loads per slot.

use super::abi::{ParamType, PartialLayout, MERGE_PARAMS, SHARED_SYMBOL};
use super::builder::{Axis, Cmp, Global, Kernel, Pred, Reg, F32, U32, U64};

/// Slots whose records are loaded together: their loads are in flight at
/// once, so a row costs about `slots / SLOTS_IN_FLIGHT` load latencies.
const SLOTS_IN_FLIGHT: u32 = 16;

/// One partial record of a group, its fields read under `inside`.
struct Slot {
    max: Reg<F32>,
    sum: Reg<F32>,
    values: Vec<Reg<F32>>,
    /// Whether the partial exists and saw any item (`l > 0`).
    live: Reg<Pred>,
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
    let live = k.setp(Cmp::Gt, sum, 0.0f32);
    Slot {
        max,
        sum,
        values,
        live,
    }
}

/// The merge kernel; with `dependent`, it may be launched before the decode
/// kernels finish (programmatic dependent launch) and waits for their
/// partials after its setup.
pub fn merge(head_dim: u32, threads: u32, name: &str, dependent: bool) -> String {
    let mut k = Kernel::new(name, threads, SHARED_SYMBOL);
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

    let per_thread = head_dim.div_ceil(threads);
    let channels: Vec<Reg<U32>> = (0..per_thread)
        .map(|c| {
            let d = k.add(tid, c * threads);
            k.min(d, head_dim - 1)
        })
        .collect();
    if dependent {
        k.comment("the decode kernels' partials are complete and visible");
        k.wait_for_prerequisites();
    }
    k.comment("one pass, SLOTS_IN_FLIGHT records at a time: running M, then");
    k.comment("total = sum of l * exp(m - M) and acc = sum of exp(m - M) * out_s");
    let best = k.mov(f32::NEG_INFINITY);
    let total = k.mov(0.0f32);
    let acc: Vec<Reg<F32>> = channels.iter().map(|_| k.mov(0.0f32)).collect();
    let s = k.mov(0u32);
    let (top, end) = (k.label(), k.label());
    k.place(top);
    let done = k.setp(Cmp::Ge, s, slots);
    k.bra_if(done, true, end);
    let group: Vec<Slot> = (0..SLOTS_IN_FLIGHT)
        .map(|j| {
            let at = k.add(s, j);
            load_slot(&mut k, records, at, slots, &channels, &layout)
        })
        .collect();
    let next = k.mov(best);
    for slot in &group {
        let larger = k.max(next, slot.max);
        update_if(&mut k, next, larger, slot.live);
    }
    // Equal references (−∞ before any live slot) keep the sums as they are.
    let decay = k.exp_diff(best, next);
    let same = k.setp(Cmp::Eq, best, next);
    let decay = k.selp(1.0f32, decay, same);
    k.mul_to(total, total, decay);
    for &o in &acc {
        k.mul_to(o, o, decay);
    }
    for slot in &group {
        let w = k.exp_diff(slot.max, next);
        let term = k.mul(slot.sum, w);
        let sum = k.add(total, term);
        update_if(&mut k, total, sum, slot.live);
        for (&o, &x) in acc.iter().zip(&slot.values) {
            let term = k.mul(w, x);
            let sum = k.add(o, term);
            update_if(&mut k, o, sum, slot.live);
        }
    }
    k.assign(best, next);
    k.add_to(s, s, SLOTS_IN_FLIGHT);
    k.bra(top);
    k.place(end);
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
        let d = k.add(tid, c as u32 * threads);
        let element = k.add(out_row, d);
        let at = Global::at(k.global_index(output, element, 4));
        if (c as u32 + 1) * threads <= head_dim {
            k.st_global(at, o);
        } else {
            let inside = k.setp(Cmp::Lt, d, head_dim);
            k.guarded(inside, true, |k| k.st_global(at, o));
        }
    }
    k.ret();
    k.finish()
}
