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
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
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
    /// Which compressed pages a decode step reads; `None`: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub select: Option<SelectSpec>,
    /// What each compressed state stores: a tier chosen per state under a
    /// byte budget, or dropped; `None`: every page in `tier`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetSpec>,
}

/// `[cache.budget]`: Spherical KV's rate-distortion controller (seed 000
/// §2.2, appendix C). Per (sequence, kv head) the states leaving the exact
/// window are scored at every tier, start at the most expensive tier, are
/// down-tiered by least distortion per saved byte until the pages fit
/// `bytes_per_token`, and only then dropped; kept states are packed into
/// pages of one tier each.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BudgetSpec {
    /// Average page bytes per compressed state (per kv head; exact sinks
    /// and window are counted apart).
    pub bytes_per_token: f64,
    /// Whether states may be dropped once every state is at the cheapest tier.
    #[serde(default = "BudgetSpec::default_drop")]
    pub drop: bool,
    /// How a state's loss at each tier is estimated.
    #[serde(default)]
    pub score: BudgetScore,
    /// The fraction of states with the most attention mass pinned at the
    /// most expensive tier (never dropped).
    #[serde(default)]
    pub protect: f64,
    /// Decode steps between allocations of the states that left the window
    /// since the last one (old pages are never rewritten).
    #[serde(default = "BudgetSpec::default_refresh")]
    pub refresh: u32,
    /// Most recent queries per query head whose attention weighs the states
    /// (SnapKV's observation window).
    #[serde(default = "BudgetSpec::default_observe")]
    pub observe: u32,
}

impl BudgetSpec {
    /// A budget of `bytes_per_token` with every other key at its default.
    pub fn of_bytes(bytes_per_token: f64) -> BudgetSpec {
        BudgetSpec {
            bytes_per_token,
            drop: Self::default_drop(),
            score: BudgetScore::default(),
            protect: 0.0,
            refresh: Self::default_refresh(),
            observe: Self::default_observe(),
        }
    }

    fn default_drop() -> bool {
        true
    }
    /// Four 64-token pages: a refresh's partial pages stay a small share.
    fn default_refresh() -> u32 {
        256
    }
    /// SnapKV's observation window.
    fn default_observe() -> u32 {
        32
    }
}

/// What `[cache.budget]` estimates a state's loss by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetScore {
    /// The seed's distortion proxy times importance, measured: the squared
    /// first-order change of the observed queries' attention outputs when
    /// the state alone is coded at a tier (or dropped), from the state's
    /// own coding error and attention weights.
    #[default]
    Rd,
    /// The state's attention mass from the observed queries times the
    /// tier's mean relative coding error (dropping loses the whole state).
    Attention,
    /// As `attention`, the state's key norm in place of attention mass (no
    /// queries needed).
    KeyNorm,
}

impl BudgetScore {
    pub fn name(self) -> &'static str {
        match self {
            BudgetScore::Rd => "rd",
            BudgetScore::Attention => "attention",
            BudgetScore::KeyNorm => "key_norm",
        }
    }
}

/// `[cache.select]`: per (sequence, kv head), a decode step reads the exact
/// sinks and window and only the `budget` compressed pages its queries score
/// highest against each page's summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SelectSpec {
    pub method: SelectMethod,
    /// Budget in tokens of compressed pages (rounded up to whole pages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u32>,
    /// Budget in compressed pages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pages: Option<u32>,
    /// How the scores of a kv head's query heads combine into one per page.
    #[serde(default)]
    pub group: GroupScore,
    /// `block_mean`: tokens per block (a divisor of `page.items`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block: Option<u32>,
}

impl SelectSpec {
    /// Tokens per `block_mean` block when `block` is not given: MosaicKV's
    /// default (seed 004 §6).
    pub const DEFAULT_BLOCK: u32 = 8;
}

/// What a page's summary holds and how a query scores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectMethod {
    /// Quest: each channel's smallest and largest key of the page; the score
    /// is the upper bound `Σ_c max(q_c · min_c, q_c · max_c)` of `q · k`.
    Quest,
    /// MosaicKV's block keys: the mean key of every block of `block` tokens;
    /// the score is the largest `q · mean` of the page's blocks.
    BlockMean,
}

impl SelectMethod {
    pub fn name(self) -> &'static str {
        match self {
            SelectMethod::Quest => "quest",
            SelectMethod::BlockMean => "block_mean",
        }
    }
}

/// How a GQA group's query heads share one page choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupScore {
    /// The largest of the heads' scores: a page any head needs is kept.
    #[default]
    Max,
    /// The heads' scores summed.
    Sum,
}

