//! `kv_format!`: a kvcc spec file becomes a Rust module at compile time.
//!
//! ```ignore
//! kvcc_runtime::kv_format!("specs/spherical.toml");          // pub mod spherical { ... }
//! kvcc_runtime::kv_format!(pub(crate) mod sph = "specs/spherical.toml");
//! ```
//!
//! Call it through the runtime (`kvcc_runtime::kv_format!`, or `kvcc::kv_format!`):
//! that wrapper passes its own path (`crate = $crate;`), and every path of the
//! expansion starts there, so the calling crate needs no other dependency.
//!
//! The path is relative to the calling crate's `CARGO_MANIFEST_DIR`. The
//! short form names the module after the format's `name`; the long form
//! takes attributes, a visibility and a module name. A tier's module is
//! named after the tier. In both, `-` becomes `_`, a keyword becomes a raw
//! identifier, and a name that is not an identifier otherwise (a leading
//! digit) is prefixed with `format_` / `tier_`.
//!
//! The module holds:
//!
//! - `SPEC` (the TOML text), `SPEC_FILE`, `NAME`, `HEAD_DIM`, `ITEMS_PER_PAGE`,
//!   `TIERS`, `MERGE_PTX_SM_80` / `MERGE_PTX_SM_90` and `merge_ptx(target)`;
//! - `format()`: the compiled `kvcc_compiler::Format` (built once from
//!   `SPEC`), what `PagedCache`, the trainers and every executor take;
//! - `encode_page` / `decode_page` with the signatures of
//!   `kvcc_runtime::encode::encode_page` / `decode_page`, dispatching on the
//!   layout's tier (`PagedCache::append_sequence_with(.., spherical::encode_page)`);
//! - per tier, a module with the page geometry (`PAGE_BYTES`, `HEADER_SLOTS`,
//!   stream offsets, ...), `key` / `value` modules with the item layout
//!   (`BITS`, `BYTES`, and per field its bit `OFFSET`, element `BITS`, counts,
//!   header slot, table), `PTX_SM_80` / `PTX_SM_90` and `ptx(target)`, and
//!   the tier's specialized `encode_page` / `decode_page`: every size and bit
//!   offset a constant, fields packed a 64-bit word at a time, the numbers
//!   from the same `kvcc_compiler::back::interp::encode::ops` helpers as
//!   the reference encoder, so the pages are byte-identical to its pages.
//!
//! The generated code names only the runtime (`<runtime>::encode`, and the
//! compiler as `<runtime>::compiler`). A spec error is a compile error at the
//! macro call with the message `kvcc check` prints
//! (`file:line:column: field.path: message`). The spec file is tracked
//! (`include_bytes!`), so editing it rebuilds the calling crate.

extern crate proc_macro;

mod codec;
mod constants;
mod pack;
mod tier;

use std::path::PathBuf;

use kvcc_compiler::back::ptx;
use kvcc_compiler::build::layout_report;
use kvcc_compiler::front::SpecError;
use kvcc_compiler::target::Target;
use kvcc_compiler::{CompileError, Format};
use proc_macro2::{Ident, Span, TokenStream};
use quote::{format_ident, quote};
use syn::parse::{Parse, ParseStream};
use syn::{Attribute, LitStr, Token, Visibility};

/// `[crate = PATH;] "path"`, or `[crate = PATH;] #[attrs] vis mod name = "path"`:
/// `PATH` is the runtime crate the expansion names (`$crate` of the runtime's
/// `kv_format!`, which passes it), `::kvcc_runtime` when left out.
struct Input {
    krate: TokenStream,
    attrs: Vec<Attribute>,
    vis: Visibility,
    name: Option<Ident>,
    path: LitStr,
}

