//! What a kernel is generated for (the target, the query group) and its
//! schedule: every choice that changes its speed but not its results, the
//! space `kvcc tune` searches.

use serde::{Deserialize, Serialize};

use super::Error;
use crate::target::Target;

/// Generation parameters. Splits are a launch parameter
/// ([`super::abi::DecodeKernel::launch`]); the page size comes from the spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    pub target: Target,
    /// Query heads per kv head the kernels serve at most; `None`: the spec's
    /// `page.max_query_group`. A model's actual group (at most the spec's)
    /// avoids computing for heads it does not have.
    pub query_group: Option<u32>,
    pub schedule: Schedule,
}

/// How a kernel's work is laid over warps, tiles and units; results are the
/// same under every schedule. Stored by the tuner as it is (missing fields
/// take the defaults of the knobs added after the first entries).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Schedule {
    /// Warps per CTA (1..=32), for the decode and the merge kernels.
    pub warps: u32,
    /// Items per tile (one copy batch); `None`: as many as fit `tile_bytes`,
    /// at most a page.
    pub tile_items: Option<u32>,
    /// Shared-memory budget of one tile buffer when `tile_items` is `None`.
    #[serde(
        default = "default_tile_bytes",
        skip_serializing_if = "is_default_tile_bytes"
    )]
    pub tile_bytes: u32,
    /// Tile buffers (2..=8): while one tile is computed on, the next
    /// `stages - 1` load.
    #[serde(default = "default_stages")]
    pub stages: u32,
    /// Score and accumulate on the tensor cores (`mma.sync`) when the tier
    /// qualifies (`tensor_cores/`: f16 keys and values read as stored);
    /// otherwise, and when off, per-thread fma chains.
    #[serde(default = "on")]
    pub tensor_cores: bool,
    /// With the score and its softmax per warp on the tensor cores: each
    /// tile's values are accumulated during the next tile, next to its score
    /// (more independent work per warp, more registers).
    #[serde(default)]
    pub pipeline: bool,
    /// On sm_90, each tile's streams load by bulk copies (the tensor memory
    /// accelerator: one instruction per stream, completion on an mbarrier)
    /// into unpadded rows, instead of 16-byte `cp.async` per thread into
    /// padded rows; ignored on sm_80. `None`: bulk copies unless both
    /// streams' rows would be padded (multiples of 32 bytes: unpadded, lanes
    /// reading one offset of neighbouring rows hit the same banks).
    #[serde(default)]
    pub bulk_copies: Option<bool>,
    /// Query heads per score / accumulate work unit: each value code is decoded
    /// once per block of this many heads.
    pub head_block: u32,
    /// Accumulator registers per thread in the accumulate phase; channels per
    /// thread are capped at `max_accumulators / head_block`.
    pub max_accumulators: u32,
}

impl Default for Schedule {
    fn default() -> Self {
        Schedule {
            warps: 4,
            tile_items: None,
            tile_bytes: default_tile_bytes(),
            stages: default_stages(),
            tensor_cores: true,
            pipeline: false,
            bulk_copies: None,
            head_block: 8,
            max_accumulators: 32,
        }
    }
}

fn default_tile_bytes() -> u32 {
    40 * 1024
}

fn is_default_tile_bytes(bytes: &u32) -> bool {
    *bytes == default_tile_bytes()
}

fn default_stages() -> u32 {
    2
}

fn on() -> bool {
    true
}

impl Default for Options {
    fn default() -> Self {
        Options::for_target(Target::Sm90)
    }
}

impl Options {
    pub fn for_target(target: Target) -> Options {
        Options {
            target,
            query_group: None,
            schedule: Schedule::default(),
        }
    }

    pub(super) fn check(&self) -> Result<(), Error> {
        let bad = |what: String| Err(Error::Options(what));
        let s = &self.schedule;
        if !(1..=32).contains(&s.warps) {
            return bad(format!("warps {} is outside 1..=32", s.warps));
        }
        if !(2..=8).contains(&s.stages) {
            return bad(format!("stages {} is outside 2..=8", s.stages));
        }
        if s.tile_items == Some(0) {
            return bad("tile_items must be at least 1".into());
        }
        if s.head_block == 0 {
            return bad("head_block must be at least 1".into());
        }
        if s.max_accumulators == 0 {
            return bad("max_accumulators must be at least 1".into());
        }
        if self.query_group == Some(0) {
            return bad("query_group must be at least 1".into());
        }
        Ok(())
    }
}
