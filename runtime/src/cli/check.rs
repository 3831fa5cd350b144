//! `kvcc check SPEC`: validate a spec and print each tier's layout.

use kvcc_compiler::front::check::shared_memory_estimate;
use kvcc_compiler::layout::{CodecLayout, FieldLayout, TierLayout, TransformLayout};
use kvcc_compiler::Format;
use serde::Serialize;

use super::policy::{self, PolicyReport};
use crate::table::Table;

/// One tier's byte accounting.
#[derive(Debug, Clone, Serialize)]
pub struct TierReport {
    pub tier: String,
    pub key: String,
    pub value: String,
    pub key_bytes: u32,
    pub value_bytes: u32,
    pub header_bytes: u32,
    pub page_items: u32,
    pub page_bytes: u32,
    pub table_bytes: u32,
    pub shared_memory_bytes: u32,
    pub context: u32,
    /// Per token per kv head, header and tables amortized over `context`.
    pub effective_bytes_per_token: f64,
    /// Dense f16 K+V bytes per token per kv head divided by the effective bytes.
    pub compression: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct FormatReport {
    pub format: String,
    pub head_dim: u32,
    pub dense_f16_bytes_per_token: u32,
    pub tiers: Vec<TierReport>,
    /// The `[cache]` policy and its bytes per token at the same context,
    /// exact rows included.
    pub cache: PolicyReport,
}

pub fn report(format: &Format, context: u32) -> FormatReport {
    let dense = 4 * format.head_dim();
    let tiers = (0..format.tiers().len())
        .map(|t| {
            let layout = format.layout(t);
            let effective = layout.effective_bytes_per_token(context);
            TierReport {
                tier: layout.name.clone(),
                key: describe(&layout.key),
                value: describe(&layout.value),
                key_bytes: layout.key.stride,
                value_bytes: layout.value.stride,
                header_bytes: layout.header_bytes,
                page_items: layout.items_per_page,
                page_bytes: layout.page_bytes,
                table_bytes: layout.table_bytes(),
                shared_memory_bytes: shared_memory_estimate(format.spec(), t),
                context,
                effective_bytes_per_token: effective,
                compression: f64::from(dense) / effective,
            }
        })
        .collect();
    FormatReport {
        format: format.name().to_string(),
        head_dim: format.head_dim(),
        dense_f16_bytes_per_token: dense,
        tiers,
        cache: policy::report(format, context as usize),
    }
}

/// "pca32 | coeff 8b x32 (page_component)" style summary of a codec.
pub fn describe(codec: &CodecLayout) -> String {
    let transform = match codec.transform {
        TransformLayout::Identity => None,
        TransformLayout::Hadamard => Some("hadamard".to_string()),
        TransformLayout::Srht { seed, .. } => Some(format!("srht(seed {seed})")),
        TransformLayout::Pca { rank, .. } => Some(format!("pca{rank}")),
    };
    let fields = codec.fields.iter().map(|f| match *f {
        FieldLayout::Radius { groups, bits, .. } => format!("radius {groups}x{bits}b"),
        FieldLayout::Codebook {
            groups,
            group_size,
            bits,
            codewords,
            ..
        } => format!("{:?} codebook {groups}x{bits}b (g{group_size})", codewords).to_lowercase(),
        FieldLayout::Coeff {
            count, bits, scale, ..
        } => format!("coeff {count}x{bits}b ({scale:?})").to_lowercase(),
        FieldLayout::Bitmap {
            groups,
            group_size,
            keep,
            elem,
            ..
        } => format!("bitmap {keep}/{groups} groups of {group_size} ({elem:?})").to_lowercase(),
        FieldLayout::Dense { count, dtype, .. } => {
            format!("dense {count}x{dtype:?}").to_lowercase()
        }
    });
    transform
        .into_iter()
        .chain(fields)
        .collect::<Vec<_>>()
        .join(" + ")
}

pub fn render(report: &FormatReport) -> String {
    let mut table = Table::new(&[
        "tier", "key", "value", "K B/item", "V B/item", "header B", "page B", "tables B", "smem B",
        "B/token", "vs f16",
    ]);
    for column in 3..11 {
        table.right_align(column);
    }
    for t in &report.tiers {
        table.row(vec![
            t.tier.clone(),
            t.key.clone(),
            t.value.clone(),
            t.key_bytes.to_string(),
            t.value_bytes.to_string(),
            t.header_bytes.to_string(),
            t.page_bytes.to_string(),
            t.table_bytes.to_string(),
            t.shared_memory_bytes.to_string(),
            format!("{:.2}", t.effective_bytes_per_token),
            format!("{:.2}x", t.compression),
        ]);
    }
    format!(
        "format {} (head_dim {}, dense f16 K+V = {} B/token/kv head; B/token amortizes headers and tables over {} tokens)\n{}",
        report.format,
        report.head_dim,
        report.dense_f16_bytes_per_token,
        report.tiers.first().map_or(0, |t| t.context),
        table
    )
}

pub fn tier_layouts(format: &Format) -> impl Iterator<Item = &TierLayout> {
    (0..format.tiers().len()).map(|t| format.layout(t))
}
