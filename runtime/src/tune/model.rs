//! The defaults where no tune result covers a tier, the GPU and the shape:
//! the back end's cost model ([`defaults`]) at a shape bucket's lower bounds.

use kvcc_compiler::back::ptx::defaults;
pub use kvcc_compiler::back::ptx::defaults::{splits, Machine};
use kvcc_compiler::Format;

use super::{KernelConfig, ShapeBucket};

/// The modeled configuration of `tier`, page size included: for callers that
/// encode the pages themselves (`kvcc bench`, the tuner's starting point).
pub fn config(format: &Format, tier: usize, shape: ShapeBucket, machine: Machine) -> KernelConfig {
    let (page_items, schedule) = defaults::paged_schedule(format, tier, shape.workload(), machine);
    KernelConfig {
        page_items,
        schedule,
        splits: None,
    }
}

/// The modeled configuration of `tier` at `shape` for pages of the format's
/// own size: for caches whose pages are already written.
pub fn config_at(
    format: &Format,
    tier: usize,
    shape: ShapeBucket,
    machine: Machine,
) -> KernelConfig {
    KernelConfig {
        schedule: defaults::schedule(format, tier, shape.workload(), machine),
        ..KernelConfig::reference(format)
    }
}

/// The modeled page size of `tier` at `shape`.
pub fn page_items(format: &Format, tier: usize, shape: ShapeBucket, machine: Machine) -> u32 {
    defaults::page_items(format, tier, shape.workload(), machine)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvcc_compiler::target::Target;

    #[test]
    fn the_modeled_config_carries_its_page_size() {
        let (_, source) = (crate::builtin::SPECS.iter())
            .find(|(path, _)| *path == "specs/kivi.toml")
            .unwrap();
        let kivi = Format::parse(source, "specs/kivi.toml").unwrap();
        let int4 = kivi.tier_index("int4").unwrap();
        let machine = Machine {
            target: Target::Sm90,
            multiprocessors: 132,
        };
        let shape = ShapeBucket::of(8, 32, 8, 32768);
        let config = config(&kivi, int4, shape, machine);
        assert_eq!(config.page_items, page_items(&kivi, int4, shape, machine));
        let paged = config.paged_format(&kivi).unwrap();
        assert_eq!(config_at(&paged, int4, shape, machine), config);
    }
}