impl GroupScore {
    pub fn name(self) -> &'static str {
        match self {
            GroupScore::Max => "max",
            GroupScore::Sum => "sum",
        }
    }
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
    /// Integer coefficients in the transform's basis: signed and symmetric,
    /// or (`zero_point`) unsigned min/max codes with a zero point per scale.
    Coeff {
        bits: u32,
        scale: CoeffScale,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        zero_point: bool,
        /// Channels per scale for `scale = "group"`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        group: Option<u32>,
    },
    /// Mask over element groups plus a fixed number of packed kept groups.
    Bitmap {
        group_size: u32,
        keep: u32,
        elem: BitmapElem,
    },
    /// The vector itself (fp8 dtypes optionally under a scale).
    Dense {
        dtype: DenseDtype,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scale: Option<Fp8Scale>,
    },
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
    /// An f16 scale per group of `group` channels, stored in every item.
    Group,
}

impl CoeffScale {
    /// Whether the scales (and zero points) are stored in the item.
    pub fn in_item(self) -> bool {
        matches!(self, CoeffScale::Item | CoeffScale::Group)
    }
}

/// The scale of fp8 elements: `x = scale * fp8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Scale {
    /// One trained f32 scale shared by every kv head of a layer, in the tables.
    Tensor,
    /// One trained f32 scale per (layer, kv head), in the tables.
    Head,
    /// One f32 scale per page, in the page header.
    Page,
    /// An f16 scale stored in every item.
    Item,
}

/// An 8-bit float format (OCP FP8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fp8 {
    /// 4 exponent bits (bias 7), 3 mantissa bits; no infinities, `S.1111.111`
    /// is NaN, largest finite 448 (the OCP "FN" variant).
    E4m3,
    /// 5 exponent bits (bias 15), 2 mantissa bits; IEEE-like (infinities,
    /// NaNs), largest finite 57344.
    E5m2,
}

impl Fp8 {
    /// Largest finite magnitude.
    pub fn max(self) -> f32 {
        match self {
            Fp8::E4m3 => 448.0,
            Fp8::E5m2 => 57344.0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Fp8::E4m3 => "fp8e4m3",
            Fp8::E5m2 => "fp8e5m2",
        }
    }

    /// The exact value of an fp8 code (low 8 bits of `raw`; NaN codes give NaN).
    pub fn decode(self, raw: u32) -> f32 {
        let (man_bits, bias, _) = self.encoding();
        let b = raw & 0xFF;
        let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let e = (b & 0x7F) >> man_bits;
        let m = b & ((1 << man_bits) - 1);
        let top = 0x7F >> man_bits;
        match self {
            Fp8::E4m3 if e == top && m == (1 << man_bits) - 1 => return f32::NAN,
            Fp8::E5m2 if e == top => {
                return if m == 0 {
                    sign * f32::INFINITY
                } else {
                    f32::NAN
                };
            }
            _ => {}
        }
        // Subnormals have the exponent of e = 1 and no implicit bit.
        let (significand, e) = match e {
            0 => (m, 1),
            _ => ((1 << man_bits) | m, e),
        };
        let exponent = e as i32 - bias as i32 - man_bits as i32;
        sign * significand as f32 * 2f32.powi(exponent)
    }

    /// The code of `x`: rounded to nearest, ties to even, saturating to the
    /// largest finite magnitude (infinities too); NaN gives the NaN code of
    /// `x`'s sign. Integer steps on the f32 bits, as the page-compress kernel
    /// emits them: subnormal results are `|x| · 2^(bias - 1 + mantissa bits)`
    /// rounded to an integer, normal ones the f32's exponent and top mantissa
    /// bits rebiased, plus one when the dropped bits round up.
    pub fn encode(self, x: f32) -> u32 {
        let (man_bits, bias, max_code) = self.encoding();
        let bits = x.to_bits();
        let sign = (bits >> 24) & 0x80;
        let a = bits & 0x7FFF_FFFF;
        if a > 0x7F80_0000 {
            return sign | 0x7F;
        }
        let code = if a < self.min_normal_bits() {
            let steps = f32::from_bits(a) * self.subnormal_steps();
            steps.round_ties_even() as u32
        } else {
            let drop = 23 - man_bits;
            let rest = a & ((1 << drop) - 1);
            let half = 1 << (drop - 1);
            let up = u32::from(rest > half || (rest == half && (a >> drop) & 1 == 1));
            (a >> drop) - ((127 - bias) << man_bits) + up
        };
        sign | code.min(max_code)
    }

    /// Mantissa bits, exponent bias and the largest finite code.
    pub fn encoding(self) -> (u32, u32, u32) {
        match self {
            Fp8::E4m3 => (3, 7, 0x7E),
            Fp8::E5m2 => (2, 15, 0x7B),
        }
    }

