//! The merge kernel: the log-sum-exp combination of every partial of a
//! (sequence, query head) — across tiers and splits — into the output, the
//! same merge as the interpreter's:
//! `out = Σ_s exp(m_s − M) · out_s / Σ_s exp(m_s − M) · l_s` over the partials
//! with `l_s > 0`, `M` their largest `m`; zeros when there is none.

use super::abi::{ParamType, PartialLayout, MERGE_PARAMS};
use super::builder::{Axis, Cmp, Global, Kernel, Pred, Reg, F32, U32, U64};
use super::skeleton::SHARED_SYMBOL;

/// One partial record inside a slot loop.
struct Slot {
    record: Global,
    max: Reg<F32>,
    sum: Reg<F32>,
    /// Whether the partial saw any item (`l > 0`).
    live: Reg<Pred>,
}

/// `for s in 0..slots { body(slot s) }` over the row's records.
fn for_each_slot(
    k: &mut Kernel,
    records: Reg<U64>,
    slots: Reg<U32>,
    layout: &PartialLayout,
    mut body: impl FnMut(&mut Kernel, &Slot),
) {
    let s = k.mov(0u32);
    let (top, end) = (k.label(), k.label());
    k.place(top);
    let done = k.setp(Cmp::Ge, s, slots);
    k.bra_if(done, true, end);
    let record = Global::at(k.global_index(records, s, 4 * layout.record));
    let max = k.ld_global_nc::<F32>(record.plus(4 * i64::from(layout.max_offset())));
    let sum = k.ld_global_nc::<F32>(record.plus(4 * i64::from(layout.sum_offset())));
    let live = k.setp(Cmp::Gt, sum, 0.0f32);
    body(
        k,
        &Slot {
            record,
            max,
            sum,
            live,
        },
    );
    k.add_to(s, s, 1u32);
    k.bra(top);
    k.place(end);
}

/// `dst = p ? value : dst`.
fn update_if(k: &mut Kernel, dst: Reg<F32>, value: Reg<F32>, p: Reg<Pred>) {
    let chosen = k.selp(value, dst, p);
    k.assign(dst, chosen);
}

pub fn merge(head_dim: u32, threads: u32, name: &str) -> String {
    let mut k = Kernel::new(name, threads, SHARED_SYMBOL);
    let mut params = MERGE_PARAMS.iter();
    let mut take = |ty: ParamType| {
        let p = params.next().expect("MERGE_PARAMS lists every parameter");
        assert_eq!(p.ty, ty, "parameter {}", p.name);
        p.name
    };
    let partials = k.param::<U64>(take(ParamType::Pointer));
    let output = k.param::<U64>(take(ParamType::Pointer));
    let q_heads = k.param::<U32>(take(ParamType::U32));
    let slot_count = k.param::<U32>(take(ParamType::U32));

    let layout = PartialLayout::new(head_dim);
    let tid = k.tid_x();
    let q_head = k.ctaid(Axis::X);
    let sequence = k.ctaid(Axis::Y);
    let partials = k.ld_pointer(&partials);
    let output = k.ld_pointer(&output);
    let q_heads = k.ld_param(&q_heads);
    let slots = k.ld_param(&slot_count);
    let row = k.mad_lo(sequence, q_heads, q_head);
    let first = k.mul(row, slots);
    let records = k.global_index(partials, first, 4 * layout.record);

    k.comment("M: the largest m of the partials that saw items");
    let best = k.mov(f32::NEG_INFINITY);
    for_each_slot(&mut k, records, slots, &layout, |k, slot| {
        let larger = k.max(best, slot.max);
        update_if(k, best, larger, slot.live);
    });
    k.comment("the denominator: sum of l * exp(m - M)");
    let total = k.mov(0.0f32);
    for_each_slot(&mut k, records, slots, &layout, |k, slot| {
        let w = k.exp_diff(slot.max, best);
        let term = k.mul(slot.sum, w);
        let sum = k.add(total, term);
        update_if(k, total, sum, slot.live);
    });
    k.comment("out = sum of exp(m - M) / total * out_s; each thread a static set of channels");
    let per_thread = head_dim.div_ceil(threads);
    let channels: Vec<Reg<U32>> = (0..per_thread)
        .map(|c| {
            let d = k.add(tid, c * threads);
            k.min(d, head_dim - 1)
        })
        .collect();
    let acc: Vec<Reg<F32>> = (0..per_thread).map(|_| k.mov(0.0f32)).collect();
    for_each_slot(&mut k, records, slots, &layout, |k, slot| {
        let e = k.exp_diff(slot.max, best);
        let w = k.div_f32(e, total);
        for (&d, &o) in channels.iter().zip(&acc) {
            let at = k.global_index(slot.record.base, d, 4);
            let x = k.ld_global_nc::<F32>(Global::at(at).plus(slot.record.offset));
            let term = k.mul(w, x);
            let sum = k.add(o, term);
            update_if(k, o, sum, slot.live);
        }
    });
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
