//! The page encoder of a tier as native code: one kv head's key and value
//! rows (`count <= items_per_page` tokens) and tables in, one page out
//! (header included), byte-identical to `runtime::encode::encode_page`.
//!
//! ```text
//! encode(keys, values, count, tables, scratch)
//! ```
//!
//! The function walks the tier's layout (fields, item schema, header
//! slots) as the CPU encoder does, with the loops over items, groups,
//! codewords and coordinates inside the generated code (`side.rs`), and
//! every number computed as `encode::ops` computes it (`num.rs`). It builds
//! the page in a zeroed image in `scratch` (8 spare bytes after it, so every
//! element is one 8-byte read-modify-write); [`PageEncoder::encode`] copies
//! it out.

mod num;
mod side;

use cranelift_codegen::ir::{types, InstBuilder};

use super::module::{Code, Jit};
use super::Error;
use crate::layout::{round_up, CodecLayout, FieldLayout, Side, TierLayout};

type EncodeFn = unsafe extern "C" fn(*const f32, *const f32, u32, *const *const f32, *mut u8);

/// Groups of a codec's body (codebook or bitmap), or 0.
fn groups(codec: &CodecLayout) -> u32 {
    match *codec.body() {
        FieldLayout::Codebook { groups, .. } | FieldLayout::Bitmap { groups, .. } => groups,
        _ => 0,
    }
}

/// Byte offsets of the scratch regions (each 16-byte aligned), sized for
/// the larger side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Scratch {
    /// `items * dims` f32: the transformed items.
    x: u32,
    /// `items * groups` u32: codeword indices.
    codes: u32,
    /// `items * groups` f32: radii.
    aux: u32,
    /// `groups` i32: one item's bitmap energies as total-order keys.
    keys: u32,
    /// `groups + 1` u32: one item's kept bitmap groups, ascending.
    kept: u32,
    /// One item's bitmap mask words.
    mask: u32,
    /// `2 * dims` f32: one item's in-item coeff `(scale, zero)` pairs, one
    /// per channel group (a codec has at most one coeff field).
    pairs: u32,
    /// The page being built, `page_bytes + 8`.
    image: u32,
    bytes: u32,
}

impl Scratch {
    fn new(layout: &TierLayout) -> Scratch {
        let codecs = [&layout.key, &layout.value];
        let dims = codecs.iter().map(|c| c.dims).max().unwrap_or(0);
        let groups = codecs.iter().map(|c| groups(c)).max().unwrap_or(0);
        let items = layout.items_per_page;
        let mut at = 0;
        let mut region = |bytes: u32| {
            let start = at;
            at += round_up(bytes.max(16), 16);
            start
        };
        Scratch {
            x: region(4 * items * dims),
            codes: region(4 * items * groups),
            aux: region(4 * items * groups),
            keys: region(4 * groups),
            kept: region(4 * (groups + 1)),
            mask: region(4 * groups.div_ceil(32)),
            pairs: region(8 * dims),
            image: region(layout.page_bytes + 8),
            bytes: at,
        }
    }
}

/// Why [`PageEncoder::encode`] refused its arguments.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EncodeError {
    #[error("{what} hold {found} values, not a whole number of {head_dim}-value rows")]
    Ragged {
        what: &'static str,
        found: usize,
        head_dim: usize,
    },
    #[error("keys hold {keys} tokens but values {values}")]
    KeysValues { keys: usize, values: usize },
    #[error("{tokens} tokens do not fit a page of {capacity} items")]
    PageOverflow { tokens: usize, capacity: usize },
    #[error("{what} hold a non-finite value ({value}) at row {row}, channel {channel}")]
    NonFinite {
        what: &'static str,
        value: f32,
        row: usize,
        channel: usize,
    },
    #[error("table lengths {found:?}, the layout needs {expected:?}")]
    Tables {
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("the page buffer holds {found} bytes, a page {expected}")]
    Page { found: usize, expected: usize },
}

/// One tier's compiled page encoder.
pub struct PageEncoder {
    format: String,
    layout: TierLayout,
    head_dim: usize,
    items_per_page: usize,
    page_bytes: usize,
    table_lens: Vec<usize>,
    scratch: Scratch,
    encode: EncodeFn,
    _code: Code,
}

impl std::fmt::Debug for PageEncoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageEncoder")
            .field("head_dim", &self.head_dim)
            .field("items_per_page", &self.items_per_page)
            .field("page_bytes", &self.page_bytes)
            .finish_non_exhaustive()
    }
}

