//! The code-format spec: what a user writes in TOML, as plain data.
//!
//! `front::toml` parses it (with source positions for errors) and checks that it
//! describes a possible format; `layout` and `lower` read only a checked spec.

use serde::{Deserialize, Serialize};

/// A whole format: head dimension, page parameters and one or more tiers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FormatSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    pub head_dim: u32,
    #[serde(default)]
    pub page: PageSpec,
    #[serde(default, skip_serializing_if = "CacheSpec::is_default")]
    pub cache: CacheSpec,
    #[serde(rename = "tier")]
    pub tiers: Vec<TierSpec>,
}

/// Page parameters shared by every tier of a format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PageSpec {
    /// Items (tokens) per page.
    #[serde(default = "PageSpec::default_items")]
    pub items: u32,
    /// Most query heads one kv head serves (GQA group); sizes shared memory.
    #[serde(default = "PageSpec::default_max_query_group")]
    pub max_query_group: u32,
}

impl PageSpec {
    fn default_items() -> u32 {
        64
    }
    fn default_max_query_group() -> u32 {
        8
    }
}

impl Default for PageSpec {
    fn default() -> Self {
        PageSpec {
            items: Self::default_items(),
            max_query_group: Self::default_max_query_group(),
        }
    }
}

/// What a live cache keeps exact, and the tier it compresses new pages into.
/// A page is compressed only when whole, so the exact tail holds `window` to
/// `window + items - 1` tokens once a sequence is long enough.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSpec {
    /// The first tokens of every sequence, kept exact.
    #[serde(default)]
    pub sinks: u32,
    /// The most recent tokens, kept exact.
    #[serde(default)]
    pub window: u32,
    /// How the exact rows are stored.
    #[serde(default)]
    pub exact: ExactDtype,
    /// The tier new pages are compressed into, by name; `None`: the first tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
}

impl CacheSpec {
    pub fn is_default(&self) -> bool {
        *self == CacheSpec::default()
    }
}

/// The storage of a live cache's exact rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExactDtype {
    #[default]
    F16,
    Bf16,
}

impl ExactDtype {
    pub fn bytes(self) -> u32 {
        2
    }
    pub fn name(self) -> &'static str {
        match self {
            ExactDtype::F16 => "f16",
            ExactDtype::Bf16 => "bf16",
        }
    }
}

/// One tier: how a key and a value of this tier are stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierSpec {
    pub name: String,
    pub key: CodecSpec,
    pub value: CodecSpec,
}

/// An optional transform followed by the fields stored per item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CodecSpec {
    #[serde(default)]
    pub transform: TransformSpec,
    #[serde(rename = "field")]
    pub fields: Vec<FieldSpec>,
}

/// Orthogonal or projection transform applied before quantization. The kernel
/// applies it to the query (keys) or to the accumulated output (values), never
/// to stored codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TransformSpec {
    #[default]
    Identity,
    Hadamard,
    Srht {
        seed: u64,
    },
    Pca {
        rank: u32,
        #[serde(default)]
        basis: BasisDtype,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BasisDtype {
    #[default]
    F16,
    I8,
}

/// One stored field of an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum FieldSpec {
    /// Quantized length per group; multiplies a `codebook` of unit directions.
    Radius {
        group_size: u32,
        bits: u32,
        #[serde(default)]
        scale: RadiusScale,
    },
    /// Index per group into 2^bits codewords.
    Codebook {
        group_size: u32,
        bits: u32,
        codewords: CodewordKind,
        #[serde(default)]
        per_group: bool,
        #[serde(default)]
        dtype: TableDtype,
    },
    /// Signed integer coefficients in the transform's basis.
    Coeff { bits: u32, scale: CoeffScale },
    /// Mask over element groups plus a fixed number of packed kept groups.
    Bitmap {
        group_size: u32,
        keep: u32,
        elem: BitmapElem,
    },
    /// The vector itself.
    Dense { dtype: DenseDtype },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RadiusScale {
    /// One f32 scale per page (the page's largest radius).
    #[default]
    Page,
    /// One f32 scale per group per page.
    PageGroup,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CodewordKind {
    /// Unit vectors (angle codebook); needs a `radius` field.
    Direction,
    /// Plain vectors (vector quantization).
    Vector,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TableDtype {
    #[default]
    F16,
    F32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CoeffScale {
    /// An f16 scale stored in every item.
    Item,
    /// One f32 scale per page.
    Page,
    /// One f32 scale per component per page (KIVI's per-channel keys).
    PageComponent,
    /// One trained f32 scale per component, in the format's tables.
    Component,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BitmapElem {
    F16,
    /// int8 elements with an f16 scale per item.
    Int8,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DenseDtype {
    F16,
    Bf16,
    F32,
}

impl DenseDtype {
    pub fn bits(self) -> u32 {
        match self {
            DenseDtype::F16 | DenseDtype::Bf16 => 16,
            DenseDtype::F32 => 32,
        }
    }
}

impl TransformSpec {
    /// Dimension of the codec's coordinate space after the transform.
    pub fn dims(&self, head_dim: u32) -> u32 {
        match *self {
            TransformSpec::Pca { rank, .. } => rank,
            _ => head_dim,
        }
    }
}

impl FieldSpec {
    pub fn kind_name(&self) -> &'static str {
        match self {
            FieldSpec::Radius { .. } => "radius",
            FieldSpec::Codebook { .. } => "codebook",
            FieldSpec::Coeff { .. } => "coeff",
            FieldSpec::Bitmap { .. } => "bitmap",
            FieldSpec::Dense { .. } => "dense",
        }
    }
}
