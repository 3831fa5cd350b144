//! A page's query preparation split over the CTA's warps. Every warp of a
//! CTA scores the same pages, so each prepares only the fragment registers
//! it owns ([`owned_registers`]), and the warps meet in shared memory
//! ([`PageFragments`]) twice: for the page's σ of each head (the largest
//! magnitude over every warp's elements) and its `Σ query · zero`, then for
//! the registers, which every warp loads. Unsplit, the preparation (query
//! times the header scales, σ, the integer digits or f16 parts) was a fifth
//! of KIVI int4's issued instructions at batch 1 × 32K on an H200 (8
//! warps); split, KIVI int4 ran 1.06× faster there, KIVI int8 1.03×, kivi2
//! 1.01-1.03×, the rest within noise (the warps then wait on the barriers,
//! not the issue slots). One barrier instead (every warp computing σ from
//! all elements) was slower.

use super::super::builder::{Cmp, Kernel, Reg, Shared, F32, U32};
use super::super::plan::{PageFragments, PAGE_STATS_BYTES};
use super::super::tensor_cores::{MmaScore, ROW_LANES, TILE_HEADS, WARP_LANES};
use super::fragments::{column_magnitude, sigma_of_magnitude, Across};
use super::queries::{bounded_sigma, column_factors, exponent, row_sum, PageHeader};
use super::score_mma::{MmaScoreThread, ScoreMma};

/// The fragment registers warp `warp` of `warps` prepares: a run of
/// consecutive ones, at least one where there are as many registers as
/// warps (the plan splits a page's preparation only then).
pub(super) fn owned_registers(registers: u32, warps: u32, warp: u32) -> Vec<u32> {
    (0..registers)
        .filter(|&r| r * warps / registers == warp)
        .collect()
}

