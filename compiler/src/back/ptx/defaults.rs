//! The back end's default schedule and page size for a tier, from a cost
//! model of the decode step instead of constants: what the runtime launches
//! where no tune result covers the tier, the GPU and the shape, and where
//! `kvcc tune`'s search starts.
//!
//! A step streams every page once, so its time is the pages' bytes over the
//! bandwidth the grid reaches, plus fixed costs per tile and per CTA. Each
//! rule ([`page_items`], [`schedule`], [`splits`]) removes one such cost that
//! tune sweeps measured. The rules, the measurements behind each and how the
//! model compares with tuned winners: docs/autotune.md § The cost model.

use super::{shared_stride, tensor_core_phases, Options, Schedule};
use crate::proc::{reads_header, reads_tables};
use crate::target::Target;
use crate::Format;

/// What the model knows of the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    pub target: Target,
    pub multiprocessors: u32,
}

/// The decode step a default is chosen for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Workload {
    pub batch: u32,
    pub q_heads: u32,
    pub kv_heads: u32,
    /// Tokens of the longest sequence.
    pub context: u32,
}

impl Workload {
    /// Query heads per kv head.
    fn query_group(&self) -> u32 {
        (self.q_heads / self.kv_heads.max(1)).max(1)
    }

    /// Pages of `items` items the whole batch streams.
    fn pages(&self, items: u32) -> u64 {
        let rows = u64::from(self.batch.max(1)) * u64::from(self.kv_heads.max(1));
        rows * u64::from(self.context.max(1)).div_ceil(u64::from(items.max(1)))
    }
}

fn options(machine: Machine, query_group: u32, schedule: Schedule) -> Options {
    Options {
        query_group: Some(query_group),
        ..options_for(machine.target, schedule)
    }
}

/// Bytes of codes a page (hence a tile) should hold.
pub const TILE_BYTES: u32 = 32 * 1024;
/// Page sizes the model picks from, smallest first.
pub const PAGE_ITEMS: [u32; 2] = [64, 128];
/// Page sizes the model picks from where the score is on the tensor cores,
/// its rows read as stored.
pub const TENSOR_PAGE_ITEMS: [u32; 4] = [64, 128, 256, 512];
/// Items per page where the keys are scaled per page ([`reads_header`]) and
/// scored on the tensor cores.
pub const PAGE_SCALED_KEY_ITEMS: u32 = 512;
/// Pages of the whole batch per SM below which pages are halved.
pub const PAGES_PER_SM: u32 = 2;
/// Item rows (per stream) narrower than this load by bulk copies.
pub const NARROW_ROW_BYTES: u32 = 128;
/// Warps of a CTA whose values read tables per item.
const TABLE_READ_WARPS: u32 = 2;
/// Pages of the whole batch per SM below which CTAs scored on the tensor
/// cores take [`FEW_PAGE_WARPS`].
pub const FEW_PAGES_PER_SM: u32 = 8;
/// Warps of a CTA when the batch has few pages per SM.
pub const FEW_PAGE_WARPS: u32 = 8;
/// Warps of a CTA whose values take group scales on the tensor cores.
const GROUPED_VALUE_WARPS: u32 = 2;
/// Items of a tile whose values take group scales on the tensor cores.
pub const GROUPED_VALUE_TILE_ITEMS: u32 = 128;

/// Pages below which a CTA of one wave is mostly its fixed costs.
pub const MIN_CTA_PAGES: u32 = 32;
/// CTAs per SM [`splits`] keeps at most when they are short.
pub const MAX_SHORT_CTAS_PER_SM: u32 = 8;

/// Splits (CTAs per row) of a step over `rows` rows of at most `row_pages`
/// pages, for a kernel of which `resident` CTAs fit an SM: one wave over the
/// `multiprocessors` SMs; when that gives each CTA fewer than
/// [`MIN_CTA_PAGES`] pages, at most [`MAX_SHORT_CTAS_PER_SM`] CTAs per SM
/// (module docs, splits). Never more than the row's pages, never 0.
pub fn splits(resident: u32, multiprocessors: u32, rows: u32, row_pages: u32) -> u32 {
    let rows = rows.max(1);
    let row_pages = row_pages.max(1);
    let wave = (resident.max(1) * multiprocessors / rows).clamp(1, row_pages);
    if row_pages.div_ceil(wave) >= MIN_CTA_PAGES {
        return wave;
    }
    wave.min((MAX_SHORT_CTAS_PER_SM * multiprocessors / rows).max(1))
}

