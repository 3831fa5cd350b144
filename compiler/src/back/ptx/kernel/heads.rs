//! The per-head work outside the page loop: the softmax state and
//! accumulators set up, the group's queries loaded, and the key prologue and
//! value epilogue stages run for every head of the group.

use std::collections::HashSet;

use super::super::abi::TableBuffer;
use super::super::builder::{Cmp, Kernel, Op, Reg, Shared, F32, U32};
use super::super::expr::{self, ArrayAccess, Env, Replicas, TableAccess};
use super::super::streams::CHUNK;
use super::super::tensor_cores::WARP_LANES;
use super::cta::{divide, kept, Cta};
use super::softmax::ORDER_KEY_NEG_INF;
use crate::ir::{ArrayDecl, Handle, Stage};
use crate::proc::shared_reads;

/// The prologue, query and epilogue work of the group's heads.
#[derive(Clone, Copy)]
pub(super) struct Heads<'a> {
    pub(super) cta: &'a Cta<'a>,
}

impl Heads<'_> {
    pub(super) fn init_state(&self, k: &mut Kernel) {
        let plan = self.cta.plan;
        let neg_inf = k.mov(f32::NEG_INFINITY);
        let zero = k.mov(0.0f32);
        self.cta.per_word(k, plan.group_max, |k, at| {
            k.st_shared(Shared::at(at).plus(plan.max.into()), neg_inf);
            k.st_shared(Shared::at(at).plus(plan.sum.into()), zero);
        });
        if plan.fused_softmax {
            self.cta.per_word(k, plan.head_stride, |k, at| {
                k.st_shared(Shared::at(at).plus(plan.tile_max.into()), ORDER_KEY_NEG_INF);
            });
        }
        // Tensor-core accumulates store their totals after the stream
        // ([`AccumulateMma::store`](super::accumulate_mma::AccumulateMma::store)); the others add into the zeroed array.
        if plan.mma.is_none() {
            let acc = self.cta.m.value.accumulator.index();
            let words = plan.group_max * plan.array_stride[acc] / 4;
            self.cta.per_word(k, words, |k, at| {
                k.st_shared(Shared::at(at).plus(plan.arrays[acc].into()), zero);
            });
        }
    }

    /// Queries of the group's heads into their `query` arrays, 16 bytes a
    /// load. When thread 0 has just issued the first tile's bulk copies, it
    /// waited on a global load for the page id: the other warps load the
    /// queries, so that the CTA's barrier waits on one load latency, not two
    /// (each thread's loads in flight together).
    pub(super) fn load_queries(&self, k: &mut Kernel) {
        let plan = self.cta.plan;
        let issued = plan.prefetch && plan.barriers.is_some() && plan.warps > 1;
        let loaded = k.label();
        let (start, step) = match issued {
            true => {
                let first_warp = k.setp(Cmp::Lt, self.cta.tid, WARP_LANES);
                k.bra_if(first_warp, true, loaded);
                (k.sub(self.cta.tid, WARP_LANES), plan.threads - WARP_LANES)
            }
            false => (self.cta.tid, plan.threads),
        };
        let head_dim = self.cta.m.head_dim;
        let vectors = head_dim / 4;
        let query = self.cta.m.query.index();
        let stride = self.cta.plan.array_stride[query];
        let base = self.cta.array_base(k, query);
        let queries = k.ld_pointer(&self.cta.p.queries);
        let q_row = self.cta.q_row(k);
        let total = k.mul(self.cta.group, vectors);
        let factor = match issued {
            true => (plan.group_max * vectors)
                .div_ceil(step)
                .min(QUERY_LOADS_IN_FLIGHT),
            false => 1,
        };
        self.cta
            .strided_unrolled(k, start, Op::Reg(total), step, factor, |k, idx| {
                let (h, v) = divide(k, idx, vectors);
                let row = k.add(q_row, h);
                let four_v = k.shl(v, 2u32);
                let element = k.mad_lo(row, head_dim, four_v);
                let src = k.global_index(queries, element, 4);
                let src = kept(k, src);
                let values = k.ld_global_nc_v4::<F32>(src);
                let head = k.mad_lo(h, stride, base);
                let dst = k.mad_lo(v, CHUNK, head);
                k.st_shared_v4(Shared::at(dst), values);
            });
        k.place(loaded);
    }

    /// Runs kernel stages for every head of the group: iterations
    /// (head, iteration) strided over the CTA, a barrier after each stage.
    pub(super) fn stages(&self, k: &mut Kernel, stages: &[Stage], epilogue: bool) {
        if stages.is_empty() {
            return;
        }
        let base = self.cta.tables(k);
        let tables: Vec<Option<TableAccess>> = TableBuffer::of(self.cta.m)
            .offsets
            .iter()
            .map(|&at| {
                let ptr = k.add(base, u64::from(4 * at));
                Some(TableAccess::Global(ptr))
            })
            .collect();
        for stage in stages {
            let used = stage_arrays(stage);
            let bases: Vec<Option<(Reg<U32>, u32)>> = (self.cta.m.arrays.iter())
                .map(|(a, _)| {
                    let a = used.contains(&a).then_some(a.index())?;
                    Some((self.cta.array_base(k, a), self.cta.plan.array_stride[a]))
                })
                .collect();
            let iterations = stage.iterations;
            let total = k.mul(self.cta.group, iterations);
            self.cta.strided(
                k,
                self.cta.tid,
                Op::Reg(total),
                self.cta.plan.threads,
                |k, idx| {
                    let (h, iteration) = divide(k, idx, iterations);
                    let arrays: Vec<Option<ArrayAccess>> = bases
                        .iter()
                        .map(|b| {
                            b.map(|(base, stride)| ArrayAccess {
                                base: k.mad_lo(h, stride, base),
                                replica_stride: stride,
                            })
                        })
                        .collect();
                    let denominator = epilogue.then(|| {
                        let at = k.mad_lo(h, 4u32, self.cta.smem);
                        k.ld_shared::<F32>(Shared::at(at).plus(self.cta.plan.sum.into()))
                    });
                    let env = Env {
                        replicas: Replicas::One,
                        arrays: &arrays,
                        tables: &tables,
                        header: None,
                        item: None,
                        iteration: Some(iteration),
                        denominator,
                        preloaded: None,
                    };
                    let values = expr::emit(k, &stage.exprs, &env);
                    for store in &stage.stores {
                        let access = arrays[store.array.index()].expect("stored arrays are used");
                        let index = values.get(store.index, 0);
                        let value = values.get(store.value, 0);
                        expr::store(k, access, index, value);
                    }
                },
            );
            k.bar_sync();
        }
    }
}

/// Most query loads a thread keeps in flight before storing them.
pub(super) const QUERY_LOADS_IN_FLIGHT: u32 = 4;

/// Arrays a stage reads or writes.
pub(super) fn stage_arrays(stage: &Stage) -> HashSet<Handle<ArrayDecl>> {
    let mut used = shared_reads(&stage.exprs);
    used.extend(stage.stores.iter().map(|s| s.array));
    used
}
