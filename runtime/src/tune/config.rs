//! One point of the tuning space: every property of a tier's kernel that
//! changes its speed but not its results.

use std::fmt;

use kvcc_compiler::back::ptx::Options;
use kvcc_compiler::target::Target;
use kvcc_compiler::Format;
use serde::{Deserialize, Serialize};

use super::TuneError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct KernelConfig {
    /// Items per page: a property of the stored pages (re-encoding changes it).
    pub page_items: u32,
    /// Warps per CTA.
    pub warps: u32,
    /// Items per tile; `None`: as many as the default tile budget holds, at
    /// most a page.
    pub tile_items: Option<u32>,
    /// Tile buffers: tiles in flight while one is computed, plus one.
    #[serde(default = "two_stages")]
    pub stages: u32,
    /// Score and accumulate on the tensor cores where the tier allows it.
    #[serde(default = "tensor_cores_on")]
    pub tensor_cores: bool,
    /// Each tile's values accumulated during the next tile (tensor-core
    /// scores only; entries written before the knob had none).
    #[serde(default)]
    pub pipeline: bool,
    /// Tiles load by bulk copies on sm_90 (`None`: unless both streams' rows
    /// would be padded and stay unswizzled, `ptx::Options::bulk_copies`;
    /// entries written before the knob had none).
    #[serde(default)]
    pub bulk_copies: Option<bool>,
    /// Query heads per score / accumulate work unit.
    pub head_block: u32,
    /// Accumulator registers per thread in the accumulate phase.
    pub max_accumulators: u32,
    /// CTAs per (sequence, kv head) row; `None`: one full wave of CTAs.
    pub splits: Option<u32>,
}

impl KernelConfig {
    /// The backend's default options at the spec's page size: the kernel the
    /// tune key's code hash covers, and the base the cost model
    /// ([`super::model`]) changes.
    pub fn reference(format: &Format) -> KernelConfig {
        let options = Options::default();
        KernelConfig {
            page_items: format.spec().page.items,
            warps: options.warps,
            tile_items: options.tile_items,
            stages: options.stages,
            tensor_cores: options.tensor_cores,
            pipeline: options.pipeline,
            bulk_copies: options.bulk_copies,
            head_block: options.head_block,
            max_accumulators: options.max_accumulators,
            splits: None,
        }
    }

    /// The PTX options of this configuration for `target` and a query group.
    pub fn options(&self, target: Target, query_group: u32) -> Options {
        Options {
            target,
            warps: self.warps,
            tile_items: self.tile_items,
            stages: self.stages,
            tensor_cores: self.tensor_cores,
            pipeline: self.pipeline,
            bulk_copies: self.bulk_copies,
            head_block: self.head_block,
            max_accumulators: self.max_accumulators,
            query_group: Some(query_group),
            ..Options::default()
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

/// Entries written before tile buffers were a knob had two.
fn two_stages() -> u32 {
    2
}

/// Entries written before the tensor-core path had none to turn off.
fn tensor_cores_on() -> bool {
    true
}

/// `format` recompiled with `items` items per page.
pub fn with_page_items(format: &Format, items: u32) -> Result<Format, TuneError> {
    if format.spec().page.items == items {
        return Ok(format.clone());
    }
    let mut spec = format.spec().clone();
    spec.page.items = items;
    Format::compile(spec).map_err(|e| TuneError::PageVariant {
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
            self.warps,
            opt(self.tile_items, "page"),
            self.stages,
            match (self.tensor_cores, self.pipeline) {
                (false, _) => "fma",
                (true, false) => "mma",
                (true, true) => "mma+pipe",
            },
            self.head_block,
            self.max_accumulators,
            opt(self.splits, "auto"),
            match self.bulk_copies {
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
    fn page_variants_recompile_the_spec() {
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