/// The modeled page size of `tier` and its schedule at that size: for
/// callers that encode the pages themselves (`kvcc bench`, the tuner's
/// starting point).
pub fn paged_schedule(
    format: &Format,
    tier: usize,
    workload: Workload,
    machine: Machine,
) -> (u32, Schedule) {
    let items = page_items(format, tier, workload, machine);
    match format.with_page_items(items) {
        Ok(paged) => (items, schedule(&paged, tier, workload, machine)),
        Err(_) => (
            format.spec().page.items,
            schedule(format, tier, workload, machine),
        ),
    }
}

/// The modeled schedule of `tier` for pages of the format's own size: for
/// caches whose pages are already written.
pub fn schedule(format: &Format, tier: usize, workload: Workload, machine: Machine) -> Schedule {
    let schedule = layout_schedule(format, tier, machine.target);
    let pages = workload.pages(format.spec().page.items);
    let few_pages = pages < u64::from(FEW_PAGES_PER_SM * machine.multiprocessors);
    let options = options(machine, workload.query_group(), schedule);
    let warps = match few_pages
        && schedule.warps == Schedule::default().warps
        && tensor_core_phases(format, tier, &options).score
    {
        true => FEW_PAGE_WARPS,
        false => schedule.warps,
    };
    Schedule { warps, ..schedule }
}

/// The schedule the tier's layout asks for, whatever the workload.
fn layout_schedule(format: &Format, tier: usize, target: Target) -> Schedule {
    let layout = format.layout(tier);
    let module = format.tiers()[tier].module();
    let reference = Schedule::default();
    let phases = tensor_core_phases(format, tier, &options_for(target, reference));
    let grouped = phases.grouped_values;
    let warps = if reads_tables(&module.value.accumulate.exprs) && !phases.accumulate {
        TABLE_READ_WARPS
    } else if grouped {
        GROUPED_VALUE_WARPS
    } else {
        reference.warps
    };
    let tile_items = match grouped && format.spec().page.items > GROUPED_VALUE_TILE_ITEMS {
        true => Some(GROUPED_VALUE_TILE_ITEMS),
        false => reference.tile_items,
    };
    let narrow = layout.key.stride.max(layout.value.stride) < NARROW_ROW_BYTES;
    // Grouped values' fragment loads read four tokens two rows apart: rows a
    // multiple of 32 bytes, unpadded, start them on the same banks.
    let padded_values = grouped && shared_stride(layout.value.stride) != layout.value.stride;
    let bulk_copies = if padded_values {
        Some(false)
    } else if narrow && target == Target::Sm90 {
        Some(true)
    } else {
        reference.bulk_copies
    };
    Schedule {
        warps,
        tile_items,
        bulk_copies,
        ..reference
    }
}

/// Options for one query head per kv head: what the layout rules look at.
fn options_for(target: Target, schedule: Schedule) -> Options {
    Options {
        target,
        query_group: Some(1),
        schedule,
    }
}

