//! Loads and stores in shared and global memory, `cp.async` copies, and the
//! bulk copies and mbarriers of sm_90.

use super::{Bits32, Evict, Global, Kernel, Op, Pred, Reg, Shared, Type, B16, U32, U64};

impl Kernel {
    // ---- memory -------------------------------------------------------------

    pub fn ld_shared<T: Bits32>(&mut self, at: Shared) -> Reg<T> {
        self.op(format_args!("ld.shared.{}", T::SUFFIX), &[&at])
    }
    /// Into `dst` (under a guard, a load that leaves `dst` as it was when the
    /// guard fails).
    pub fn ld_shared_to<T: Bits32>(&mut self, dst: Reg<T>, at: Shared) {
        self.op_to(format_args!("ld.shared.{}", T::SUFFIX), dst, &[&at]);
    }
    /// One byte (`bits` 8) or an aligned halfword (`bits` 16), zero-extended.
    pub fn ld_shared_narrow(&mut self, at: Shared, bits: u32) -> Reg<U32> {
        debug_assert!(bits == 8 || bits == 16);
        let d = self.reg();
        self.line(format_args!("ld.shared.u{bits} {d}, {at}"));
        d
    }
    /// 8 bytes; `at` must be 8-byte aligned.
    pub fn ld_shared_v2<T: Bits32>(&mut self, at: Shared) -> [Reg<T>; 2] {
        let d = [self.reg(), self.reg()];
        let list = vector(&d);
        self.line(format_args!("ld.shared.v2.{} {list}, {at}", T::SUFFIX));
        d
    }
    /// 16 bytes; `at` must be 16-byte aligned.
    pub fn ld_shared_v4<T: Bits32>(&mut self, at: Shared) -> [Reg<T>; 4] {
        let d = [self.reg(), self.reg(), self.reg(), self.reg()];
        let list = vector(&d);
        self.line(format_args!("ld.shared.v4.{} {list}, {at}", T::SUFFIX));
        d
    }
    /// `bytes` at `at` (aligned to `align`), each load as wide as the
    /// alignment and the length allow (at most 16 bytes): 32-bit words, or
    /// zero-extended halves when `align` is 2; and the bytes of each.
    pub fn ld_shared_units(&mut self, at: Shared, bytes: u32, align: u32) -> (Vec<Reg<U32>>, u32) {
        let mut width = align.min(16);
        while !bytes.is_multiple_of(width) {
            width /= 2;
        }
        let units = (0..bytes / width)
            .flat_map(|i| {
                let at = at.plus(i64::from(i * width));
                match width {
                    16 => self.ld_shared_v4::<U32>(at).to_vec(),
                    8 => self.ld_shared_v2::<U32>(at).to_vec(),
                    4 => vec![self.ld_shared::<U32>(at)],
                    _ => vec![self.ld_shared_narrow(at, 16)],
                }
            })
            .collect();
        (units, width.min(4))
    }
    pub fn st_shared<T: Bits32>(&mut self, at: Shared, value: impl Into<Op<T>>) {
        let value = value.into();
        self.line(format_args!("st.shared.{} {at}, {value}", T::SUFFIX));
    }
    /// The low 8 or 16 bits of `value`.
    pub fn st_shared_narrow(&mut self, at: Shared, value: Reg<U32>, bits: u32) {
        debug_assert!(bits == 8 || bits == 16);
        self.line(format_args!("st.shared.u{bits} {at}, {value}"));
    }
    /// 8 bytes; `at` must be 8-byte aligned.
    pub fn st_shared_v2<T: Bits32>(&mut self, at: Shared, values: [Reg<T>; 2]) {
        let list = vector(&values);
        self.line(format_args!("st.shared.v2.{} {at}, {list}", T::SUFFIX));
    }
    /// 16 bytes; `at` must be 16-byte aligned.
    pub fn st_shared_v4<T: Bits32>(&mut self, at: Shared, values: [Reg<T>; 4]) {
        let list = vector(&values);
        self.line(format_args!("st.shared.v4.{} {at}, {list}", T::SUFFIX));
    }
    /// Atomic `*at = max(*at, value)` in shared memory, no result.
    pub fn red_shared_max(&mut self, at: Shared, value: Reg<U32>) {
        self.line(format_args!("red.shared.max.u32 {at}, {value}"));
    }
    /// Atomic `*at = min(*at, value)` in shared memory, no result.
    pub fn red_shared_min(&mut self, at: Shared, value: Reg<U32>) {
        self.line(format_args!("red.shared.min.u32 {at}, {value}"));
    }
    /// An L2 cache policy for every line an access touches (sm_80+).
    pub fn l2_policy(&mut self, evict: Evict) -> Reg<U64> {
        let d = self.reg();
        let priority = match evict {
            Evict::First => "evict_first",
            Evict::Last => "evict_last",
        };
        self.line(format_args!(
            "createpolicy.fractional.L2::{priority}.b64 {d}, 1.0"
        ));
        d
    }
    /// Read-only, non-coherent global load (tables, page lists, queries).
    pub fn ld_global_nc<T: Bits32>(&mut self, at: Global) -> Reg<T> {
        let d = self.reg();
        self.ld_global_nc_to(d, at);
        d
    }
    /// [`Self::ld_global_nc`] into `dst`, a register updated in a loop: the
    /// load's latency is hidden until `dst` is next read.
    pub fn ld_global_nc_to<T: Bits32>(&mut self, dst: Reg<T>, at: Global) {
        let (hint, policy) = at.hint();
        self.line(format_args!(
            "ld.global.nc{hint}.{} {dst}, {at}{policy}",
            T::SUFFIX
        ));
    }
    /// 16 bytes, read-only; `at` must be 16-byte aligned.
    pub fn ld_global_nc_v4<T: Bits32>(&mut self, at: Global) -> [Reg<T>; 4] {
        let d = [self.reg(), self.reg(), self.reg(), self.reg()];
        let (hint, policy) = at.hint();
        let list = vector(&d);
        self.line(format_args!(
            "ld.global.nc{hint}.v4.{} {list}, {at}{policy}",
            T::SUFFIX
        ));
        d
    }
    pub fn st_global<T: Bits32>(&mut self, at: Global, value: impl Into<Op<T>>) {
        let value = value.into();
        self.line(format_args!("st.global.{} {at}, {value}", T::SUFFIX));
    }
    /// A 16-bit store (2-byte aligned).
    pub fn st_global_b16(&mut self, at: Global, value: Reg<B16>) {
        self.line(format_args!("st.global.b16 {at}, {value}"));
    }
    /// Asynchronous 16-byte copy global -> shared (sm_80+), bypassing L1; both
    /// addresses 16-byte aligned. Completes with [`cp_async_wait`](Self::cp_async_wait).
    /// The L2 fetches whole 128-byte lines: on an H200 that took dense f16
    /// decode from 0.2935 to 0.2830 ms (256-byte lines: 0.3070; kivi unchanged).
    pub fn cp_async_16(&mut self, dst: Shared, src: Global) {
        let (hint, policy) = src.hint();
        self.line(format_args!(
            "cp.async.cg.shared.global{hint}.L2::128B {dst}, {src}, 16{policy}"
        ));
    }
    /// Closes the current group of `cp.async` copies (an empty group is fine).
    pub fn cp_async_commit(&mut self) {
        self.line(format_args!("cp.async.commit_group"));
    }
    /// Waits until at most `pending` of this thread's groups are in flight.
    pub fn cp_async_wait(&mut self, pending: u32) {
        self.line(format_args!("cp.async.wait_group {pending}"));
    }