    /// The f32 bits of the smallest normal fp8 magnitude.
    pub fn min_normal_bits(self) -> u32 {
        let (_, bias, _) = self.encoding();
        (127 + 1 - bias) << 23
    }

    /// Subnormal fp8 steps per unit: `2^(bias - 1 + mantissa bits)`.
    pub fn subnormal_steps(self) -> f32 {
        let (man_bits, bias, _) = self.encoding();
        (1u32 << (bias - 1 + man_bits)) as f32
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BitmapElem {
    F16,
    /// int8 elements with an f16 scale per item.
    Int8,
    /// fp8 elements with an f16 scale per item.
    Fp8e4m3,
    Fp8e5m2,
}

impl BitmapElem {
    /// The fp8 format of fp8 elements.
    pub fn fp8(self) -> Option<Fp8> {
        match self {
            BitmapElem::Fp8e4m3 => Some(Fp8::E4m3),
            BitmapElem::Fp8e5m2 => Some(Fp8::E5m2),
            _ => None,
        }
    }

    /// Whether the kept elements share an f16 scale stored in the item.
    pub fn scaled(self) -> bool {
        self != BitmapElem::F16
    }

    /// Largest magnitude an element code stands for (the item scale maps the
    /// item's largest kept magnitude to it).
    pub fn code_max(self) -> f32 {
        match self {
            BitmapElem::F16 => 1.0,
            BitmapElem::Int8 => 127.0,
            BitmapElem::Fp8e4m3 | BitmapElem::Fp8e5m2 => self.fp8().expect("an fp8 element").max(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DenseDtype {
    F16,
    Bf16,
    F32,
    Fp8e4m3,
    Fp8e5m2,
}

impl DenseDtype {
    pub fn bits(self) -> u32 {
        match self {
            DenseDtype::F16 | DenseDtype::Bf16 => 16,
            DenseDtype::F32 => 32,
            DenseDtype::Fp8e4m3 | DenseDtype::Fp8e5m2 => 8,
        }
    }

    /// The fp8 format of an fp8 dtype.
    pub fn fp8(self) -> Option<Fp8> {
        match self {
            DenseDtype::Fp8e4m3 => Some(Fp8::E4m3),
            DenseDtype::Fp8e5m2 => Some(Fp8::E5m2),
            _ => None,
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

#[cfg(test)]
mod tests {
    use super::Fp8;

    /// Every code decodes to a number that encodes back to it (NaN codes to
    /// NaN), and encoding rounds to the nearest code, ties to even,
    /// saturating: checked against the decoded table by search.
    #[test]
    fn fp8_round_trips_and_rounds_to_nearest() {
        for format in [Fp8::E4m3, Fp8::E5m2] {
            let finite: Vec<(u32, f32)> = (0..256)
                .map(|c| (c, format.decode(c)))
                .filter(|(_, v)| v.is_finite())
                .collect();
            for &(c, v) in &finite {
                // -0 and +0 are distinct codes.
                assert_eq!(format.encode(v), c, "{format:?} code {c:#04x} = {v}");
            }
            assert!(format.decode(0x7F).is_nan() && format.decode(0xFF).is_nan());
            assert_eq!(format.encode(f32::NAN), 0x7F);
            assert_eq!(format.encode(1e30), format.encode(format.max()));
            assert_eq!(
                format.encode(f32::NEG_INFINITY),
                0x80 | format.encode(format.max())
            );
            let mut x = 1.0e-9f32;
            while x < 1.0e6 {
                for v in [x, -x] {
                    let got = format.decode(format.encode(v));
                    let best = finite
                        .iter()
                        .map(|&(_, f)| f)
                        .filter(|f| f.is_sign_negative() == v.is_sign_negative())
                        .min_by(|a, b| (a - v).abs().total_cmp(&(b - v).abs()))
                        .unwrap();
                    let clamped = v.clamp(-format.max(), format.max());
                    assert!(
                        (got - clamped).abs() <= (best - clamped).abs(),
                        "{format:?}: {v} -> {got}, nearest {best}"
                    );
                }
                x *= 1.0137;
            }
        }
        assert_eq!(Fp8::E4m3.decode(0x7E), 448.0);
        assert_eq!(Fp8::E4m3.decode(0x01), 2f32.powi(-9));
        assert_eq!(Fp8::E5m2.decode(0x7B), 57344.0);
        assert_eq!(Fp8::E5m2.decode(0x7C), f32::INFINITY);
        // A tie rounds to the even code: 1 + 1/16 lies between 1 and 1.125.
        assert_eq!(Fp8::E4m3.encode(1.0625), 0x38);
    }
}