impl Parse for Input {
    fn parse(input: ParseStream) -> syn::Result<Input> {
        let mut krate = quote!(::kvcc_runtime);
        if input.peek(Token![crate]) && input.peek2(Token![=]) {
            input.parse::<Token![crate]>()?;
            input.parse::<Token![=]>()?;
            krate = TokenStream::new();
            while !input.peek(Token![;]) {
                krate.extend([input.parse::<proc_macro2::TokenTree>()?]);
            }
            input.parse::<Token![;]>()?;
        }
        if input.peek(LitStr) {
            return Ok(Input {
                krate,
                attrs: Vec::new(),
                vis: syn::parse_quote!(pub),
                name: None,
                path: input.parse()?,
            });
        }
        let attrs = input.call(Attribute::parse_outer)?;
        let vis = input.parse()?;
        input.parse::<Token![mod]>()?;
        let name = input.parse()?;
        input.parse::<Token![=]>()?;
        Ok(Input {
            krate,
            attrs,
            vis,
            name: Some(name),
            path: input.parse()?,
        })
    }
}

/// See the [crate documentation](crate).
#[proc_macro]
pub fn kv_format(input: proc_macro::TokenStream) -> proc_macro::TokenStream {
    let input = syn::parse_macro_input!(input as Input);
    expand(&input)
        .unwrap_or_else(|errors| {
            let errors = errors
                .iter()
                .map(|e| syn::Error::new(input.path.span(), e).to_compile_error());
            quote!(#(#errors)*)
        })
        .into()
}

/// The module, or every error message (each becomes a compile error).
fn expand(input: &Input) -> Result<TokenStream, Vec<String>> {
    let file = input.path.value();
    let krate = &input.krate;
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR").ok_or_else(|| {
        vec!["CARGO_MANIFEST_DIR is not set: kv_format! runs under Cargo".to_string()]
    })?;
    let absolute = PathBuf::from(manifest_dir).join(&file);
    let tracked = absolute
        .to_str()
        .ok_or_else(|| vec![format!("{}: the path is not UTF-8", absolute.display())])?
        .to_string();
    let source = std::fs::read_to_string(&absolute).map_err(|source| {
        vec![SpecError::Io {
            file: file.clone(),
            source,
        }
        .to_string()]
    })?;
    let format = Format::parse(&source, &file).map_err(|e| match e {
        CompileError::Spec(SpecError::Invalid(diagnostics)) => {
            diagnostics.iter().map(ToString::to_string).collect()
        }
        other => vec![other.to_string()],
    })?;
    let ptx = Target::ALL
        .iter()
        .map(|&target| ptx::write(&format, &ptx::Options::for_target(target)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| vec![format!("{file}: {e}")])?;

    let module_name = match &input.name {
        Some(name) => name.clone(),
        None => identifier(format.name(), "format_"),
    };
    let tier_idents: Vec<Ident> = (0..format.tiers().len())
        .map(|t| identifier(&format.layout(t).name, "tier_"))
        .collect();
    for (t, a) in tier_idents.iter().enumerate() {
        if tier_idents[..t].contains(a) {
            return Err(vec![format!(
                "{file}: two tiers map to the module name `{a}`; rename one of them"
            )]);
        }
    }
    let tiers = tier_idents.iter().enumerate().map(|(t, ident)| {
        let per_target: Vec<(Target, String)> = ptx
            .iter()
            .map(|out| (out.target, out.tiers[t].ptx.clone()))
            .collect();
        tier::module(format.layout(t), ident, &per_target, krate)
    });
    let merge_consts = ptx.iter().map(|out| {
        let c = tier::ptx_const("MERGE_PTX_", out.target);
        let text = &out.merge.ptx;
        let doc = format!(
            "PTX of the format's merge kernel for {}.",
            out.target.name()
        );
        quote! {
            #[doc = #doc]
            pub const #c: &str = #text;
        }
    });
    let merge_match = tier::ptx_match("MERGE_PTX_", &Target::ALL, krate);
    let arms_encode = tier_idents
        .iter()
        .enumerate()
        .map(|(t, ident)| quote!(Some(#t) => #ident::encode_page(tables, keys, values, page),));
    let arms_decode = tier_idents
        .iter()
        .enumerate()
        .map(|(t, ident)| quote!(Some(#t) => #ident::decode_page(tables, page),));
    let tier_names = (0..format.tiers().len()).map(|t| format.layout(t).name.clone());
    let tier_count = format.tiers().len();
    let name = format.name();
    let head_dim = format.head_dim() as usize;
    let items = format.spec().page.items as usize;
    let attrs = &input.attrs;
    let vis = &input.vis;
    let doc = format!(
        "Format `{name}` from `{file}` (`kv_format!`).\n\n```text\n{}```",
        layout_report(&format)
    );

    Ok(quote! {
        #(#attrs)*
        #[doc = #doc]
        #vis mod #module_name {
            // Editing the spec rebuilds the calling crate: the compiler
            // tracks files that `include_bytes!` reads.
            const _: &[u8] = include_bytes!(#tracked);

            /// The spec's TOML text.
            pub const SPEC: &str = #source;
            /// The spec file, as the `kv_format!` call names it.
            pub const SPEC_FILE: &str = #file;
            pub const NAME: &str = #name;
            pub const HEAD_DIM: usize = #head_dim;
            pub const ITEMS_PER_PAGE: usize = #items;
            /// Tier names, by tier index.
            pub const TIERS: [&str; #tier_count] = [#(#tier_names),*];
            #(#merge_consts)*

            /// The PTX of the format's merge kernel for `target`.
            pub fn merge_ptx(target: #krate::compiler::target::Target) -> &'static str {
                #merge_match
            }

            /// The compiled format (built from `SPEC` on first use): what
            /// `PagedCache`, the trainers and the executors take.
            pub fn format() -> &'static #krate::compiler::Format {
                static FORMAT: ::std::sync::OnceLock<#krate::compiler::Format> = ::std::sync::OnceLock::new();
                FORMAT.get_or_init(|| {
                    #krate::compiler::Format::parse(SPEC, SPEC_FILE)
                        .expect("kv_format! compiled this spec when it expanded")
                })
            }

            /// The tier `layout` is, if it is one of this format's.
            fn tier_of(layout: &#krate::compiler::layout::TierLayout) -> Option<usize> {
                let t = layout.index as usize;
                (t < #tier_count && format().layout(t) == layout).then_some(t)
            }

            /// `kvcc_runtime::encode::encode_page` for this format's tiers, specialized
            /// (same signature, same bytes); a layout of another format is an error.
            pub fn encode_page(
                layout: &#krate::compiler::layout::TierLayout,
                tables: &[::std::vec::Vec<f32>],
                keys: &[f32],
                values: &[f32],
                page: &mut [u8],
            ) -> ::core::result::Result<(), #krate::encode::EncodeError> {
                match tier_of(layout) {
                    #(#arms_encode)*
                    _ => Err(#krate::encode::EncodeError::ForeignLayout {
                        encoder: NAME.to_string(),
                        tier: layout.name.clone(),
                        index: layout.index,
                    }),
                }
            }

            /// `kvcc_runtime::encode::decode_page` for this format's tiers, specialized.
            ///
            /// # Panics
            /// If `layout` is not one of this format's tiers, or `page` is
            /// shorter than the layout says.
            pub fn decode_page(
                layout: &#krate::compiler::layout::TierLayout,
                tables: &[::std::vec::Vec<f32>],
                page: &[u8],
            ) -> (::std::vec::Vec<f32>, ::std::vec::Vec<f32>) {
                match tier_of(layout) {
                    #(#arms_decode)*
                    _ => panic!("tier {} is not a tier of format {}", layout.name, NAME),
                }
            }

            #(#tiers)*
        }
    })
}

/// `name` as a module identifier: `-` as `_`, keywords raw, and `prefix`
/// before names that cannot be identifiers (a leading digit).
fn identifier(name: &str, prefix: &str) -> Ident {
    let name = name.replace('-', "_");
    if syn::parse_str::<Ident>(&name).is_ok() {
        return Ident::new(&name, Span::call_site());
    }
    if let Ok(raw) = syn::parse_str::<Ident>(&format!("r#{name}")) {
        return raw;
    }
    format_ident!("{}{}", prefix, name)
}
