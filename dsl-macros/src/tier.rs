//! One tier's module: page geometry, the key and value item layouts, the PTX
//! of its decode kernel, and its specialized `encode_page` / `decode_page`.

use kvcc_compiler::build::tier_report;
use kvcc_compiler::layout::{TierLayout, HEADER_FIXED_BYTES};
use kvcc_compiler::target::Target;
use proc_macro2::{Ident, TokenStream};
use quote::{format_ident, quote};

use crate::codec::Codec;

/// The `PTX_SM_80`-style constant of a target.
pub fn ptx_const(prefix: &str, target: Target) -> Ident {
    format_ident!("{}{}", prefix, target.name().to_uppercase())
}

/// `Target::Sm80 => PTX_SM_80, ...`: a `match` over the targets the PTX was generated for.
pub fn ptx_match(prefix: &str, targets: &[Target], krate: &TokenStream) -> TokenStream {
    let arms = targets.iter().map(|&t| {
        let variant = format_ident!("{}", format!("{t:?}"));
        let name = ptx_const(prefix, t);
        quote!(#krate::compiler::target::Target::#variant => #name,)
    });
    quote!(match target { #(#arms)* })
}

/// The module of tier `layout`, named `ident`; `ptx` holds its decode module
/// per target.
pub fn module(
    layout: &TierLayout,
    ident: &Ident,
    ptx: &[(Target, String)],
    krate: &TokenStream,
) -> TokenStream {
    let key = Codec {
        layout,
        codec: &layout.key,
        krate,
    };
    let value = Codec {
        layout,
        codec: &layout.value,
        krate,
    };
    let index = layout.index as usize;
    let index_u32 = layout.index;
    let name = &layout.name;
    let head_dim = layout.head_dim as usize;
    let items = layout.items_per_page as usize;
    let slots = layout.header_slots as usize;
    let header_bytes = layout.header_bytes as usize;
    let key_offset = layout.key_stream_offset as usize;
    let value_offset = layout.value_stream_offset as usize;
    let page_bytes = layout.page_bytes as usize;
    let (key_bytes, value_bytes) = (layout.key.stride as usize, layout.value.stride as usize);
    let table_lens = layout.tables.iter().map(|t| t.len as usize);
    let tables = layout.tables.len();
    let scales_start = HEADER_FIXED_BYTES as usize;
    let scales_end = scales_start + 4 * slots;

    let (key_consts, value_consts) = (key.constants(), value.constants());
    let (encode_key, encode_value) = (key.encoder(), value.encoder());
    let (decode_key, decode_value) = (key.decoder(), value.decoder());
    let encode = |codec: &Codec, data: TokenStream, start: usize, stride: usize| {
        let f = codec.encoder_name();
        let tables = codec.uses_tables().then(|| quote!(tables,));
        let scales = codec.uses_header().then(|| quote!(&mut scales,));
        quote!(#f(#tables #data, #scales &mut page[#start..#start + tokens * #stride]);)
    };
    let decode_keys = decode_call(&key, key_offset, key_bytes, quote!(keys));
    let decode_values = decode_call(&value, value_offset, value_bytes, quote!(values));
    let encode_keys = encode(&key, quote!(keys), key_offset, key_bytes);
    let encode_values = encode(&value, quote!(values), value_offset, value_bytes);
    let scales_used = key.uses_header() || value.uses_header();
    let scales_decl = if scales_used {
        quote!(let mut scales = [0.0f32; #slots];)
    } else {
        quote!(let scales = [0.0f32; #slots];)
    };
    let scales_read = if scales_used {
        quote! {
            let scales: [f32; #slots] = ::core::array::from_fn(|i| {
                f32::from_le_bytes(*header[#scales_start + 4 * i..].first_chunk::<4>().expect("header slots"))
            });
        }
    } else {
        quote!()
    };

    let ptx_consts = ptx.iter().map(|(target, text)| {
        let c = ptx_const("PTX_", *target);
        let doc = format!(
            "PTX of the tier's decode kernel for {} (`kvcc_compiler::back::ptx::write` with `Options::for_target`).",
            target.name()
        );
        quote! {
            #[doc = #doc]
            pub const #c: &str = #text;
        }
    });
    let targets: Vec<Target> = ptx.iter().map(|(t, _)| *t).collect();
    let ptx_match = ptx_match("PTX_", &targets, krate);
    let doc = format!("Tier `{name}`.\n\n```text\n{}```", tier_report(layout));

    quote! {
        #[doc = #doc]
        pub mod #ident {
            /// Index of the tier in the format (its pages' tier word, `PageRef::tier`).
            pub const INDEX: usize = #index;
            pub const NAME: &str = #name;
            pub const HEAD_DIM: usize = #head_dim;
            pub const ITEMS_PER_PAGE: usize = #items;
            /// f32 scale slots in the page header (the key codec's first).
            pub const HEADER_SLOTS: usize = #slots;
            pub const HEADER_BYTES: usize = #header_bytes;
            /// Byte offset of the key stream in a page.
            pub const KEY_STREAM_OFFSET: usize = #key_offset;
            /// Byte offset of the value stream in a page.
            pub const VALUE_STREAM_OFFSET: usize = #value_offset;
            pub const PAGE_BYTES: usize = #page_bytes;
            /// f32 values of each of the tier's tables (what `train_tables` returns per kv head).
            pub const TABLE_LENS: [usize; #tables] = [#(#table_lens),*];

            #key_consts
            #value_consts
            #(#ptx_consts)*

            /// The PTX of the tier's decode kernel for `target`.
            pub fn ptx(target: #krate::compiler::target::Target) -> &'static str {
                #ptx_match
            }

            /// The tier's layout, as the compiler computes it.
            pub fn layout() -> &'static #krate::compiler::layout::TierLayout {
                super::format().layout(INDEX)
            }

            /// Encodes the tokens of one kv head (`[token][HEAD_DIM]` keys and
            /// values, at most a page) into `page` (at least `PAGE_BYTES`; all
            /// of it is written) with this head's `tables`: the bytes
            /// `kvcc_runtime::encode::encode_page` writes, specialized.
            pub fn encode_page(
                tables: &[::std::vec::Vec<f32>],
                keys: &[f32],
                values: &[f32],
                page: &mut [u8],
            ) -> ::core::result::Result<(), #krate::encode::EncodeError> {
                let tokens = #krate::encode::check_page(#head_dim, #items as u32, keys, values)?;
                #scales_decl
                #encode_keys
                page[#key_offset + tokens * #key_bytes..#value_offset].fill(0);
                #encode_values
                page[#value_offset + tokens * #value_bytes..].fill(0);
                let header = &mut page[..#header_bytes];
                header[0..4].copy_from_slice(&#index_u32.to_le_bytes());
                header[4..8].copy_from_slice(&(tokens as u32).to_le_bytes());
                header[8..#scales_start].fill(0);
                for (slot, s) in header[#scales_start..#scales_end].chunks_exact_mut(4).zip(&scales) {
                    slot.copy_from_slice(&s.to_le_bytes());
                }
                header[#scales_end..].fill(0);
                Ok(())
            }

            /// The dense keys and values (`[token][HEAD_DIM]` each) a page of
            /// this tier stands for: `kvcc_runtime::encode::decode_page`, specialized.
            pub fn decode_page(tables: &[::std::vec::Vec<f32>], page: &[u8]) -> (::std::vec::Vec<f32>, ::std::vec::Vec<f32>) {
                let header = &page[..#header_bytes];
                let count = u32::from_le_bytes(*header[4..8].first_chunk::<4>().expect("count word")) as usize;
                #scales_read
                let mut keys = ::std::vec::Vec::with_capacity(count * #head_dim);
                let mut values = ::std::vec::Vec::with_capacity(count * #head_dim);
                #decode_keys
                #decode_values
                (keys, values)
            }

            #encode_key
            #encode_value
            #decode_key
            #decode_value
        }
    }
}

/// The call of a codec's decoder over the `count` items of its stream.
fn decode_call(codec: &Codec, start: usize, stride: usize, out: TokenStream) -> TokenStream {
    let f = codec.decoder_name();
    let tables = codec.uses_tables().then(|| quote!(tables,));
    let scales = codec.uses_header().then(|| quote!(&scales,));
    quote!(#f(#tables #scales &page[#start..#start + count * #stride], &mut #out);)
}
