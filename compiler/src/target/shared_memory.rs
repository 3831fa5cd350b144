//! The shared-memory model of a tier's decode kernel, per target: what its
//! per-head arrays and staged codebooks take, and, per key codebook, whether
//! the score reads a per-query lookup table (one load per group, built by the
//! prologue) or the codewords themselves (`proc::inline_lut`). The front end
//! checks specs against it; the PTX back end builds what it chooses.

use std::borrow::Cow;

use super::Target;
use crate::layout::{FieldLayout, TierLayout};
use crate::proc::inline_lut::inline_lut;
use crate::spec::{FieldSpec, FormatSpec};
use crate::valid::{validate, ValidModule};

/// Bytes the front end lets a tier's arrays and codebooks take: the roomiest
/// target's block, less [`TILE_RESERVE`].
pub const SHARED_MEMORY_BUDGET: u32 =
    Target::roomiest().model().shared_bytes_per_block - TILE_RESERVE;

/// Shared memory the estimate leaves to the stream: the smallest automatic
/// tile buffers, the softmax state and the tile's logits.
pub const TILE_RESERVE: u32 = 16 * 1024;

/// Blocks per multiprocessor a lookup table must leave room for: a decode
/// streams from memory, and one resident block cannot hide its latency.
const MIN_RESIDENT_BLOCKS: u32 = 2;

/// The decode a lookup table's prologue is amortized over: a 32K context of
/// 8 sequences x 8 kv heads (`kvcc bench`), split into one wave of
/// [`MIN_RESIDENT_BLOCKS`] blocks per multiprocessor.
const REFERENCE_TOKENS: u64 = 32 * 1024 * 8 * 8;

/// How the score reads a key codebook.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodebookReads {
    /// A per-query table of ⟨q'_j, c_i⟩ for every group and codeword, built by
    /// the prologue: one shared load per group and item.
    LookupTable,
    /// The codewords from the staged codebook: a dot product per group and item.
    Direct,
}

/// One codebook field as the model sees it.
#[derive(Debug, Clone, Copy)]
struct Book {
    key: bool,
    groups: u64,
    group_size: u64,
    bits: u32,
    per_group: bool,
}

impl Book {
    /// 2^bits, saturated (bits beyond 63 are an error reported elsewhere).
    fn entries(&self) -> u64 {
        1u64.checked_shl(self.bits).unwrap_or(u64::MAX)
    }

    /// Floats of one query head's lookup table.
    fn lut(&self) -> u64 {
        self.groups.saturating_mul(self.entries())
    }

    /// Floats of the codebook table.
    fn codebook(&self) -> u64 {
        let books = if self.per_group { self.groups } else { 1 };
        books
            .saturating_mul(self.entries())
            .saturating_mul(self.group_size)
    }

    /// Per query head, the table costs `entries · n` fmas once per block and
    /// replaces the `n` fmas of each item's dot products by `groups` loads:
    /// it pays when a block streams enough items.
    fn table_pays(&self, items_per_block: u64) -> bool {
        let n = self.groups.saturating_mul(self.group_size);
        let saved = n.saturating_sub(self.groups);
        saved > 0 && self.entries().saturating_mul(n) <= items_per_block.saturating_mul(saved)
    }
}

/// The terms of a tier's shared-memory estimate, in floats (f32 words):
/// `4 * (max_query_group * (lut + query) + codebooks)` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedMemory {
    pub max_query_group: u64,
    /// Per query head: the lookup tables of the key codebooks read through one.
    pub lut: u64,
    /// Per query head: the query and its transforms (`4 * head_dim`).
    pub query: u64,
    /// Every codebook of the tier, key and value.
    pub codebooks: u64,
}

impl SharedMemory {
    /// Bytes, saturated.
    pub fn total(&self) -> u64 {
        let per_query = self.lut.saturating_add(self.query);
        4u64.saturating_mul(
            self.max_query_group
                .saturating_mul(per_query)
                .saturating_add(self.codebooks),
        )
    }
}

/// What the model needs of a tier: its codebooks, head_dim and query group.
#[derive(Debug, Clone)]
pub struct TierModel {
    max_query_group: u64,
    head_dim: u64,
    books: Vec<Book>,
}

impl TierModel {
    /// Tier `tier_index` of a spec, for its `page.max_query_group` heads.
    /// Meaningful for specs whose codebooks pass the checks (a group size that
    /// does not divide counts no groups).
    pub fn of_spec(spec: &FormatSpec, tier_index: usize) -> TierModel {
        let tier = &spec.tiers[tier_index];
        let mut books = Vec::new();
        for (codec, key) in [(&tier.key, true), (&tier.value, false)] {
            let n = u64::from(codec.transform.dims(spec.head_dim));
            for field in &codec.fields {
                if let FieldSpec::Codebook {
                    group_size,
                    bits,
                    per_group,
                    ..
                } = *field
                {
                    let group_size = u64::from(group_size);
                    let groups = if group_size > 0 && n.is_multiple_of(group_size) {
                        n / group_size
                    } else {
                        0
                    };
                    books.push(Book {
                        key,
                        groups,
                        group_size,
                        bits,
                        per_group,
                    });
                }
            }
        }
        TierModel {
            max_query_group: u64::from(spec.page.max_query_group),
            head_dim: u64::from(spec.head_dim),
            books,
        }
    }

