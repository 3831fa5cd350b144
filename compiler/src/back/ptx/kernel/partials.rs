//! The end of the kernel: each head's unnormalized output, running maximum
//! and sum written to the split's partial record, which the merge kernel
//! combines.

use super::super::abi::PartialLayout;
use super::super::builder::{Axis, Global, Kernel, Op, Reg, Shared, F32, U32};
use super::cta::{divide, Cta};

/// The partial records of the group's heads.
#[derive(Clone, Copy)]
pub(super) struct Partials<'a> {
    pub(super) cta: &'a Cta<'a>,
}

impl Partials<'_> {
    /// The group's partial records: the epilogue output, m and l (or, for a
    /// split without pages, zeros, -inf and 0).
    pub(super) fn write(&self, k: &mut Kernel, filled: bool) {
        let plan = self.cta.plan;
        let head_dim = self.cta.m.head_dim;
        let layout = PartialLayout::new(head_dim);
        let record_bytes = 4 * layout.record;
        let output = self.cta.m.value.output.index();
        let out_stride = plan.array_stride[output];
        let out0 = filled.then(|| self.cta.array_base(k, output));
        let zero = k.mov(0.0f32);
        let partials = k.ld_pointer(&self.cta.p.partials);
        let q_row = self.cta.q_row(k);
        let slot_count = k.ld_param(&self.cta.p.slot_count);
        let slot_base = k.ld_param(&self.cta.p.slot_base);
        let split = k.ctaid(Axis::X);
        let slot = k.add(slot_base, split);
        let record = |k: &mut Kernel, h: Reg<U32>| {
            let row = k.add(q_row, h);
            let index = k.mad_lo(row, slot_count, slot);
            k.global_index(partials, index, record_bytes)
        };
        let total = k.mul(self.cta.group, head_dim);
        self.cta
            .strided(k, self.cta.tid, Op::Reg(total), plan.threads, |k, idx| {
                let (h, d) = divide(k, idx, head_dim);
                let value = match out0 {
                    Some(base) => {
                        let head = k.mad_lo(h, out_stride, base);
                        let at = k.mad_lo(d, 4u32, head);
                        k.ld_shared::<F32>(Shared::at(at))
                    }
                    None => zero,
                };
                let rec = record(k, h);
                let at = k.global_index(rec, d, 4);
                k.st_global(Global::at(at), value);
            });
        let neg_inf = k.mov(f32::NEG_INFINITY);
        self.cta.strided(
            k,
            self.cta.tid,
            Op::Reg(self.cta.group),
            plan.threads,
            |k, h| {
                let (m, l) = if filled {
                    let state = k.mad_lo(h, 4u32, self.cta.smem);
                    (
                        k.ld_shared::<F32>(Shared::at(state).plus(plan.max.into())),
                        k.ld_shared::<F32>(Shared::at(state).plus(plan.sum.into())),
                    )
                } else {
                    (neg_inf, zero)
                };
                let rec = Global::at(record(k, h));
                k.st_global(rec.plus(4 * i64::from(layout.max_offset())), m);
                k.st_global(rec.plus(4 * i64::from(layout.sum_offset())), l);
            },
        );
    }
}
