//! One codec (key or value) of one tier: its layout constants and its
//! specialized item encoder and decoder.
//!
//! The generated code does what `kvcc_runtime::encode::encode_page` and
//! `decode_page` do for this codec, with every size and bit offset a
//! constant: the numbers come from the same `kvcc_runtime::encode::ops`
//! helpers (so pages are byte-identical), the fields are not walked at run
//! time, and bits are packed a 64-bit word at a time (`pack`).

use kvcc_compiler::layout::{
    bitmap_elem_bits, coeff_max, CodecLayout, FieldLayout, TierLayout, TransformLayout,
    ITEM_SCALE_BITS,
};
use kvcc_compiler::spec::{BitmapElem, CodewordKind, CoeffScale, DenseDtype, RadiusScale};
use proc_macro2::{Ident, Literal, TokenStream};
use quote::{format_ident, quote};

use crate::pack::{pack, Element, Words};

fn lit(v: u32) -> Literal {
    Literal::u32_unsuffixed(v)
}

fn ops() -> TokenStream {
    quote!(::kvcc_runtime::encode::ops)
}

/// Bits of a mask word of a bitmap field.
const MASK_WORD: u32 = 32;

pub struct Codec<'a> {
    pub layout: &'a TierLayout,
    pub codec: &'a CodecLayout,
}

/// The radius field of a direction codebook, as the codebook's encoder uses it.
struct Radius {
    offset: u32,
    bits: u32,
    scale: RadiusScale,
    slot: u32,
}