    /// A tier's layout, for kernels sized for `group_max` query heads.
    pub fn of_layout(layout: &TierLayout, group_max: u32) -> TierModel {
        let books = [(&layout.key, true), (&layout.value, false)]
            .into_iter()
            .flat_map(|(codec, key)| {
                codec.fields.iter().filter_map(move |field| match *field {
                    FieldLayout::Codebook {
                        groups,
                        group_size,
                        bits,
                        per_group,
                        ..
                    } => Some(Book {
                        key,
                        groups: groups.into(),
                        group_size: group_size.into(),
                        bits,
                        per_group,
                    }),
                    _ => None,
                })
            })
            .collect();
        TierModel {
            max_query_group: group_max.into(),
            head_dim: layout.head_dim.into(),
            books,
        }
    }

    /// The estimate when every key codebook is read as `reads` says.
    pub fn footprint(&self, reads: CodebookReads) -> SharedMemory {
        let lut = match reads {
            CodebookReads::LookupTable => self
                .books
                .iter()
                .filter(|b| b.key)
                .fold(0u64, |sum, b| sum.saturating_add(b.lut())),
            CodebookReads::Direct => 0,
        };
        let codebooks = (self.books.iter()).fold(0u64, |sum, b| sum.saturating_add(b.codebook()));
        SharedMemory {
            max_query_group: self.max_query_group,
            lut,
            query: 4 * self.head_dim,
            codebooks,
        }
    }

    /// The smallest estimate the back end can build.
    pub fn least(&self) -> SharedMemory {
        self.footprint(CodebookReads::Direct)
    }

    /// How `target`'s kernel reads the key codebooks: through lookup tables
    /// where they leave room for `MIN_RESIDENT_BLOCKS` blocks per
    /// multiprocessor and their prologue pays over the reference decode,
    /// else directly.
    pub fn reads(&self, target: Target) -> CodebookReads {
        let model = target.model();
        let room = u64::from(model.shared_bytes_per_sm / MIN_RESIDENT_BLOCKS);
        let fits = self.footprint(CodebookReads::LookupTable).total() <= room;
        let blocks = u64::from(MIN_RESIDENT_BLOCKS * model.multiprocessors);
        let items_per_block = REFERENCE_TOKENS / blocks;
        let pays = (self.books.iter())
            .filter(|b| b.key)
            .all(|b| b.table_pays(items_per_block));
        if fits && pays {
            CodebookReads::LookupTable
        } else {
            CodebookReads::Direct
        }
    }
}

/// Estimated shared memory (bytes) of tier `tier_index`'s decode kernel as
/// the back end builds it for the roomiest target (see [`TierModel::reads`],
/// [`SharedMemory`]). Saturates at `u32::MAX`.
pub fn shared_memory_estimate(spec: &FormatSpec, tier_index: usize) -> u32 {
    let model = TierModel::of_spec(spec, tier_index);
    let parts = model.footprint(model.reads(Target::roomiest()));
    u32::try_from(parts.total()).unwrap_or(u32::MAX)
}

/// `module` as `target`'s kernel for `group_max` query heads reads it: its
/// key lookup tables inlined into the score where the model reads the
/// codewords directly.
pub fn for_target(module: &ValidModule, group_max: u32, target: Target) -> Cow<'_, ValidModule> {
    let model = TierModel::of_layout(&module.module().layout, group_max);
    if model.reads(target) == CodebookReads::LookupTable {
        return Cow::Borrowed(module);
    }
    let mut current = Cow::Borrowed(module);
    while let Some(inlined) = inline_lut(&current) {
        current =
            Cow::Owned(validate(inlined).expect("inlining a lookup table keeps the IR valid"));
    }
    current
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(body: &str, group: u32) -> TierModel {
        let text = format!(
            "name = \"t\"\nhead_dim = 128\n[page]\nmax_query_group = {group}\n[[tier]]\n\
             name = \"a\"\nkey.field = [{body}]\n\
             value.field = [{{ kind = \"dense\", dtype = \"f16\" }}]\n"
        );
        let spec = crate::front::parse_spec(&text, "t.toml").expect("a valid spec");
        TierModel::of_spec(&spec, 0)
    }

    #[test]
    fn tables_where_they_fit_and_pay() {
        let spherical = model(
            "{ kind = \"radius\", group_size = 16, bits = 8 }, { kind = \"codebook\", \
             group_size = 16, bits = 6, codewords = \"direction\", per_group = true }",
            8,
        );
        let vq = model(
            "{ kind = \"codebook\", group_size = 4, bits = 8, codewords = \"vector\" }",
            8,
        );
        let directions = model(
            "{ kind = \"radius\", group_size = 8, bits = 8 }, { kind = \"codebook\", \
             group_size = 8, bits = 8, codewords = \"direction\" }",
            8,
        );
        let scalar = model(
            "{ kind = \"codebook\", group_size = 1, bits = 4, codewords = \"vector\" }",
            1,
        );
        for target in Target::ALL {
            assert_eq!(spherical.reads(target), CodebookReads::LookupTable);
            assert_eq!(vq.reads(target), CodebookReads::Direct);
            assert_eq!(directions.reads(target), CodebookReads::Direct);
            // One coordinate per group: a table saves nothing.
            assert_eq!(scalar.reads(target), CodebookReads::Direct);
            // At GQA 4 the directions' tables fit again.
            let directions_gqa4 = TierModel {
                max_query_group: 4,
                ..directions.clone()
            };
            assert_eq!(directions_gqa4.reads(target), CodebookReads::LookupTable);
        }
        assert_eq!(
            spherical.footprint(CodebookReads::LookupTable).total(),
            65536
        );
        assert_eq!(vq.least().total(), 4 * (8 * 512 + 256 * 4));
        assert!(vq.footprint(CodebookReads::LookupTable).total() > u64::from(SHARED_MEMORY_BUDGET));
    }
}
