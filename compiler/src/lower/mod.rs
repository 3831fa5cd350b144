//! Lowering: a tier's layout becomes an IR [`crate::ir::Module`].
//!
//! Key and value codecs lower independently (`key`, `value`); `transform` holds
//! the transform stages both use, `fields` the field readers both use.
//! [`encode`] lowers a codec's layout to its encode description
//! ([`crate::ir::encode`]).

pub mod encode;
mod fields;
mod key;
mod transform;
mod value;

use crate::ir::{Arena, ArrayDecl, Handle, Module, TableDecl};
use crate::layout::TierLayout;

/// Layout table index -> IR table handle.
struct Tables(Vec<Handle<TableDecl>>);

impl Tables {
    fn get(&self, layout_index: usize) -> Handle<TableDecl> {
        self.0[layout_index]
    }
}

/// Lowers one tier of format `format` (its layout from [`TierLayout::new`]).
pub fn lower_tier(format: &str, layout: &TierLayout) -> Module {
    let mut tables = Arena::default();
    let handles = layout
        .tables
        .iter()
        .map(|t| {
            tables.append(TableDecl {
                name: t.name.clone(),
                len: t.len,
            })
        })
        .collect();
    let tables_map = Tables(handles);
    let mut arrays = Arena::default();
    let query = arrays.append(ArrayDecl {
        name: "query".into(),
        len: layout.head_dim,
    });
    let key = key::lower(
        &layout.key,
        layout.head_dim,
        query,
        &mut arrays,
        &tables_map,
    );
    let value = value::lower(&layout.value, layout.head_dim, &mut arrays, &tables_map);
    Module {
        format: format.to_string(),
        tier: layout.name.clone(),
        head_dim: layout.head_dim,
        layout: layout.clone(),
        tables,
        arrays,
        query,
        key,
        value,
    }
}
