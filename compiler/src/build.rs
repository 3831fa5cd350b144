//! Build-time generation for a user's `build.rs`: a spec file in, its PTX
//! modules and a layout report written into `OUT_DIR`.
//!
//! ```no_run
//! // build.rs
//! use kvcc_compiler::target::Target;
//!
//! fn main() {
//!     let out = std::env::var_os("OUT_DIR").unwrap();
//!     if let Err(e) = kvcc_compiler::build::generate("specs/my.toml", out, &Target::ALL) {
//!         panic!("{e}");
//!     }
//! }
//! ```
//!
//! Files are named as under the repository's `generated/` (one source of
//! truth: [`ptx::file_name`], [`ptx::merge_file_name`], default
//! [`ptx::Options::for_target`]), in a folder named after the format.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::back::ptx;
use crate::layout::{
    BitRange, CodecLayout, FieldLayout, SlotRole, TableStorage, TierLayout, TransformLayout,
};
use crate::target::Target;
use serde::Serialize;

use crate::{CompileError, Format};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Compile(#[from] CompileError),
    #[error("{format}: {source}")]
    Ptx {
        format: String,
        #[source]
        source: ptx::Error,
    },
    #[error("{}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Name of the layout report inside `<out_dir>/<format>/`.
pub const LAYOUT_REPORT: &str = "layout.txt";

/// Compiles the spec at `spec_path` and writes, under `<out_dir>/<format name>/`,
/// every tier's decode module and the merge module for each of `targets`
/// (`<tier>.<target>.ptx`, `merge.<target>.ptx`) and the layout report
/// ([`LAYOUT_REPORT`]). Prints `cargo:rerun-if-changed` for the spec, so Cargo
/// reruns the build script when it is edited. Returns the written paths.
pub fn generate(
    spec_path: impl AsRef<Path>,
    out_dir: impl AsRef<Path>,
    targets: &[Target],
) -> Result<Vec<PathBuf>, Error> {
    let spec_path = spec_path.as_ref();
    // Before compiling: a spec with errors must still be watched, or fixing
    // it would not rerun the build script.
    println!("cargo:rerun-if-changed={}", spec_path.display());
    let format = Format::load(spec_path)?;
    let dir = out_dir.as_ref().join(format.name());
    std::fs::create_dir_all(&dir).map_err(|source| Error::Io {
        path: dir.clone(),
        source,
    })?;
    let mut files = vec![(dir.join(LAYOUT_REPORT), layout_report(&format))];
    for &target in targets {
        let output = ptx::write(&format, &ptx::Options::for_target(target)).map_err(|source| {
            Error::Ptx {
                format: format.name().to_string(),
                source,
            }
        })?;
        for tier in output.tiers {
            files.push((dir.join(ptx::file_name(&tier.tier, target)), tier.ptx));
        }
        files.push((dir.join(ptx::merge_file_name(target)), output.merge.ptx));
    }
    files
        .into_iter()
        .map(|(path, text)| {
            // Unchanged files are left alone so their timestamps do not
            // trigger rebuilds of whatever includes them.
            if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
                std::fs::write(&path, text).map_err(|source| Error::Io {
                    path: path.clone(),
                    source,
                })?;
            }
            Ok(path)
        })
        .collect()
}

/// Where every field of every tier lives: page geometry, bit ranges, header
/// slots and tables, as text.
pub fn layout_report(format: &Format) -> String {
    let mut out = format!(
        "format {}: head_dim {}, {} items per page\n",
        format.name(),
        format.head_dim(),
        format.spec().page.items
    );
    for t in 0..format.tiers().len() {
        out.push_str(&tier_report(format.layout(t)));
    }
    out
}

