//! One codec (key or value) of one tier: its layout constants and its
//! specialized item encoder and decoder.
//!
//! The generated code does what the reference encoder
//! (`kvcc_compiler::back::interp::encode`) does for this codec, with every
//! size and bit offset a constant: the numbers come from the same
//! `kvcc_compiler::back::interp::encode::ops` functions (so pages are byte-identical), and the bit positions from the
//! item's schema (`CodecLayout::slots`), walked once here at expansion time
//! and packed a 64-bit word at a time (`pack`).

use kvcc_compiler::ir::encode::{CodecEncode, FieldEncode, Source};
use kvcc_compiler::layout::{
    CodecLayout, DenseScale, FieldLayout, SlotRole, TierLayout, TransformLayout,
};
use kvcc_compiler::lower::encode::lower_codec;
use kvcc_compiler::spec::{CodewordKind, CoeffScale, RadiusScale};
use proc_macro2::{Ident, Literal, TokenStream};
use quote::{format_ident, quote};

use crate::constants::field_constants;
use crate::pack::{pack, Element, Words};

fn lit(v: u32) -> Literal {
    Literal::u32_unsuffixed(v)
}

/// The generated code's array of a slot's elements (a mask's: its words).
fn slot_array(role: SlotRole) -> Ident {
    format_ident!(
        "{}",
        match role {
            SlotRole::RadiusCode => "radius_code",
            SlotRole::CodebookIndex => "index",
            SlotRole::Coefficient => "code",
            SlotRole::ItemScale => "item_scale",
            SlotRole::ItemZero => "item_zero",
            SlotRole::MaskBit => "mask",
            SlotRole::BitmapElement => "elems",
            SlotRole::DenseValue => "dense",
        }
    )
}

pub struct Codec<'a> {
    pub layout: &'a TierLayout,
    pub codec: &'a CodecLayout,
    /// The runtime crate's path in the calling crate (`$crate` of `kv_format!`).
    pub krate: &'a TokenStream,
}