    // ---- bulk copies and their mbarriers (sm_90) ----------------------------

    /// Readies the 8-byte-aligned mbarrier at `at` for `arrivals` arrivals
    /// per phase.
    pub fn mbarrier_init(&mut self, at: Shared, arrivals: u32) {
        self.line(format_args!(
            "mbarrier.init.shared::cta.b64 {at}, {arrivals}"
        ));
    }
    /// Makes this thread's mbarrier inits visible to the bulk-copy engine
    /// (a `bar.sync` then shows them to the other threads).
    pub fn fence_mbarrier_init(&mut self) {
        self.line(format_args!("fence.mbarrier_init.release.cluster"));
    }
    /// Orders this thread's (and, after a barrier, the CTA's) shared-memory
    /// accesses before the bulk copies it issues next.
    pub fn fence_proxy_async_shared(&mut self) {
        self.line(format_args!("fence.proxy.async.shared::cta"));
    }
    /// Arrives on the mbarrier at `at`, whose phase then also waits for
    /// `bytes` bytes of bulk copies.
    pub fn mbarrier_arrive_expect_tx(&mut self, at: Shared, bytes: impl Into<Op<U32>>) {
        let bytes = bytes.into();
        self.line(format_args!(
            "mbarrier.arrive.expect_tx.shared::cta.b64 _, {at}, {bytes}"
        ));
    }
    /// Bulk copy of `bytes` (a multiple of 16; both addresses 16-byte
    /// aligned) global -> shared by the tensor memory accelerator; completes
    /// its bytes on the mbarrier at `barrier`.
    pub fn cp_async_bulk(
        &mut self,
        dst: Shared,
        src: Global,
        bytes: impl Into<Op<U32>>,
        barrier: Shared,
    ) {
        let bytes = bytes.into();
        let (hint, policy) = src.hint();
        self.line(format_args!(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes{hint} {dst}, {src}, {bytes}, {barrier}{policy}"
        ));
    }
    /// Tensor copy of the box at `coords` (innermost first) of the 4-d tensor
    /// map at generic address `map` global -> shared (`dst` aligned as the
    /// map's swizzle needs), its lines under L2 policy `policy`; completes its
    /// bytes on the mbarrier at `barrier`.
    pub fn cp_async_bulk_tensor_4d(
        &mut self,
        dst: Shared,
        map: Reg<U64>,
        coords: [Reg<U32>; 4],
        barrier: Shared,
        policy: Reg<U64>,
    ) {
        let [c0, c1, c2, c3] = coords;
        self.line(format_args!(
            "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint {dst}, [{map}, {{{c0}, {c1}, {c2}, {c3}}}], {barrier}, {policy}"
        ));
    }
    /// Waits until the phase of parity `parity` (0 or 1) of the mbarrier at
    /// `at` has completed.
    pub fn mbarrier_wait(&mut self, at: Shared, parity: Reg<U32>) {
        let top = self.label();
        self.place(top);
        let done: Reg<Pred> = self.reg();
        self.line(format_args!(
            "mbarrier.try_wait.parity.shared::cta.b64 {done}, {at}, {parity}"
        ));
        self.bra_if(done, false, top);
    }

