//! One point of the tuning space: every property of a tier's kernel that
//! changes its speed but not its results.

use std::fmt;

use kvcc_compiler::back::ptx::{Options, Schedule};
use kvcc_compiler::target::Target;
use kvcc_compiler::Format;
use serde::{Deserialize, Serialize};

use super::TuneError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KernelConfig {
    /// Items per page: a property of the stored pages (re-encoding changes it).
    pub page_items: u32,
    /// The back end's schedule, stored field by field beside the page size.
    #[serde(flatten)]
    pub schedule: Schedule,
    /// CTAs per (sequence, kv head) row; `None`: one full wave of CTAs.
    pub splits: Option<u32>,
}

impl KernelConfig {
    /// The back end's default schedule at the spec's page size: the kernel the
    /// tune key's code hash covers, and the base the cost model
    /// ([`super::model`]) changes.
    pub fn reference(format: &Format) -> KernelConfig {
        KernelConfig {
            page_items: format.spec().page.items,
            schedule: Schedule::default(),
            splits: None,
        }
    }

    /// The PTX options of this configuration for `target` and a query group.
    pub fn options(&self, target: Target, query_group: u32) -> Options {
        Options {
            target,
            query_group: Some(query_group),
            schedule: self.schedule,
        }
    }

    /// `format` with this configuration's page size (the format itself when it
    /// already has it). Fails when the spec's checks refuse that page size.
    pub fn paged_format(&self, format: &Format) -> Result<Format, TuneError> {
        with_page_items(format, self.page_items)
    }

    /// Refuses pages written with another page size than this configuration's.
    pub fn check_pages(&self, pages: u32) -> Result<(), TuneError> {
        if pages == self.page_items {
            Ok(())
        } else {
            Err(TuneError::PageSize {
                tuned: self.page_items,
                pages,
            })
        }
    }
}

/// `format` with `items` items per page ([`Format::with_page_items`]).
pub fn with_page_items(format: &Format, items: u32) -> Result<Format, TuneError> {
    if format.spec().page.items == items {
        return Ok(format.clone());
    }
    format
        .with_page_items(items)
        .map_err(|e| TuneError::PageVariant {
            format: format.name().to_string(),
            items,
            reason: e.to_string(),
        })
}

/// A short label for tables: `p64 w4 tile:page x2 mma hb8 acc32 splits:auto`
/// (`fma` instead of `mma`: tensor cores off; `mma+pipe`: pipelined; a
/// trailing `bulk` or `cp.async`: the copy path forced one way).
impl fmt::Display for KernelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let opt =
            |v: Option<u32>, none: &'static str| v.map_or(none.to_string(), |v| v.to_string());
        write!(
            f,
            "p{} w{} tile:{} x{} {} hb{} acc{} splits:{}{}",
            self.page_items,
            self.schedule.warps,
            opt(self.schedule.tile_items, "page"),
            self.schedule.stages,
            match (self.schedule.tensor_cores, self.schedule.pipeline) {
                (false, _) => "fma",
                (true, false) => "mma",
                (true, true) => "mma+pipe",
            },
            self.schedule.head_block,
            self.schedule.max_accumulators,
            opt(self.splits, "auto"),
            match self.schedule.bulk_copies {
                None => "",
                Some(true) => " bulk",
                Some(false) => " cp.async",
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn format() -> Format {
        Format::parse(
            "name = \"t\"\nhead_dim = 64\n[page]\nitems = 64\n[[tier]]\nname = \"f16\"\n\
             key.field = [{ kind = \"dense\", dtype = \"f16\" }]\n\
             value.field = [{ kind = \"dense\", dtype = \"f16\" }]\n",
            "t.toml",
        )
        .unwrap()
    }

    #[test]
    fn a_configuration_refuses_pages_of_another_size() {
        let config = KernelConfig {
            page_items: 128,
            ..KernelConfig::reference(&format())
        };
        assert!(config.check_pages(128).is_ok());
        let err = config.check_pages(64).unwrap_err();
        assert!(matches!(
            err,
            TuneError::PageSize {
                tuned: 128,
                pages: 64
            }
        ));
        assert!(err.to_string().contains("re-encode"), "{err}");
    }

    #[test]
    fn page_variants_move_the_page_geometry() {
        let f = format();
        let config = KernelConfig {
            page_items: 32,
            ..KernelConfig::reference(&f)
        };
        let paged = config.paged_format(&f).unwrap();
        assert_eq!(paged.spec().page.items, 32);
        assert_eq!(paged.layout(0).items_per_page, 32);
        let bad = KernelConfig {
            page_items: 0,
            ..config
        };
        assert!(matches!(
            bad.paged_format(&f),
            Err(TuneError::PageVariant { items: 0, .. })
        ));
    }
}