/// One tier of [`layout_report`].
pub fn tier_report(layout: &TierLayout) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "tier {} ({}): page {} B, header {} B ({} scale slots), key stream at byte {}, value stream at byte {}",
        layout.name,
        layout.index,
        layout.page_bytes,
        layout.header_bytes,
        layout.header_slots,
        layout.key_stream_offset,
        layout.value_stream_offset
    );
    for codec in [&layout.key, &layout.value] {
        codec_report(&mut out, codec, layout);
    }
    for (index, table) in layout.tables.iter().enumerate() {
        let storage = match table.storage {
            TableStorage::F32 => "f32".to_string(),
            TableStorage::F16 => "f16".to_string(),
            TableStorage::I8Columns { columns } => format!("i8 + {columns} f32 column scales"),
        };
        let _ = writeln!(
            out,
            "  table {index} {}: {} values, {storage}, {} B stored",
            table.name, table.len, table.stored_bytes
        );
    }
    out
}

fn codec_report(out: &mut String, codec: &CodecLayout, layout: &TierLayout) {
    let transform = match codec.transform {
        TransformLayout::Identity => "identity".to_string(),
        TransformLayout::Hadamard => "hadamard".to_string(),
        TransformLayout::Srht { seed, .. } => format!("srht seed {seed}"),
        TransformLayout::Pca { rank, .. } => format!("pca rank {rank}"),
    };
    let _ = writeln!(
        out,
        "  {} ({transform}, {} dims): {} bits, {} B per item",
        codec.side.name(),
        codec.dims,
        codec.bits,
        codec.stride
    );
    let table = |t: usize| format!("table {t} {}", layout.tables[t].name);
    let range = |role| {
        let r: BitRange = codec.slot(role);
        format!("bits {}..{}", r.offset, r.end())
    };
    for field in &codec.fields {
        let line = match *field {
            FieldLayout::Radius {
                groups,
                group_size,
                bits,
                scale,
                slot,
                ..
            } => format!(
                "radius    {}: {groups} x {bits} bits, groups of {group_size}, scale {} from header slot {slot}",
                range(SlotRole::RadiusCode),
                spelled(scale)
            ),
            FieldLayout::Codebook {
                groups,
                group_size,
                bits,
                codewords,
                per_group,
                table: t,
                ..
            } => format!(
                "codebook  {}: {groups} x {bits} bits, groups of {group_size}, {} codewords{}, {}",
                range(SlotRole::CodebookIndex),
                spelled(codewords),
                if per_group { " per group" } else { "" },
                table(t)
            ),
            FieldLayout::Coeff {
                item_scale,
                count,
                bits,
                scale,
                slot,
                table: t,
                ..
            } => {
                let source = match (item_scale, t) {
                    (Some(_), _) => format!("f16 item scale at {}", range(SlotRole::ItemScale)),
                    (None, Some(t)) => table(t),
                    (None, None) => format!("header slot {slot}"),
                };
                format!(
                    "coeff     {}: {count} x {bits} bits, scale {} ({source})",
                    range(SlotRole::Coefficient),
                    spelled(scale)
                )
            }
            FieldLayout::Bitmap {
                groups,
                group_size,
                keep,
                elem,
                item_scale,
                ..
            } => {
                let scale = item_scale
                    .map(|_| format!(", f16 item scale at {}", range(SlotRole::ItemScale)))
                    .unwrap_or_default();
                format!(
                    "bitmap    mask {}: {groups} groups of {group_size}{scale}, {keep} kept: {} {} elements at {}",
                    range(SlotRole::MaskBit),
                    keep * group_size,
                    spelled(elem),
                    range(SlotRole::BitmapElement)
                )
            }
            FieldLayout::Dense { count, dtype, .. } => format!(
                "dense     {}: {count} x {}",
                range(SlotRole::DenseValue),
                spelled(dtype)
            ),
        };
        let _ = writeln!(out, "    {line}");
    }
}

/// A spec enum value as the spec spells it (`page_group`).
fn spelled(value: impl Serialize) -> String {
    match ::toml::Value::try_from(value) {
        Ok(::toml::Value::String(name)) => name,
        other => unreachable!("spec enums serialize as strings, got {other:?}"),
    }
}