    // ---- encoders: narrow reads, vector writes, shared ORs -----------------

    /// One byte (`bits` 8) or an aligned halfword (`bits` 16), read-only,
    /// zero-extended.
    pub fn ld_global_nc_narrow(&mut self, at: Global, bits: u32) -> Reg<U32> {
        debug_assert!(bits == 8 || bits == 16);
        let d = self.reg();
        let (hint, policy) = at.hint();
        self.line(format_args!("ld.global.nc{hint}.u{bits} {d}, {at}{policy}"));
        d
    }
    /// 16 bytes; `at` must be 16-byte aligned.
    pub fn st_global_v4<T: Bits32>(&mut self, at: Global, values: [Reg<T>; 4]) {
        let list = vector(&values);
        self.line(format_args!("st.global.v4.{} {at}, {list}", T::SUFFIX));
    }
    /// Atomic `*at |= value` in shared memory, no result.
    pub fn red_shared_or(&mut self, at: Shared, value: Reg<U32>) {
        self.line(format_args!("red.shared.or.b32 {at}, {value}"));
    }
    /// Atomic `*at += value` in shared memory, no result.
    pub fn red_shared_add(&mut self, at: Shared, value: impl Into<Op<U32>>) {
        let value = value.into();
        self.line(format_args!("red.shared.add.u32 {at}, {value}"));
    }
    /// Address arithmetic: `base + index * scale` in the global space.
    pub fn global_index(&mut self, base: Reg<U64>, index: Reg<U32>, scale: u32) -> Reg<U64> {
        let offset = if scale == 1 {
            self.u32_to_u64(index)
        } else {
            self.mul_wide(index, scale)
        };
        self.add(base, offset)
    }
}

/// Registers as a PTX vector operand: `{a, b, …}`.
fn vector<T: Type>(registers: &[Reg<T>]) -> String {
    let list: Vec<String> = registers.iter().map(|r| r.to_string()).collect();
    format!("{{{}}}", list.join(", "))
}