impl ScoreMma<'_> {
    /// [`ScoreMma::queries`] for a page's header into the lane's queries
    /// (`t.queries`), the CTA's warps together. Every warp of the CTA must
    /// run it: each meets the others at two barriers in its own block.
    pub(super) fn shared_queries(
        &self,
        k: &mut Kernel,
        m: &MmaScore,
        t: &MmaScoreThread,
        header: PageHeader,
        shared: PageFragments,
    ) {
        let warps = self.cta.plan.warps;
        let registers = m.key_registers();
        assert!(registers >= warps, "every warp packs a register");
        let lanes = &t.lanes;
        let source = self.query_source(k, m, lanes, Some(header));
        let (factor, code_scale) = self.logit_factor(k, m);
        let query_tiles = m.query_tiles();
        let zeros = m.key_zero.is_some();
        // Statistics [column tile][warp][head of the tile]; lane 8·h writes head h's.
        let head = k.shr(lanes.row, 1u32);
        let stats = k.add(self.cta.smem, shared.stats);
        let head_stats = k.mad_lo(head, PAGE_STATS_BYTES, stats);
        let slot = |ct: usize, w: u32| {
            i64::from(((ct as u32 * warps + w) * TILE_HEADS) * PAGE_STATS_BYTES)
        };
        let lane = k.mad_lo(lanes.row, ROW_LANES, lanes.quad);
        let head_lane = k.and(lane, 2 * ROW_LANES - 1);
        let writer = k.setp(Cmp::Eq, head_lane, 0u32);

        let frag = k.add(self.cta.smem, shared.registers);
        let lane_frag = k.mad_lo(lane, 4u32, frag);
        let register_at = |ct: usize, tile: u32, r: u32| {
            let index = (ct as u32 * query_tiles + tile) * registers + r;
            Shared::at(lane_frag).plus(i64::from(index * 4 * WARP_LANES))
        };
        // The page's σ and Σ query · zero of each column tile: set in each
        // warp's own block, whose registers its elements never leave (a
        // register used in another warp's block would be live everywhere);
        // the loads of every register there too (KIVI int8: 96 registers a
        // lane, 124 with the loads after the blocks).
        let sigmas: Vec<Reg<F32>> = t.query_at.iter().map(|_| k.mov(0.0f32)).collect();
        let query_zeros: Vec<Option<Reg<F32>>> = (t.query_at.iter())
            .map(|_| (zeros || !t.bias_at.is_empty()).then(|| k.mov(0.0f32)))
            .collect();
        let done = k.label();
        for w in 0..warps {
            let own = owned_registers(registers, warps, w);
            let other = k.label();
            let mine = k.setp(Cmp::Eq, lanes.warp, w);
            k.bra_if(mine, false, other);
            k.comment(&format!(
                "warp {w}: its elements of the page's query, their largest magnitude and zero sums"
            ));
            let mut columns = Vec::new();
            for (ct, &(at, ok)) in t.query_at.iter().enumerate() {
                let (lane_elements, lane_zeros) = self.lane_elements(k, m, &source, at, ok, &own);
                let values: Vec<Reg<F32>> = lane_elements.iter().flatten().copied().collect();
                let most = column_magnitude(k, &values, Across::Butterfly(&[1, 2]));
                let zero_sum = lane_zeros.map(|sum| {
                    let sum = row_sum(k, sum, ok);
                    k.bitcast::<F32, U32>(sum)
                });
                let at = Shared::at(head_stats).plus(slot(ct, w));
                k.guarded(writer, true, |k| match zero_sum {
                    Some(sum) => k.st_shared_v2(at, [most, sum]),
                    None => k.st_shared(at, most),
                });
                columns.push(lane_elements);
            }
            k.barrier_sync();
            k.comment("the page's sigma of each head, from every warp's statistics");
            for (ct, lane_elements) in columns.iter().enumerate() {
                let mut most: Option<Reg<U32>> = None;
                let mut zero_sum: Option<Reg<F32>> = None;
                for w in 0..warps {
                    let at = Shared::at(head_stats).plus(slot(ct, w));
                    let (bits, sum) = match zeros {
                        true => {
                            let [bits, sum] = k.ld_shared_v2::<U32>(at);
                            (bits, Some(k.bitcast::<U32, F32>(sum)))
                        }
                        false => (k.ld_shared::<U32>(at), None),
                    };
                    most = Some(match most {
                        Some(most) => k.max(most, bits),
                        None => bits,
                    });
                    zero_sum = match (zero_sum, sum) {
                        (Some(total), Some(sum)) => Some(k.add(total, sum)),
                        (total, sum) => total.or(sum),
                    };
                }
                let sums = self.plus_bias(k, zero_sum, t.bias_at.get(ct));
                let sigma = sigma_of_magnitude(k, most.expect("a warp"), exponent(m));
                let sigma = bounded_sigma(k, sigma, sums);
                k.assign(sigmas[ct], sigma);
                if let (Some(to), Some(from)) = (query_zeros[ct], sums) {
                    k.assign(to, from);
                }
                k.comment("the warp's fragment registers of the page, for every warp");
                let tiles = self.pack(k, m, lanes, lane_elements, sigma, &own);
                for (tile, packed) in (0..query_tiles).zip(tiles) {
                    for (&r, register) in own.iter().zip(packed) {
                        k.st_shared(register_at(ct, tile, r), register);
                    }
                }
            }
            k.barrier_sync();
            let queries = &t.queries;
            for (ct, tiles) in queries.tiles.iter().enumerate() {
                for (tile, page) in (0..query_tiles).zip(tiles) {
                    for (r, &register) in (0..registers).zip(page) {
                        k.ld_shared_to(register, register_at(ct, tile, r));
                    }
                }
            }
            k.bra(done);
            k.place(other);
        }
        k.place(done);

        let queries = &t.queries;
        for (ct, (&sigma, &sums)) in sigmas.iter().zip(&query_zeros).enumerate() {
            let (logit_factor, page_bias) =
                column_factors(k, lanes, sigma, sums, factor, code_scale);
            k.assign(queries.to_logits[ct], logit_factor);
            if let (Some(bias), Some(page_bias)) = (&queries.bias, page_bias) {
                k.assign(bias[ct], page_bias);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::owned_registers;

    #[test]
    fn every_register_has_one_owner_in_runs() {
        for registers in [2, 4, 8, 16] {
            for warps in [2, 4, 8] {
                let owned: Vec<Vec<u32>> = (0..warps)
                    .map(|w| owned_registers(registers, warps, w))
                    .collect();
                let all: Vec<u32> = owned.iter().flatten().copied().collect();
                assert_eq!(
                    all,
                    (0..registers).collect::<Vec<_>>(),
                    "{registers} / {warps}"
                );
                let most = owned.iter().map(Vec::len).max().unwrap();
                assert_eq!(
                    most as u32,
                    registers.div_ceil(warps),
                    "{registers} / {warps}"
                );
                let least = owned.iter().map(Vec::len).min().unwrap();
                assert_eq!(least > 0, registers >= warps, "{registers} / {warps}");
            }
        }
    }
}