impl Codec<'_> {
    fn side(&self) -> &'static str {
        self.codec.side.name()
    }

    fn ops(&self) -> TokenStream {
        let krate = self.krate;
        quote!(#krate::compiler::back::interp::encode::ops)
    }

    pub fn encoder_name(&self) -> Ident {
        format_ident!("encode_{}", self.side())
    }

    pub fn decoder_name(&self) -> Ident {
        format_ident!("decode_{}", self.side())
    }

    /// Whether the codec stores scales in the page header: encoding then
    /// needs every item before the first can be packed (a pass that measures,
    /// then one that packs), and decoding reads them.
    pub fn uses_header(&self) -> bool {
        match *self.codec.body() {
            FieldLayout::Coeff { scale, .. } => {
                matches!(scale, CoeffScale::Page | CoeffScale::PageComponent)
            }
            FieldLayout::Dense {
                scale: Some(DenseScale::Header(_)),
                ..
            } => true,
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
                table: Some(table),
                zero_table,
                ..
            } => used.extend([Some(table), zero_table].into_iter().flatten()),
            FieldLayout::Dense {
                scale: Some(DenseScale::Table(table)),
                ..
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
        let ops = self.ops();
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
        let ops = self.ops();
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
        let pack = pack(&item, &self.elements(), self.codec.stride);
        let body = match self.plan() {
            Plan::OnePass { item: stmts } => {
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
            } => {
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

    /// How the items are encoded. Each kind binds the arrays its slots take
    /// (named by [`slot_array`]); [`Self::elements`] places them.
    fn plan(&self) -> Plan {
        let ops = self.ops();
        let body = self.codec.body();
        match *body {
            FieldLayout::Codebook {
                groups,
                group_size,
                codewords,
                table: t,
                ..
            } => {
                let (g, book_len, groups_n) = (
                    group_size as usize,
                    body.book_len() as usize,
                    groups as usize,
                );
                let book = table(t);
                let book_start = self.book_start();
                match (codewords, self.codec.radius()) {
                    (
                        CodewordKind::Direction,
                        Some(&FieldLayout::Radius {
                            bits, scale, slot, ..
                        }),
                    ) => {
                        let slot = slot as usize;
                        let finish = match scale {
                            RadiusScale::Page => {
                                quote!(scales[#slot] = #ops::scale_or_one(#ops::max_abs(&group_max));)
                            }
                            RadiusScale::PageGroup => quote! {
                                for j in 0..#groups_n {
                                    scales[#slot + j] = #ops::scale_or_one(group_max[j]);
                                }
                            },
                        };
                        let scale = self.radius_scale();
                        let rbits = lit(bits);
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
                            finish,
                            keep_y: false,
                            item: quote! {
                                let index = &indices[i];
                                let radius_code: [u32; #groups_n] = ::core::array::from_fn(|j| {
                                    #ops::radius_code(radii[i][j], #scale, #rbits)
                                });
                            },
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
                    },
                }
            }
            FieldLayout::Coeff {
                count,
                bits,
                scale,
                zero_point: true,
                group,
                slot,
                zero_slot,
                ..
            } => {
                let (n, b, g) = (count as usize, lit(bits), group as usize);
                let (slot, zero_slot, groups_n) = (slot as usize, zero_slot as usize, n / g);
                let quantize = {
                    let (s, z) = self.coeff_factor();
                    quote! {
                        let code: [u32; #n] = ::core::array::from_fn(|c| #ops::quantize_unsigned(y[c], #s, #z, #b));
                    }
                };
                let infinite = quote!((f32::INFINITY, f32::NEG_INFINITY));
                match scale {
                    CoeffScale::Item | CoeffScale::Group => Plan::OnePass {
                        item: quote! {
                            let params: [(f32, f32); #groups_n] = ::core::array::from_fn(|j| {
                                let (lo, hi) = #ops::min_max(&y[j * #g..(j + 1) * #g]);
                                #ops::half_zero_point_scale(lo, hi, #b)
                            });
                            let item_scale: [u32; #groups_n] = ::core::array::from_fn(|j| #ops::f16_bits(params[j].0));
                            let item_zero: [u32; #groups_n] = ::core::array::from_fn(|j| #ops::f16_bits(params[j].1));
                            #quantize
                        },
                    },
                    CoeffScale::Component => Plan::OnePass { item: quantize },
                    CoeffScale::Page => Plan::TwoPass {
                        init: quote!(let mut range = #infinite;),
                        measure: quote!(range = #ops::widen_range(range, y);),
                        finish: quote! {
                            let (s, z) = #ops::zero_point_scale(range.0, range.1, #b);
                            scales[#slot] = s;
                            scales[#zero_slot] = z;
                        },
                        keep_y: true,
                        item: quantize,
                    },
                    CoeffScale::PageComponent => Plan::TwoPass {
                        init: quote!(let mut range = [#infinite; #n];),
                        measure: quote! {
                            for (r, v) in range.iter_mut().zip(y) {
                                *r = #ops::widen_range(*r, [v]);
                            }
                        },
                        finish: quote! {
                            for (c, r) in range.iter().enumerate() {
                                let (s, z) = #ops::zero_point_scale(r.0, r.1, #b);
                                scales[#slot + c] = s;
                                scales[#zero_slot + c] = z;
                            }
                        },
                        keep_y: true,
                        item: quantize,
                    },
                }
            }
            FieldLayout::Coeff {
                count,
                bits,
                scale,
                group,
                slot,
                ..
            } => {
                let (n, b, slot) = (count as usize, lit(bits), slot as usize);
                let quantize = {
                    let (s, _) = self.coeff_factor();
                    quote! {
                        let code: [u32; #n] = ::core::array::from_fn(|c| #ops::quantize(y[c], #s, #b));
                    }
                };
                let (g, groups_n) = (group as usize, (count / group) as usize);
                match scale {
                    CoeffScale::Item | CoeffScale::Group => Plan::OnePass {
                        item: quote! {
                            let params: [(f32, f32); #groups_n] = ::core::array::from_fn(|j| {
                                (#ops::coeff_item_scale(&y[j * #g..(j + 1) * #g], #b), 0.0)
                            });
                            let item_scale: [u32; #groups_n] = ::core::array::from_fn(|j| #ops::f16_bits(params[j].0));
                            #quantize
                        },
                    },
                    CoeffScale::Component => Plan::OnePass { item: quantize },
                    CoeffScale::Page => Plan::TwoPass {
                        init: quote!(let mut max = 0.0f32;),
                        measure: quote!(max = max.max(#ops::max_abs(y));),
                        finish: quote!(scales[#slot] = #ops::coeff_scale(max, #b);),
                        keep_y: true,
                        item: quantize,
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
                        item: quantize,
                    },
                }
            }
            FieldLayout::Bitmap {
                groups,
                group_size,
                elem,
                ..
            } => {
                let (g, groups_n) = (group_size as usize, groups as usize);
                let [mask_n, elems_n] =
                    [SlotRole::MaskBit, SlotRole::BitmapElement].map(|r| self.count(r));
                let elem_ty = self.spec_enum("BitmapElem", elem);
                let encode = quote!(#ops::bitmap_encode(y, #g, #elem_ty, (&mut energy, &mut order), &mut mask, &mut elems));
                let encode = match elem.scaled() {
                    true => quote! {
                        let item_scale = [#ops::f16_bits(#encode.expect("scaled bitmaps have a scale"))];
                    },
                    false => quote!(#encode;),
                };
                Plan::OnePass {
                    item: quote! {
                        let mut energy = [0.0f32; #groups_n];
                        let mut order = [0usize; #groups_n];
                        let mut mask = [0u32; #mask_n];
                        let mut elems = [0u32; #elems_n];
                        #encode
                    },
                }
            }
            FieldLayout::Dense {
                count,
                dtype,
                scale,
                ..
            } => {
                let n = count as usize;
                let format = dtype.fp8().map(|f| (self.spec_enum("Fp8", f), f.max()));
                let dtype = self.spec_enum("DenseDtype", dtype);
                let encode = |s: TokenStream| {
                    quote! {
                        let dense: [u32; #n] = ::core::array::from_fn(|c| #ops::dense_bits(#dtype, y[c] / #s));
                    }
                };
                let dense = match self.dense_divisor().0 {
                    Some(s) => encode(s),
                    None => quote! {
                        let dense: [u32; #n] = ::core::array::from_fn(|c| #ops::dense_bits(#dtype, y[c]));
                    },
                };
                match (scale, format) {
                    (Some(DenseScale::Item(_)), Some((_, max))) => Plan::OnePass {
                        item: quote! {
                            let scale = #ops::half_scale(#ops::max_abs(y), #max);
                            let item_scale = [#ops::f16_bits(scale)];
                            let params = [(scale, 0.0f32)];
                            #dense
                        },
                    },
                    (Some(DenseScale::Header(slot)), Some((format, _))) => {
                        let slot = slot as usize;
                        Plan::TwoPass {
                            init: quote!(let mut max = 0.0f32;),
                            measure: quote!(max = max.max(#ops::max_abs(y));),
                            finish: quote!(scales[#slot] = #ops::fp8_scale(max, #format);),
                            keep_y: true,
                            item: dense,
                        }
                    }
                    _ => Plan::OnePass { item: dense },
                }
            }
            FieldLayout::Radius { .. } => unreachable!("body() is never a radius"),
        }
    }

    /// Every element of the item's schema, each naming its slot's array.
    fn elements(&self) -> Vec<Element> {
        self.codec
            .slots
            .iter()
            .flat_map(|slot| {
                let array = slot_array(slot.role);
                slot.elements()
                    .enumerate()
                    .map(move |(k, (offset, width))| Element {
                        value: quote!(#array[#k]),
                        offset,
                        width,
                    })
            })
            .collect()
    }

    /// Elements of the slot with `role` (mask words for a mask).
    fn count(&self, role: SlotRole) -> usize {
        let slot = self.codec.slots.iter().find(|s| s.role == role);
        slot.expect("the codec has this slot").element_count() as usize
    }

    /// `<krate>::compiler::spec::<ty>::<variant>`.
    fn spec_enum(&self, ty: &str, variant: impl std::fmt::Debug) -> TokenStream {
        let krate = self.krate;
        let (ty, variant) = (
            format_ident!("{}", ty),
            format_ident!("{}", format!("{variant:?}")),
        );
        quote!(#krate::compiler::spec::#ty::#variant)
    }

    /// The codec's encode description.
    fn encode(&self) -> CodecEncode {
        lower_codec(self.codec)
    }

    /// The scale (or, `zero`, the zero point) `source` gives element `i`:
    /// `scales[..]` of the header, a trained table, or the item's `params`
    /// (bound by the caller, one (scale, zero) per group).
    fn source(&self, source: Source, i: TokenStream, zero: bool) -> TokenStream {
        match source {
            Source::Header { slot, each } => {
                let slot = slot as usize;
                match each {
                    true => quote!(scales[#slot + #i]),
                    false => quote!(scales[#slot]),
                }
            }
            Source::Table { table: t, each } => {
                let t = table(t);
                match each {
                    true => quote!(#t[#i]),
                    false => quote!(#t[0]),
                }
            }
            Source::Item { group } => {
                let g = group as usize;
                match zero {
                    true => quote!(params[#i / #g].1),
                    false => quote!(params[#i / #g].0),
                }
            }
        }
    }

    /// The scale and zero point (0 for symmetric codes) of coefficient `c`.
    fn coeff_factor(&self) -> (TokenStream, TokenStream) {
        let FieldEncode::Coeff { scale, zero, .. } = *self.encode().body() else {
            unreachable!("coeff_factor of a coeff codec")
        };
        let s = self.source(scale, quote!(c), false);
        let z = zero.map_or(quote!(0.0f32), |z| self.source(z, quote!(c), true));
        (s, z)
    }

    /// The scale of a radius field's group `j`.
    fn radius_scale(&self) -> TokenStream {
        let (_, scale) = self.encode().radius().expect("a radius field");
        self.source(scale, quote!(j), false)
    }

    /// A dense field's divisor (`None`: unscaled), one per field (an item
    /// scale is the item's one), and whether it reads the item's `params`.
    fn dense_divisor(&self) -> (Option<TokenStream>, bool) {
        let FieldEncode::Dense {
            divide_by,
            item_scale,
            ..
        } = *self.encode().body()
        else {
            unreachable!("dense_divisor of a dense codec")
        };
        let divisor = divide_by.map(|by| self.source(by, quote!(0usize), false));
        (divisor, item_scale.is_some())
    }

    /// The first value of group `j`'s book in the codebook table.
    fn book_start(&self) -> TokenStream {
        match *self.codec.body() {
            FieldLayout::Codebook {
                per_group: true, ..
            } => {
                let book_len = self.codec.body().book_len() as usize;
                quote!(j * #book_len)
            }
            _ => quote!(0),
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

    /// Statements filling `y` from the item's words: every slot of the schema
    /// read into its array, then the body's kind turns them into coordinates.
    fn decode_body(&self, words: &Words) -> TokenStream {
        let ops = self.ops();
        let loads = self.codec.slots.iter().map(|slot| {
            let array = slot_array(slot.role);
            let n = slot.element_count() as usize;
            let reads = slot.elements().map(|(at, width)| words.read(at, width));
            quote!(let #array: [u32; #n] = [#(#reads),*];)
        });
        let item_scale = quote!(#ops::f16_value(item_scale[0]));
        let body = match *self.codec.body() {
            FieldLayout::Codebook {
                groups,
                group_size,
                table: t,
                ..
            } => {
                let (g, groups_n) = (group_size as usize, groups as usize);
                let book = table(t);
                let book_start = self.book_start();
                let set = match self.codec.radius() {
                    Some(&FieldLayout::Radius { bits, .. }) => {
                        let scale = self.radius_scale();
                        let rbits = lit(bits);
                        quote! {
                            let r = #ops::radius_value(radius_code[j], #scale, #rbits);
                            for (v, c) in y[j * #g..(j + 1) * #g].iter_mut().zip(codeword) {
                                *v = r * c;
                            }
                        }
                    }
                    _ => quote!(y[j * #g..(j + 1) * #g].copy_from_slice(codeword);),
                };
                quote! {
                    for j in 0..#groups_n {
                        let codeword = &#book[#book_start + index[j] as usize * #g..][..#g];
                        #set
                    }
                }
            }
            FieldLayout::Coeff {
                count,
                bits,
                scale,
                zero_point,
                group,
                ..
            } => {
                let (n, b, (s, z)) = (count as usize, lit(bits), self.coeff_factor());
                let groups_n = (count / group) as usize;
                let zero = match zero_point {
                    true => quote!(#ops::f16_value(item_zero[j])),
                    false => quote!(0.0f32),
                };
                let bind = scale.in_item().then(|| {
                    quote! {
                        let params: [(f32, f32); #groups_n] = ::core::array::from_fn(|j| {
                            (#ops::f16_value(item_scale[j]), #zero)
                        });
                    }
                });
                let value = match zero_point {
                    true => quote!(#ops::unsigned_value(code[c], #s, #z)),
                    false => quote!(#ops::signed(code[c], #b) * #s),
                };
                quote! {
                    #bind
                    for c in 0..#n {
                        y[c] = #value;
                    }
                }
            }
            FieldLayout::Bitmap {
                group_size, elem, ..
            } => {
                let g = group_size as usize;
                let scale = match elem.scaled() {
                    true => item_scale,
                    false => quote!(1.0),
                };
                let elem = self.spec_enum("BitmapElem", elem);
                quote!(#ops::bitmap_decode(&mask, &elems, #g, #elem, #scale, &mut y);)
            }
            FieldLayout::Dense { dtype, .. } => {
                let dtype = self.spec_enum("DenseDtype", dtype);
                let (divisor, item) = self.dense_divisor();
                let bind = item.then(|| quote!(let params = [(#item_scale, 0.0f32)];));
                let scaled = divisor.map(|s| quote!(* #s));
                quote! {
                    #bind
                    for (v, &raw) in y.iter_mut().zip(&dense) {
                        *v = #ops::dense_value(#dtype, raw) #scaled;
                    }
                }
            }
            FieldLayout::Radius { .. } => unreachable!("body() is never a radius"),
        };
        quote!(#(#loads)* #body)
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
    /// Each item on its own: transform, compute `item`, pack the slots.
    OnePass { item: TokenStream },
    /// Page scales first: `measure` every transformed item (after `init`),
    /// `finish` the scales, then compute `item` for item `i` and pack the slots.
    /// `keep_y`: the second pass reads the transformed item again.
    TwoPass {
        init: TokenStream,
        measure: TokenStream,
        finish: TokenStream,
        keep_y: bool,
        item: TokenStream,
    },
}

fn table(index: usize) -> Ident {
    format_ident!("table_{}", index)
}