/// Compiles the page encoder of tier `layout` of format `format` for the
/// host, with Cranelift `settings` over the defaults.
pub fn compile_encoder(
    format: &str,
    layout: &TierLayout,
    settings: &[(String, String)],
) -> Result<PageEncoder, Error> {
    let error = |kind| Error {
        format: format.to_string(),
        tier: layout.name.clone(),
        kind,
    };
    let scratch = Scratch::new(layout);
    let ptr = types::I64;
    let mut jit = Jit::new(settings).map_err(error)?;
    let id = jit
        .define(
            "encode",
            &[ptr, ptr, types::I32, ptr, ptr],
            1,
            |fx, params| {
                let &[keys, values, count, tables, scratch_base] = params else {
                    unreachable!("encode takes five arguments")
                };
                let args = side::Args {
                    tables,
                    scratch: scratch_base,
                    count,
                };
                for (side, input) in [(Side::Key, keys), (Side::Value, values)] {
                    side::encode_side(fx, layout, layout.codec(side), input, &args, &scratch);
                }
                // Header: tier, count; flags and reserved stay 0, the scales
                // are in place.
                let image = fx.row(scratch_base, num::Ix::K(0), 0, scratch.image);
                let tier = fx.i32c(layout.index);
                fx.st(image, num::Ix::K(0), tier);
                fx.st(image, num::Ix::K(1), count);
                fx.b.ins().return_(&[]);
            },
        )
        .map_err(error)?;
    let (code, [address]) = jit.finish([id]).map_err(error)?;
    Ok(PageEncoder {
        format: format.to_string(),
        layout: layout.clone(),
        head_dim: layout.head_dim as usize,
        items_per_page: layout.items_per_page as usize,
        page_bytes: layout.page_bytes as usize,
        table_lens: layout.tables.iter().map(|t| t.len as usize).collect(),
        scratch,
        // SAFETY: `address` is the function just defined with the
        // signature of `EncodeFn`; `code` lives as long as the pointer.
        encode: unsafe { std::mem::transmute::<*const u8, EncodeFn>(address) },
        _code: code,
    })
}

impl PageEncoder {
    /// The format the encoder was compiled for.
    pub fn format(&self) -> &str {
        &self.format
    }

    /// The tier the encoder was compiled for.
    pub fn layout(&self) -> &TierLayout {
        &self.layout
    }

    /// Encodes the tokens of one kv head (`keys` and `values` each
    /// `[token][head_dim]`, at most a page, finite) with this head's
    /// `tables` into `page` (`page_bytes`); returns the tokens. Checks what
    /// `encode_page` checks, plus the table and page sizes.
    pub fn encode(
        &self,
        tables: &[Vec<f32>],
        keys: &[f32],
        values: &[f32],
        page: &mut [u8],
    ) -> Result<usize, EncodeError> {
        let d = self.head_dim;
        for (what, data) in [("keys", keys), ("values", values)] {
            if !data.len().is_multiple_of(d) {
                return Err(EncodeError::Ragged {
                    what,
                    found: data.len(),
                    head_dim: d,
                });
            }
            if let Some(at) = data.iter().position(|v| !v.is_finite()) {
                return Err(EncodeError::NonFinite {
                    what,
                    value: data[at],
                    row: at / d,
                    channel: at % d,
                });
            }
        }
        let tokens = keys.len() / d;
        if values.len() / d != tokens {
            return Err(EncodeError::KeysValues {
                keys: tokens,
                values: values.len() / d,
            });
        }
        if tokens > self.items_per_page {
            return Err(EncodeError::PageOverflow {
                tokens,
                capacity: self.items_per_page,
            });
        }
        let lens: Vec<usize> = tables.iter().map(Vec::len).collect();
        if lens != self.table_lens {
            return Err(EncodeError::Tables {
                found: lens,
                expected: self.table_lens.clone(),
            });
        }
        if page.len() != self.page_bytes {
            return Err(EncodeError::Page {
                found: page.len(),
                expected: self.page_bytes,
            });
        }
        let pointers: Vec<*const f32> = tables.iter().map(|t| t.as_ptr()).collect();
        let mut scratch = vec![0u8; self.scratch.bytes as usize];
        // SAFETY: every buffer has the size the code was generated for
        // (checked above); `tokens <= items_per_page`.
        unsafe {
            (self.encode)(
                keys.as_ptr(),
                values.as_ptr(),
                tokens as u32,
                pointers.as_ptr(),
                scratch.as_mut_ptr(),
            )
        };
        let image = self.scratch.image as usize;
        page.copy_from_slice(&scratch[image..image + self.page_bytes]);
        Ok(tokens)
    }
}