impl Codec<'_> {
    fn side(&self) -> &'static str {
        self.codec.side.name()
    }

    pub fn encoder_name(&self) -> Ident {
        format_ident!("encode_{}", self.side())
    }

    pub fn decoder_name(&self) -> Ident {
        format_ident!("decode_{}", self.side())
    }

    fn radius(&self) -> Option<Radius> {
        match self.codec.radius() {
            Some(&FieldLayout::Radius {
                offset,
                bits,
                scale,
                slot,
                ..
            }) => Some(Radius {
                offset,
                bits,
                scale,
                slot,
            }),
            _ => None,
        }
    }

    /// Whether the codec stores scales in the page header: encoding then
    /// needs every item before the first can be packed (a pass that measures,
    /// then one that packs), and decoding reads them.
    pub fn uses_header(&self) -> bool {
        match *self.codec.body() {
            FieldLayout::Coeff { scale, .. } => {
                matches!(scale, CoeffScale::Page | CoeffScale::PageComponent)
            }
            _ => self.codec.radius().is_some(),
        }
    }

    /// Indices of the tables this codec reads.
    fn tables(&self) -> Vec<usize> {
        let mut used = match self.codec.transform {
            TransformLayout::Identity | TransformLayout::Hadamard => vec![],
            TransformLayout::Srht { signs, .. } => vec![signs],
            TransformLayout::Pca { basis, mean, .. } => vec![basis, mean],
        };
        match *self.codec.body() {
            FieldLayout::Codebook { table, .. } => used.push(table),
            FieldLayout::Coeff {
                table: Some(table), ..
            } => used.push(table),
            _ => {}
        }
        used
    }

    pub fn uses_tables(&self) -> bool {
        !self.tables().is_empty()
    }

    /// `let table_N: &[f32; LEN] = ...;` for every table the codec reads.
    fn bind_tables(&self) -> TokenStream {
        let binds = self.tables().into_iter().map(|t| {
            let name = table(t);
            let len = self.layout.tables[t].len as usize;
            quote! {
                let #name: &[f32; #len] = tables[#t][..#len].try_into().expect("sliced to its length");
            }
        });
        quote!(#(#binds)*)
    }

    fn dims(&self) -> usize {
        self.codec.dims as usize
    }

    fn head_dim(&self) -> usize {
        self.layout.head_dim as usize
    }

    /// Statements binding `y: &[f32; dims]`, the transformed coordinates of
    /// `x: &[f32; head_dim]`.
    fn forward(&self) -> TokenStream {
        let ops = ops();
        let dims = self.dims();
        match self.codec.transform {
            TransformLayout::Identity => quote!(let y: &[f32; #dims] = x;),
            TransformLayout::Hadamard => quote! {
                let mut y = *x;
                #ops::fwht_normalized(&mut y);
                let y = &y;
            },
            TransformLayout::Srht { signs, .. } => {
                let signs = table(signs);
                quote! {
                    let mut y = *x;
                    #ops::srht_forward(&mut y, #signs);
                    let y = &y;
                }
            }
            TransformLayout::Pca { basis, mean, .. } => {
                let (basis, mean) = (table(basis), table(mean));
                quote! {
                    let mut y = [0.0f32; #dims];
                    #ops::pca_forward(#basis, #mean, x, &mut y);
                    let y = &y;
                }
            }
        }
    }

    /// Statements appending the head-space vector of `y` (mutable, `dims`) to `out`.
    fn inverse(&self) -> TokenStream {
        let ops = ops();
        let head_dim = self.head_dim();
        match self.codec.transform {
            TransformLayout::Identity => quote!(out.extend_from_slice(&y);),
            TransformLayout::Hadamard => quote! {
                #ops::fwht_normalized(&mut y);
                out.extend_from_slice(&y);
            },
            TransformLayout::Srht { signs, .. } => {
                let signs = table(signs);
                quote! {
                    #ops::srht_inverse(&mut y, #signs);
                    out.extend_from_slice(&y);
                }
            }
            TransformLayout::Pca { basis, mean, .. } => {
                let (basis, mean) = (table(basis), table(mean));
                quote! {
                    let mut x = [0.0f32; #head_dim];
                    #ops::pca_inverse(#basis, #mean, &y, &mut x);
                    out.extend_from_slice(&x);
                }
            }
        }
    }

    /// `fn encode_<side>(...)`: transforms, measures page scales where the
    /// codec has them, and packs every item of `data` into `stream`.
    pub fn encoder(&self) -> TokenStream {
        let name = self.encoder_name();
        let head_dim = self.head_dim();
        let stride = self.codec.stride as usize;
        let slots = self.layout.header_slots as usize;
        let bind_tables = self.bind_tables();
        let forward = self.forward();
        let item = format_ident!("item");
        let tables_param = self
            .uses_tables()
            .then(|| quote!(tables: &[::std::vec::Vec<f32>],));
        let scales_param = self
            .uses_header()
            .then(|| quote!(scales: &mut [f32; #slots],));
        let doc = format!(
            "Encodes `data` (`[token][{head_dim}]`) as {} items into `stream`.",
            self.side()
        );
        let body = match self.plan() {
            Plan::OnePass {
                item: stmts,
                elements,
            } => {
                let pack = pack(&item, &elements, self.codec.bits.div_ceil(8));
                quote! {
                    for (x, #item) in data.chunks_exact(#head_dim).zip(stream.chunks_exact_mut(#stride)) {
                        let x: &[f32; #head_dim] = x.try_into().expect("chunks_exact");
                        let #item: &mut [u8; #stride] = #item.try_into().expect("chunks_exact");
                        #forward
                        #stmts
                        #pack
                    }
                }
            }
            Plan::TwoPass {
                init,
                measure,
                finish,
                keep_y,
                item: stmts,
                elements,
            } => {
                let pack = pack(&item, &elements, self.codec.bits.div_ceil(8));
                let dims = self.dims();
                let (store_y, init_y, load_y) = match (keep_y, self.codec.transform) {
                    (false, _) => (quote!(), quote!(), quote!()),
                    // The identity's coordinates are the input: read it again.
                    (true, TransformLayout::Identity) => (
                        quote!(),
                        quote!(),
                        quote! {
                            let y: &[f32; #dims] = data[i * #head_dim..(i + 1) * #head_dim]
                                .try_into()
                                .expect("a whole vector");
                        },
                    ),
                    (true, _) => (
                        quote!(ys.push(*y);),
                        quote! {
                            let mut ys: ::std::vec::Vec<[f32; #dims]> =
                                ::std::vec::Vec::with_capacity(data.len() / #head_dim);
                        },
                        quote!(let y = &ys[i];),
                    ),
                };
                quote! {
                    #init
                    #init_y
                    for x in data.chunks_exact(#head_dim) {
                        let x: &[f32; #head_dim] = x.try_into().expect("chunks_exact");
                        #forward
                        #measure
                        #store_y
                    }
                    #finish
                    for (i, #item) in stream.chunks_exact_mut(#stride).enumerate() {
                        let #item: &mut [u8; #stride] = #item.try_into().expect("chunks_exact");
                        #load_y
                        #stmts
                        #pack
                    }
                }
            }
        };
        quote! {
            #[doc = #doc]
            fn #name(#tables_param data: &[f32], #scales_param stream: &mut [u8]) {
                #bind_tables
                #body
            }
        }
    }

    /// How the items are encoded.
    fn plan(&self) -> Plan {
        let ops = ops();
        match *self.codec.body() {
            FieldLayout::Codebook {
                offset,
                groups,
                group_size,
                bits,
                codewords,
                per_group,
                table: t,
            } => {
                let (g, book_len) = (group_size as usize, (1usize << bits) * group_size as usize);
                let groups_n = groups as usize;
                let book = table(t);
                let book_start = if per_group {
                    quote!(j * #book_len)
                } else {
                    quote!(0)
                };
                let index_elements = || {
                    (0..groups).map(move |j| {
                        let ju = j as usize;
                        Element {
                            value: quote!(index[#ju]),
                            offset: offset + j * bits,
                            width: bits,
                        }
                    })
                };
                match (codewords, self.radius()) {
                    (CodewordKind::Direction, Some(radius)) => {
                        let max = match radius.scale {
                            RadiusScale::Page => {
                                let slot = radius.slot as usize;
                                quote!(scales[#slot] = #ops::scale_or_one(group_max.iter().copied().fold(0.0, f32::max));)
                            }
                            RadiusScale::PageGroup => {
                                let slot = radius.slot as usize;
                                quote! {
                                    for j in 0..#groups_n {
                                        scales[#slot + j] = #ops::scale_or_one(group_max[j]);
                                    }
                                }
                            }
                        };
                        let scale = match radius.scale {
                            RadiusScale::Page => {
                                let slot = radius.slot as usize;
                                quote!(scales[#slot])
                            }
                            RadiusScale::PageGroup => {
                                let slot = radius.slot as usize;
                                quote!(scales[#slot + j])
                            }
                        };
                        let rbits = lit(radius.bits);
                        let mut elements: Vec<Element> = (0..groups)
                            .map(|j| {
                                let ju = j as usize;
                                Element {
                                    value: quote!(code[#ju]),
                                    offset: radius.offset + j * radius.bits,
                                    width: radius.bits,
                                }
                            })
                            .collect();
                        elements.extend(index_elements());
                        let head_dim = self.head_dim();
                        Plan::TwoPass {
                            init: quote! {
                                let mut group_max = [0.0f32; #groups_n];
                                let tokens = data.len() / #head_dim;
                                let mut indices: ::std::vec::Vec<[u32; #groups_n]> = ::std::vec::Vec::with_capacity(tokens);
                                let mut radii: ::std::vec::Vec<[f32; #groups_n]> = ::std::vec::Vec::with_capacity(tokens);
                            },
                            measure: quote! {
                                let mut index = [0u32; #groups_n];
                                let mut radius = [0.0f32; #groups_n];
                                for j in 0..#groups_n {
                                    let part = &y[j * #g..(j + 1) * #g];
                                    let book = &#book[#book_start..][..#book_len];
                                    let k = #ops::best_direction(book, #ops::Fixed::<#g>, part);
                                    index[j] = k as u32;
                                    radius[j] = #ops::radius_of(part, &book[k * #g..(k + 1) * #g]);
                                    group_max[j] = group_max[j].max(radius[j]);
                                }
                                indices.push(index);
                                radii.push(radius);
                            },
                            finish: max,
                            keep_y: false,
                            item: quote! {
                                let index = &indices[i];
                                let code: [u32; #groups_n] = ::core::array::from_fn(|j| {
                                    #ops::radius_code(radii[i][j], #scale, #rbits)
                                });
                            },
                            elements,
                        }
                    }
                    _ => Plan::OnePass {
                        item: quote! {
                            let mut index = [0u32; #groups_n];
                            for j in 0..#groups_n {
                                let part = &y[j * #g..(j + 1) * #g];
                                let book = &#book[#book_start..][..#book_len];
                                index[j] = #ops::nearest(book, #ops::Fixed::<#g>, part) as u32;
                            }
                        },
                        elements: index_elements().collect(),
                    },
                }
            }
            FieldLayout::Coeff {
                item_scale,
                offset,
                count,
                bits,
                scale,
                slot,
                table: t,
            } => {
                let n = count as usize;
                let b = lit(bits);
                let slot = slot as usize;
                let mut elements: Vec<Element> = (0..count)
                    .map(|c| {
                        let cu = c as usize;
                        Element {
                            value: quote!(code[#cu]),
                            offset: offset + c * bits,
                            width: bits,
                        }
                    })
                    .collect();
                let quantize = |s: TokenStream| {
                    quote! {
                        let code: [u32; #n] = ::core::array::from_fn(|c| #ops::quantize(y[c], #s, #b));
                    }
                };
                match scale {
                    CoeffScale::Item => {
                        let q = Literal::f32_suffixed(coeff_max(bits) as f32);
                        let quantize = quantize(quote!(scale));
                        elements.push(Element {
                            value: quote!(#ops::f16_bits(scale)),
                            offset: item_scale.expect("item scales have a position"),
                            width: ITEM_SCALE_BITS,
                        });
                        Plan::OnePass {
                            item: quote! {
                                let scale = #ops::half_scale(y.iter().fold(0.0f32, |m, v| m.max(v.abs())), #q);
                                #quantize
                            },
                            elements,
                        }
                    }
                    CoeffScale::Component => {
                        let scales = table(t.expect("component scales have a table"));
                        Plan::OnePass {
                            item: quantize(quote!(#scales[c])),
                            elements,
                        }
                    }
                    CoeffScale::Page => Plan::TwoPass {
                        init: quote!(let mut max = 0.0f32;),
                        measure: quote!(max = y.iter().fold(max, |m, v| m.max(v.abs()));),
                        finish: quote!(scales[#slot] = #ops::coeff_scale(max, #b);),
                        keep_y: true,
                        item: quantize(quote!(scales[#slot])),
                        elements,
                    },
                    CoeffScale::PageComponent => Plan::TwoPass {
                        init: quote!(let mut max = [0.0f32; #n];),
                        measure: quote! {
                            for (m, v) in max.iter_mut().zip(y) {
                                *m = m.max(v.abs());
                            }
                        },
                        finish: quote! {
                            for (c, m) in max.iter().enumerate() {
                                scales[#slot + c] = #ops::coeff_scale(*m, #b);
                            }
                        },
                        keep_y: true,
                        item: quantize(quote!(scales[#slot + c])),
                        elements,
                    },
                }
            }
            FieldLayout::Bitmap {
                mask_offset,
                groups,
                group_size,
                keep,
                elem,
                item_scale,
                elems_offset,
            } => {
                let (g, groups_n, keep_n) = (group_size as usize, groups as usize, keep as usize);
                let kept_elems = keep_n * g;
                let mask_words = groups.div_ceil(MASK_WORD);
                let mask_words_n = mask_words as usize;
                let elem_bits = bitmap_elem_bits(elem);
                let mut elements: Vec<Element> = (0..mask_words)
                    .map(|w| {
                        let wu = w as usize;
                        Element {
                            value: quote!(mask[#wu]),
                            offset: mask_offset + w * MASK_WORD,
                            width: (groups - w * MASK_WORD).min(MASK_WORD),
                        }
                    })
                    .collect();
                elements.extend((0..keep * group_size).map(|e| {
                    let eu = e as usize;
                    Element {
                        value: quote!(elems[#eu]),
                        offset: elems_offset + e * elem_bits,
                        width: elem_bits,
                    }
                }));
                let (scale, convert) = match elem {
                    BitmapElem::F16 => (quote!(), quote!(#ops::f16_bits(v))),
                    BitmapElem::Int8 => {
                        elements.push(Element {
                            value: quote!(#ops::f16_bits(scale)),
                            offset: item_scale.expect("int8 elements have an item scale"),
                            width: ITEM_SCALE_BITS,
                        });
                        let q = Literal::f32_suffixed(coeff_max(8) as f32);
                        (
                            quote! {
                                let scale = #ops::half_scale(
                                    kept.iter()
                                        .flat_map(|&j| &y[j * #g..(j + 1) * #g])
                                        .fold(0.0f32, |m, v| m.max(v.abs())),
                                    #q,
                                );
                            },
                            quote!(#ops::quantize(v, scale, 8)),
                        )
                    }
                };
                Plan::OnePass {
                    item: quote! {
                        let energy: [f32; #groups_n] = ::core::array::from_fn(|j| #ops::energy(&y[j * #g..(j + 1) * #g]));
                        let mut order = [0usize; #groups_n];
                        let kept = #ops::keep_largest(&energy, #keep_n, &mut order);
                        let mut mask = [0u32; #mask_words_n];
                        for &j in kept {
                            mask[j / 32] |= 1 << (j % 32);
                        }
                        #scale
                        let elems: [u32; #kept_elems] = ::core::array::from_fn(|e| {
                            let v = y[kept[e / #g] * #g + e % #g];
                            #convert
                        });
                    },
                    elements,
                }
            }
            FieldLayout::Dense {
                offset,
                count,
                dtype,
            } => {
                let n = count as usize;
                let width = dtype.bits();
                let convert = match dtype {
                    DenseDtype::F16 => quote!(#ops::f16_bits(v)),
                    DenseDtype::Bf16 => quote!(#ops::bf16_bits(v)),
                    DenseDtype::F32 => quote!(v.to_bits()),
                };
                Plan::OnePass {
                    item: quote! {
                        let elems: [u32; #n] = ::core::array::from_fn(|c| {
                            let v = y[c];
                            #convert
                        });
                    },
                    elements: (0..count)
                        .map(|c| {
                            let cu = c as usize;
                            Element {
                                value: quote!(elems[#cu]),
                                offset: offset + c * width,
                                width,
                            }
                        })
                        .collect(),
                }
            }
            FieldLayout::Radius { .. } => unreachable!("body() is never a radius"),
        }
    }

    /// `fn decode_<side>(...)`: every item of `stream` back to head-space
    /// vectors appended to `out`, as the runtime's reference decoder does.
    pub fn decoder(&self) -> TokenStream {
        let name = self.decoder_name();
        let stride = self.codec.stride as usize;
        let dims = self.dims();
        let slots = self.layout.header_slots as usize;
        let bind_tables = self.bind_tables();
        let words = Words::new(self.codec.stride);
        let item = format_ident!("item");
        let load = words.load(&item);
        let inverse = self.inverse();
        let body = self.decode_body(&words);
        let tables_param = self
            .uses_tables()
            .then(|| quote!(tables: &[::std::vec::Vec<f32>],));
        let scales_param = self.uses_header().then(|| quote!(scales: &[f32; #slots],));
        let doc = format!("Decodes the {} items of `stream` onto `out`.", self.side());
        quote! {
            #[doc = #doc]
            fn #name(#tables_param #scales_param stream: &[u8], out: &mut ::std::vec::Vec<f32>) {
                #bind_tables
                for #item in stream.chunks_exact(#stride) {
                    let #item: &[u8; #stride] = #item.try_into().expect("chunks_exact");
                    #load
                    let mut y = [0.0f32; #dims];
                    #body
                    #inverse
                }
            }
        }
    }

    /// Statements filling `y` from the item's words.
    fn decode_body(&self, words: &Words) -> TokenStream {
        let ops = ops();
        let array = |count: u32, offset: u32, width: u32| {
            let reads = (0..count).map(|i| words.read(offset + i * width, width));
            quote!([#(#reads),*])
        };
        match *self.codec.body() {
            FieldLayout::Codebook {
                offset,
                groups,
                group_size,
                bits,
                per_group,
                table: t,
                ..
            } => {
                let (g, book_len, groups_n) = (
                    group_size as usize,
                    (1usize << bits) * group_size as usize,
                    groups as usize,
                );
                let book = table(t);
                let book_start = if per_group {
                    quote!(j * #book_len)
                } else {
                    quote!(0)
                };
                let indices = array(groups, offset, bits);
                let (codes, set) = match self.radius() {
                    Some(radius) => {
                        let slot = radius.slot as usize;
                        let scale = match radius.scale {
                            RadiusScale::Page => quote!(scales[#slot]),
                            RadiusScale::PageGroup => quote!(scales[#slot + j]),
                        };
                        let rbits = lit(radius.bits);
                        let codes = array(groups, radius.offset, radius.bits);
                        (
                            quote!(let code: [u32; #groups_n] = #codes;),
                            quote! {
                                let r = #ops::radius_value(code[j], #scale, #rbits);
                                for (v, c) in y[j * #g..(j + 1) * #g].iter_mut().zip(codeword) {
                                    *v = r * c;
                                }
                            },
                        )
                    }
                    None => (
                        quote!(),
                        quote!(y[j * #g..(j + 1) * #g].copy_from_slice(codeword);),
                    ),
                };
                quote! {
                    let index: [u32; #groups_n] = #indices;
                    #codes
                    for j in 0..#groups_n {
                        let codeword = &#book[#book_start + index[j] as usize * #g..][..#g];
                        #set
                    }
                }
            }
            FieldLayout::Coeff {
                item_scale,
                offset,
                count,
                bits,
                scale,
                slot,
                table: t,
            } => {
                let n = count as usize;
                let slot = slot as usize;
                let b = lit(bits);
                let codes = array(count, offset, bits);
                let (bind, s) = match scale {
                    CoeffScale::Item => {
                        let read = words.read(
                            item_scale.expect("item scales have a position"),
                            ITEM_SCALE_BITS,
                        );
                        (quote!(let scale = #ops::f16_value(#read);), quote!(scale))
                    }
                    CoeffScale::Page => (quote!(), quote!(scales[#slot])),
                    CoeffScale::PageComponent => (quote!(), quote!(scales[#slot + c])),
                    CoeffScale::Component => {
                        let scales = table(t.expect("component scales have a table"));
                        (quote!(), quote!(#scales[c]))
                    }
                };
                quote! {
                    let code: [u32; #n] = #codes;
                    #bind
                    for c in 0..#n {
                        y[c] = #ops::signed(code[c], #b) * #s;
                    }
                }
            }
            FieldLayout::Bitmap {
                mask_offset,
                groups,
                group_size,
                keep,
                elem,
                item_scale,
                elems_offset,
            } => {
                let (g, groups_n) = (group_size as usize, groups as usize);
                let mask_words = groups.div_ceil(MASK_WORD);
                let masks = (0..mask_words).map(|w| {
                    words.read(
                        mask_offset + w * MASK_WORD,
                        (groups - w * MASK_WORD).min(MASK_WORD),
                    )
                });
                let elem_bits = bitmap_elem_bits(elem);
                let kept_elems = (keep * group_size) as usize;
                let elems = array(keep * group_size, elems_offset, elem_bits);
                let (bind, convert) = match elem {
                    BitmapElem::F16 => (quote!(), quote!(#ops::f16_value(raw))),
                    BitmapElem::Int8 => {
                        let read = words.read(
                            item_scale.expect("int8 elements have an item scale"),
                            ITEM_SCALE_BITS,
                        );
                        (
                            quote!(let scale = #ops::f16_value(#read);),
                            quote!(#ops::signed(raw, 8) * scale),
                        )
                    }
                };
                quote! {
                    let mask = [#(#masks),*];
                    let elems: [u32; #kept_elems] = #elems;
                    #bind
                    let mut slot = 0usize;
                    for j in 0..#groups_n {
                        if (mask[j / 32] >> (j % 32)) & 1 == 1 {
                            for t in 0..#g {
                                let raw = elems[slot * #g + t];
                                y[j * #g + t] = #convert;
                            }
                            slot += 1;
                        }
                    }
                }
            }
            FieldLayout::Dense {
                offset,
                count,
                dtype,
            } => {
                let n = count as usize;
                let raw = array(count, offset, dtype.bits());
                let convert = match dtype {
                    DenseDtype::F16 => quote!(#ops::f16_value(raw)),
                    DenseDtype::Bf16 => quote!(#ops::bf16_value(raw)),
                    DenseDtype::F32 => quote!(f32::from_bits(raw)),
                };
                quote! {
                    let raw: [u32; #n] = #raw;
                    for (v, &raw) in y.iter_mut().zip(&raw) {
                        *v = #convert;
                    }
                }
            }
            FieldLayout::Radius { .. } => unreachable!("body() is never a radius"),
        }
    }

    /// `pub mod key { ... }`: the codec's item layout as constants.
    pub fn constants(&self) -> TokenStream {
        let side = format_ident!("{}", self.side());
        let (dims, bits, bytes) = (self.dims(), self.codec.bits, self.codec.stride as usize);
        let fields = self
            .codec
            .fields
            .iter()
            .map(|f| field_constants(f, self.layout));
        let doc = format!(
            "Layout of a {} item: {bits} bits in {bytes} bytes, {dims} coordinates after the transform.",
            self.side()
        );
        quote! {
            #[doc = #doc]
            pub mod #side {
                /// Coordinates after the transform (the PCA rank, else the head dimension).
                pub const DIMS: usize = #dims;
                /// Payload bits of an item.
                pub const BITS: u32 = #bits;
                /// Bytes of an item in its stream (the bits rounded up to bytes).
                pub const BYTES: usize = #bytes;
                #(#fields)*
            }
        }
    }
}

/// How a codec's items are encoded.
enum Plan {
    /// Each item on its own: transform, compute `item`, pack `elements`.
    OnePass {
        item: TokenStream,
        elements: Vec<Element>,
    },
    /// Page scales first: `measure` every transformed item (after `init`),
    /// `finish` the scales, then compute `item` for item `i` and pack.
    /// `keep_y`: the second pass reads the transformed item again.
    TwoPass {
        init: TokenStream,
        measure: TokenStream,
        finish: TokenStream,
        keep_y: bool,
        item: TokenStream,
        elements: Vec<Element>,
    },
}

fn table(index: usize) -> Ident {
    format_ident!("table_{}", index)
}

/// `pub mod <kind> { ... }`: bit positions and sizes of one field.
fn field_constants(field: &FieldLayout, layout: &TierLayout) -> TokenStream {
    let table_doc = |t: usize| {
        let table = &layout.tables[t];
        format!(
            "Index of the `{}` table ({} values) in the tier's tables.",
            table.name, table.len
        )
    };
    match *field {
        FieldLayout::Radius {
            offset,
            groups,
            group_size,
            bits,
            scale,
            slot,
        } => {
            let slots = match scale {
                RadiusScale::Page => 1,
                RadiusScale::PageGroup => groups as usize,
            };
            let (groups, group_size, slot) = (groups as usize, group_size as usize, slot as usize);
            quote! {
                /// The radius field: `GROUPS` unsigned codes of `BITS` bits.
                pub mod radius {
                    /// Bit offset of the first code in the item.
                    pub const OFFSET: u32 = #offset;
                    /// Bits per code.
                    pub const BITS: u32 = #bits;
                    pub const GROUPS: usize = #groups;
                    pub const GROUP_SIZE: usize = #group_size;
                    /// First page-header scale slot of the field.
                    pub const SLOT: usize = #slot;
                    /// Header scale slots of the field (1, or one per group).
                    pub const SLOTS: usize = #slots;
                }
            }
        }
        FieldLayout::Codebook {
            offset,
            groups,
            group_size,
            bits,
            per_group,
            table,
            ..
        } => {
            let books = if per_group { groups as usize } else { 1 };
            let entries = 1usize << bits;
            let (groups, group_size) = (groups as usize, group_size as usize);
            let doc = table_doc(table);
            quote! {
                /// The codebook field: `GROUPS` indices of `BITS` bits.
                pub mod codebook {
                    /// Bit offset of the first index in the item.
                    pub const OFFSET: u32 = #offset;
                    /// Bits per index.
                    pub const BITS: u32 = #bits;
                    pub const GROUPS: usize = #groups;
                    /// Coordinates per group (codeword length).
                    pub const GROUP_SIZE: usize = #group_size;
                    /// Codewords per codebook.
                    pub const ENTRIES: usize = #entries;
                    /// Codebooks (one per group, or one shared).
                    pub const BOOKS: usize = #books;
                    #[doc = #doc]
                    pub const TABLE: usize = #table;
                }
            }
        }
        FieldLayout::Coeff {
            item_scale,
            offset,
            count,
            bits,
            slot,
            table,
            scale,
        } => {
            let count = count as usize;
            let item_scale = item_scale.map(|at| {
                quote! {
                    /// Bit offset of the item's f16 scale.
                    pub const ITEM_SCALE_OFFSET: u32 = #at;
                }
            });
            let slot = matches!(scale, CoeffScale::Page | CoeffScale::PageComponent).then(|| {
                let slot = slot as usize;
                quote! {
                    /// First page-header scale slot of the field.
                    pub const SLOT: usize = #slot;
                }
            });
            let table = table.map(|t| {
                let doc = table_doc(t);
                quote! {
                    #[doc = #doc]
                    pub const TABLE: usize = #t;
                }
            });
            quote! {
                /// The coeff field: `COUNT` signed codes of `BITS` bits.
                pub mod coeff {
                    /// Bit offset of the first code in the item.
                    pub const OFFSET: u32 = #offset;
                    /// Bits per code.
                    pub const BITS: u32 = #bits;
                    pub const COUNT: usize = #count;
                    #item_scale
                    #slot
                    #table
                }
            }
        }
        FieldLayout::Bitmap {
            mask_offset,
            groups,
            group_size,
            keep,
            elem,
            item_scale,
            elems_offset,
        } => {
            let elem_bits = bitmap_elem_bits(elem);
            let (groups, group_size, keep) = (groups as usize, group_size as usize, keep as usize);
            let item_scale = item_scale.map(|at| {
                quote! {
                    /// Bit offset of the item's f16 scale (int8 elements).
                    pub const ITEM_SCALE_OFFSET: u32 = #at;
                }
            });
            quote! {
                /// The bitmap field: a mask of `GROUPS` bits, then `KEEP` kept groups.
                pub mod bitmap {
                    /// Bit offset of the mask (bit `g` set: group `g` is kept).
                    pub const MASK_OFFSET: u32 = #mask_offset;
                    pub const GROUPS: usize = #groups;
                    /// Elements per group.
                    pub const GROUP_SIZE: usize = #group_size;
                    /// Groups stored per item.
                    pub const KEEP: usize = #keep;
                    #item_scale
                    /// Bit offset of the first kept element.
                    pub const ELEMS_OFFSET: u32 = #elems_offset;
                    /// Bits per element.
                    pub const ELEM_BITS: u32 = #elem_bits;
                }
            }
        }
        FieldLayout::Dense {
            offset,
            count,
            dtype,
        } => {
            let (count, bits) = (count as usize, dtype.bits());
            quote! {
                /// The dense field: `COUNT` values of `BITS` bits.
                pub mod dense {
                    /// Bit offset of the first value in the item.
                    pub const OFFSET: u32 = #offset;
                    /// Bits per value.
                    pub const BITS: u32 = #bits;
                    pub const COUNT: usize = #count;
                }
            }
        }
    }
}
