//! Encoders: dense keys and values in, tier-homogeneous pages out — plus the
//! trainers that fit a tier's tables and a reference decoder for round trips.

pub mod train;

use kvcc_compiler::back::clif::{self, PageEncoder};
use kvcc_compiler::back::interp::encode as reference;
use kvcc_compiler::layout::TierLayout;

pub use train::{train_tables, TrainOptions};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EncodeError {
    #[error(
        "{what} holds {found} values, which is not a whole number of {head_dim}-value vectors"
    )]
    Ragged {
        what: &'static str,
        found: usize,
        head_dim: usize,
    },
    #[error("{what} hold {found} values, which is not a [kv_heads {kv_heads}][tokens][head_dim {head_dim}] block")]
    Block {
        what: &'static str,
        found: usize,
        kv_heads: usize,
        head_dim: usize,
    },
    #[error("{what} is not finite ({value}) at {position}")]
    NonFinite {
        what: &'static str,
        value: f32,
        position: String,
    },
    #[error("keys hold {keys} tokens but values {values}")]
    KeysValues { keys: usize, values: usize },
    #[error("{tokens} tokens do not fit a page of {capacity} items")]
    PageOverflow { tokens: usize, capacity: u32 },
    #[error("tier {tier} does not exist; the format has {tiers} tiers")]
    UnknownTier { tier: usize, tiers: usize },
    #[error("the source cache has no sequence with a full page to replicate")]
    Empty,
    #[error("tables for {found} tiers given; the format has {tiers} tiers")]
    TierTables { found: usize, tiers: usize },
    #[error(
        "tier {tier}, kv head {kv_head}: table lengths {found:?}, the layout needs {expected:?}"
    )]
    TableShape {
        tier: String,
        kv_head: usize,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tables for {found} kv heads given; expected {expected}")]
    TableHeads { found: usize, expected: usize },
    #[error("the page buffer holds {found} bytes; a page of the tier {expected}")]
    PageSize { found: usize, expected: usize },
    /// A specialized (`kv_format!`) encoder was handed a page of a layout it
    /// was not generated for.
    #[error(
        "the encoder of format {encoder} has no tier laid out as tier {tier} (index {index}) is"
    )]
    ForeignLayout {
        encoder: String,
        tier: String,
        index: u32,
    },
}

/// Rejects non-finite inputs, naming the first bad position as `[index...]` of `dims`.
pub fn check_finite(what: &'static str, data: &[f32], dims: &[usize]) -> Result<(), EncodeError> {
    match data.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(at) => {
            let mut rest = at;
            let mut index = vec![0; dims.len()];
            for (slot, &d) in index.iter_mut().zip(dims).rev() {
                *slot = rest % d;
                rest /= d;
            }
            let names = ["kv_head", "token", "channel"];
            let position = index
                .iter()
                .zip(&names[names.len() - dims.len()..])
                .map(|(i, n)| format!("{n} {i}"))
                .collect::<Vec<_>>()
                .join(", ");
            Err(EncodeError::NonFinite {
                what,
                value: data[at],
                position,
            })
        }
    }
}

/// Checks the inputs of one page: `[token][head_dim]` keys and values, as
/// many of each, finite, at most `items_per_page` tokens. Returns the tokens.
pub fn check_page(
    head_dim: usize,
    items_per_page: u32,
    keys: &[f32],
    values: &[f32],
) -> Result<usize, EncodeError> {
    for (what, data) in [("keys", keys), ("values", values)] {
        if !data.len().is_multiple_of(head_dim) {
            return Err(EncodeError::Ragged {
                what,
                found: data.len(),
                head_dim,
            });
        }
        check_finite(what, data, &[data.len() / head_dim, head_dim])?;
    }
    let tokens = keys.len() / head_dim;
    if values.len() / head_dim != tokens {
        return Err(EncodeError::KeysValues {
            keys: tokens,
            values: values.len() / head_dim,
        });
    }
    if tokens > items_per_page as usize {
        return Err(EncodeError::PageOverflow {
            tokens,
            capacity: items_per_page,
        });
    }
    Ok(tokens)
}

/// [`check_page`] at a tier layout's head_dim and page size.
fn check_layout_page(
    layout: &TierLayout,
    keys: &[f32],
    values: &[f32],
) -> Result<usize, EncodeError> {
    check_page(
        layout.head_dim as usize,
        layout.items_per_page,
        keys,
        values,
    )
}

/// Encodes the tokens of one kv head (`[token][head_dim]`, at most one page)
/// into `page` (`layout.page_bytes`), with this head's `tables`.
pub fn encode_page(
    layout: &TierLayout,
    tables: &[Vec<f32>],
    keys: &[f32],
    values: &[f32],
    page: &mut [u8],
) -> Result<(), EncodeError> {
    check_layout_page(layout, keys, values)?;
    reference::encode_page(layout, tables, keys, values, page);
    Ok(())
}

/// [`encode_page`] by tier `layout`'s compiled encoder
/// (`clif::compile_encoder`, e.g. from `exec::page_encoder`): the same
/// checks and errors, the same bytes; `kv_head` (whose `tables` these are)
/// only names it in errors.
pub fn encode_page_compiled(
    encoder: &PageEncoder,
    layout: &TierLayout,
    kv_head: usize,
    tables: &[Vec<f32>],
    keys: &[f32],
    values: &[f32],
    page: &mut [u8],
) -> Result<(), EncodeError> {
    if encoder.layout() != layout {
        return Err(EncodeError::ForeignLayout {
            encoder: encoder.format().to_string(),
            tier: layout.name.clone(),
            index: layout.index,
        });
    }
    check_layout_page(layout, keys, values)?;
    match encoder.encode(tables, keys, values, page) {
        Ok(_) => Ok(()),
        Err(clif::EncodeError::Tables { found, expected }) => Err(EncodeError::TableShape {
            tier: layout.name.clone(),
            kv_head,
            found,
            expected,
        }),
        Err(clif::EncodeError::Page { found, expected }) => {
            Err(EncodeError::PageSize { found, expected })
        }
        Err(e) => unreachable!("check_page accepted what the encoder refuses: {e}"),
    }
}

/// Reference decoder: the dense keys and values a page stands for
/// (`[token][head_dim]` each). Kernels never do this; tests and fidelity do.
pub use reference::decode_page;
