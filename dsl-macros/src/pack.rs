//! Constant-offset bit packing: an item as little-endian 64-bit words, each
//! assembled from (or split into) the elements overlapping it with shifts
//! known at expansion time. Where an element lies in the words comes from the
//! layout's [`WordSplit`], the bit order `read_bits` / `write_bits` define.

use kvcc_compiler::layout::bits::{self, words, WordSplit};
use proc_macro2::{Ident, Literal, TokenStream};
use quote::{format_ident, quote};

/// One stored element: a `u32` expression, its first bit and its width (1..=32).
pub struct Element {
    pub value: TokenStream,
    pub offset: u32,
    pub width: u32,
}

fn mask(width: u32) -> Literal {
    Literal::u64_unsuffixed(bits::mask(width))
}

/// Statements that write `elements` into `item` (an `&mut [u8; stride]`).
/// Every byte of the item is written: bits no element covers are 0.
pub fn pack(item: &Ident, elements: &[Element], stride: u32) -> TokenStream {
    let mut parts: Vec<Vec<TokenStream>> = vec![Vec::new(); words(stride) as usize];
    for e in elements {
        let split = WordSplit::new(e.offset, e.width);
        let (word, shift) = (split.word as usize, split.shift);
        let value = &e.value;
        let bits = mask(e.width);
        let masked = quote!((u64::from(#value) & #bits));
        parts[word].push(if shift == 0 {
            masked.clone()
        } else {
            quote!(#masked << #shift)
        });
        if let Some(back) = split.spill() {
            parts[word + 1].push(quote!(#masked >> #back));
        }
    }
    let stores = parts.iter().enumerate().map(|(k, parts)| {
        let word = if parts.is_empty() {
            quote!(0u64)
        } else {
            quote!(#(#parts)|*)
        };
        let start = 8 * k;
        let end = (start + 8).min(stride as usize);
        let bytes = end - start;
        quote!(#item[#start..#end].copy_from_slice(&(#word).to_le_bytes()[..#bytes]);)
    });
    quote!(#(#stores)*)
}

/// Statements binding the item's words (`w0`, `w1`, ...) from `item` (an
/// `&[u8; stride]`), and a reader of elements from them.
pub struct Words {
    stride: u32,
}

impl Words {
    pub fn new(stride: u32) -> Words {
        Words { stride }
    }

    fn word(k: u32) -> Ident {
        format_ident!("w{}", k)
    }

    /// `let wK: u64 = ...;` for every word of the item.
    pub fn load(&self, item: &Ident) -> TokenStream {
        let loads = (0..words(self.stride)).map(|k| {
            let w = Self::word(k);
            let start = 8 * k as usize;
            let end = (start + 8).min(self.stride as usize);
            if end - start == 8 {
                quote!(let #w = u64::from_le_bytes(*#item[#start..#end].first_chunk::<8>().expect("8 bytes"));)
            } else {
                let len = end - start;
                quote! {
                    let #w = {
                        let mut tail = [0u8; 8];
                        tail[..#len].copy_from_slice(&#item[#start..#end]);
                        u64::from_le_bytes(tail)
                    };
                }
            }
        });
        quote!(#(#loads)*)
    }

    /// The `u32` element at `offset`, `width` bits wide (1..=32).
    pub fn read(&self, offset: u32, width: u32) -> TokenStream {
        let split = WordSplit::new(offset, width);
        let (k, shift) = (split.word, split.shift);
        let lo = Self::word(k);
        let bits = mask(width);
        let joined = match split.spill() {
            _ if shift == 0 => quote!(#lo),
            Some(back) => {
                let hi = Self::word(k + 1);
                quote!((#lo >> #shift | #hi << #back))
            }
            None => quote!((#lo >> #shift)),
        };
        quote!((#joined & #bits) as u32)
    }
}