/// Items per page for `tier` at `workload`: [`PAGE_SCALED_KEY_ITEMS`] for keys
/// scaled per page and scored on the tensor cores, else the smallest
/// of [`PAGE_ITEMS`] up to the CTA's threads whose page holds
/// [`TILE_BYTES`]; halved while the batch has fewer than [`PAGES_PER_SM`]
/// pages per SM, among the sizes the spec accepts.
pub fn page_items(format: &Format, tier: usize, workload: Workload, machine: Machine) -> u32 {
    let layout = format.layout(tier);
    let item_bytes = layout.key.stride + layout.value.stride;
    let page_bytes = |items: u32| items * item_bytes + layout.header_bytes;
    let fits = |items: u32| format.with_page_items(items).is_ok();
    let Some(smallest) = PAGE_ITEMS.iter().copied().find(|&items| fits(items)) else {
        return format.spec().page.items;
    };
    let pages = |items: u32| workload.pages(items);
    let per_sm = |n: u32| u64::from(n * machine.multiprocessors);
    let schedule = layout_schedule(format, tier, machine.target);
    let options = options(machine, workload.query_group(), schedule);
    let phases = tensor_core_phases(format, tier, &options);
    let per_page_keys =
        reads_header(&format.tiers()[tier].module().key.score.exprs) && phases.score;
    let mut items = if per_page_keys {
        PAGE_SCALED_KEY_ITEMS
    } else {
        // A tensor-core score takes a tile of any size; a CUDA-core one
        // gives each thread an item of it.
        let (candidates, threads) = match phases.score && !phases.gathered_keys {
            true => (&TENSOR_PAGE_ITEMS[..], u32::MAX),
            false => (&PAGE_ITEMS[..], 32 * schedule.warps),
        };
        let sizes: Vec<u32> = (candidates.iter().copied())
            .filter(|&items| items <= threads && fits(items))
            .collect();
        let largest = sizes.last().copied().unwrap_or(smallest);
        (sizes.into_iter())
            .find(|&items| page_bytes(items) >= TILE_BYTES)
            .unwrap_or(largest)
    };
    let wanted = per_sm(PAGES_PER_SM);
    while items > smallest && (pages(items) < wanted || !fits(items)) {
        items /= 2;
    }
    if fits(items) {
        items
    } else {
        smallest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: Machine = Machine {
        target: Target::Sm90,
        multiprocessors: 132,
    };

    fn bundled_source(name: &str) -> String {
        let path = format!("{}/../specs/{name}.toml", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn bundled(name: &str) -> Format {
        Format::parse(&bundled_source(name), &format!("specs/{name}.toml")).unwrap()
    }

    fn shape(batch: u32, context: u32) -> Workload {
        Workload {
            batch,
            q_heads: 32,
            kv_heads: 8,
            context,
        }
    }

    /// The modeled page size and schedule, as the tuner starts from.
    struct Modeled {
        page_items: u32,
        schedule: Schedule,
    }

    fn config(format: &Format, tier: usize, workload: Workload, machine: Machine) -> Modeled {
        let (page_items, schedule) = paged_schedule(format, tier, workload, machine);
        Modeled {
            page_items,
            schedule,
        }
    }

    fn tier(format: &Format, name: &str) -> usize {
        format.tier_index(name).unwrap()
    }

    #[test]
    fn pages_hold_a_tile_of_codes_and_an_item_per_thread() {
        let dense = bundled("dense_f16");
        assert_eq!(page_items(&dense, 0, shape(8, 32768), H100), 64);
        // Gathered keys on the tensor cores: 128 threads, 128 items.
        let mosaic = bundled("mosaic");
        assert_eq!(page_items(&mosaic, 0, shape(8, 32768), H100), 128);
        // Keys read as stored on the tensor cores: 32 KiB of codes.
        let fp8 = bundled("fp8");
        assert_eq!(page_items(&fp8, 0, shape(8, 32768), H100), 128);
        let shard = bundled("shard");
        assert_eq!(page_items(&shard, 0, shape(8, 32768), H100), 512);
        assert_eq!(page_items(&shard, 0, shape(1, 32768), H100), 512);
        // Two warps (values read through f32 tables per thread): 64 items.
        assert_eq!(page_items(&f32_books(), 0, shape(8, 32768), H100), 64);
    }

    #[test]
    fn keys_scaled_per_page_on_tensor_cores_get_the_largest_pages() {
        for (name, tier_name) in [
            ("kivi", "int8"),
            ("kivi", "int4"),
            ("kivi2", "int2"),
            ("kivi2", "int3"),
            ("subspace", "rank32"),
        ] {
            let format = bundled(name);
            let items = page_items(&format, tier(&format, tier_name), shape(8, 32768), H100);
            assert_eq!(items, PAGE_SCALED_KEY_ITEMS, "{name} {tier_name}");
        }
        // Keys scored on the CUDA cores (spherical): the general rule.
        let spherical = bundled("spherical");
        assert_eq!(page_items(&spherical, 0, shape(8, 32768), H100), 128);
        // One sequence of 32K: 512 pages of 512 items, about 4 per SM.
        let kivi = bundled("kivi");
        let int4 = tier(&kivi, "int4");
        assert_eq!(page_items(&kivi, int4, shape(1, 32768), H100), 512);
        assert_eq!(page_items(&kivi, int4, shape(1, 131072), H100), 512);
    }

    #[test]
    fn short_batches_get_smaller_pages_to_fill_the_gpu() {
        let kivi = bundled("kivi");
        let int4 = tier(&kivi, "int4");
        // 8 rows of 8K tokens: 256-item pages would give 256 pages for 132 SMs.
        assert_eq!(page_items(&kivi, int4, shape(1, 8192), H100), 128);
        assert_eq!(page_items(&kivi, int4, shape(1, 131072), H100), 512);
        // Never below the smallest size, however short.
        assert_eq!(page_items(&kivi, int4, shape(1, 64), H100), 64);
    }

    /// Shard with f32 value books: its values are read per thread.
    fn f32_books() -> Format {
        let shard = bundled_source("shard").replace("dtype = \"f16\" }]", "dtype = \"f32\" }]");
        Format::parse(&shard, "shard_f32.toml").unwrap()
    }

    #[test]
    fn table_reading_values_get_small_ctas_and_narrow_rows_bulk_copies() {
        let books = f32_books();
        let config = layout_schedule(&books, 0, Target::Sm90);
        assert_eq!(config.warps, TABLE_READ_WARPS);
        assert_eq!(config.bulk_copies, Some(true));
        // Looked up for the tensor cores: the reference warps.
        let shard = bundled("shard");
        let config = layout_schedule(&shard, 0, Target::Sm90);
        assert_eq!(config.warps, Schedule::default().warps);
        assert_eq!(config.bulk_copies, Some(true));
        let dense = bundled("dense_f16");
        assert_eq!(
            layout_schedule(&dense, 0, Target::Sm90),
            Schedule::default()
        );
        assert_eq!(layout_schedule(&shard, 0, Target::Sm80).bulk_copies, None);
    }

    #[test]
    fn grouped_values_get_two_warps_and_quarter_page_tiles() {
        let kivi2 = bundled("kivi2");
        for name in ["int2", "int3"] {
            let config = config(&kivi2, tier(&kivi2, name), shape(8, 32768), H100);
            assert_eq!(
                (
                    config.page_items,
                    config.schedule.warps,
                    config.schedule.tile_items
                ),
                (512, GROUPED_VALUE_WARPS, Some(GROUPED_VALUE_TILE_ITEMS)),
                "{name}"
            );
        }
        // int3's 64-byte value rows are padded (cp.async), int2's 48-byte ones not.
        let copies = |name| {
            config(&kivi2, tier(&kivi2, name), shape(8, 32768), H100)
                .schedule
                .bulk_copies
        };
        assert_eq!((copies("int2"), copies("int3")), (Some(true), Some(false)));
        // Values scaled per item (KIVI) keep the reference warps and whole-page tiles.
        let kivi = bundled("kivi");
        let int4 = config(&kivi, tier(&kivi, "int4"), shape(8, 32768), H100);
        let reference = Modeled {
            page_items: 0,
            schedule: Schedule::default(),
        };
        assert_eq!(
            (int4.schedule.warps, int4.schedule.tile_items),
            (reference.schedule.warps, reference.schedule.tile_items)
        );
    }

    #[test]
    fn few_pages_per_sm_give_tensor_core_scores_eight_warps() {
        let kivi = bundled("kivi");
        let int4 = tier(&kivi, "int4");
        // One sequence of 32K: 512 pages of 512 items, under 8 per SM.
        assert_eq!(
            config(&kivi, int4, shape(1, 32768), H100).schedule.warps,
            FEW_PAGE_WARPS
        );
        // 2048 pages at 128K, and 4096 at batch 8 × 32K, keep 4.
        assert_eq!(
            config(&kivi, int4, shape(1, 131072), H100).schedule.warps,
            4
        );
        assert_eq!(config(&kivi, int4, shape(8, 32768), H100).schedule.warps, 4);
        // Scores on the CUDA cores (Spherical) and the other warp rules keep theirs.
        let spherical = bundled("spherical");
        assert_eq!(
            config(&spherical, 0, shape(1, 8192), H100).schedule.warps,
            4
        );
        let kivi2 = bundled("kivi2");
        let int2 = tier(&kivi2, "int2");
        let warps = config(&kivi2, int2, shape(1, 32768), H100).schedule.warps;
        assert_eq!(warps, GROUPED_VALUE_WARPS);
    }

    #[test]
    fn waves_of_short_ctas_keep_at_most_eight_to_an_sm() {
        // 2-warp CTAs, 20 to an SM, batch 8 × 8 kv heads, 512 pages a row:
        // one wave is 41 splits of 12.5 pages; 8 CTAs per SM are 16 splits.
        assert_eq!(splits(20, 132, 64, 512), 16);
        // Long rows already give each CTA of the wave 32 pages or more.
        assert_eq!(splits(20, 132, 64, 2048), 41);
        // Waves of at most 8 CTAs per SM stay, however short.
        assert_eq!(splits(6, 132, 64, 64), 12);
        // One sequence (8 rows) keeps its wave.
        assert_eq!(splits(3, 132, 8, 64), 49);
        // Never more splits than pages, never none.
        assert_eq!(splits(20, 132, 64, 3), 3);
        assert_eq!(splits(0, 132, 0, 0), 1);
    }

    #[test]
    fn the_modeled_page_size_is_one_the_spec_accepts() {
        let kivi = bundled("kivi");
        let int4 = tier(&kivi, "int4");
        let config = config(&kivi, int4, shape(8, 32768), H100);
        assert_eq!(config.page_items, 512);
        assert!(kivi.with_page_items(config.page_items).is_ok());
    }
}
