//! Where every bit lives: item streams, page headers and per-head tables.
//!
//! Each codec's item is computed once, as the ordered slots of [`schema`];
//! lowering, the encoders, the macro and the reports all walk those slots and
//! read bits through [`bits`], so the kernels and the pages cannot disagree.

pub mod bits;
pub mod schema;
pub mod summary;

use crate::spec::{
    BasisDtype, BitmapElem, CodecSpec, CodewordKind, CoeffScale, DenseDtype, FieldSpec, FormatSpec,
    Fp8Scale, RadiusScale, TableDtype, TransformSpec,
};
pub use schema::{bitmap_elem_bits, BitRange, HeaderScales, ItemSlot, SlotRole, ITEM_SCALE_BITS};

/// Fixed page-header words: tier index, item count, flags, reserved.
pub const HEADER_FIXED_BYTES: u32 = 16;
/// Every page, and every stream inside it, starts on this boundary.
pub const STREAM_ALIGN: u32 = 16;
pub const PAGE_ALIGN: u32 = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Key,
    Value,
}

impl Side {
    pub fn name(self) -> &'static str {
        self.pick("key", "value")
    }

    /// Of a pair held per side (codecs, streams, offsets), this side's one.
    pub fn pick<T>(self, key: T, value: T) -> T {
        match self {
            Side::Key => key,
            Side::Value => value,
        }
    }
}

/// Where a table's contents come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableSource {
    /// Fitted to data by a trainer (codebooks, PCA bases, scales).
    Trained,
    /// A pure function of the spec (SRHT signs); costs no stored bytes.
    Derived,
}

/// A per-(layer, kv head) table a codec needs. Kernels see f32 values; `stored_bytes`
/// counts the storage dtype for the byte budget.
#[derive(Debug, Clone, PartialEq)]
pub struct TableLayout {
    pub name: String,
    pub side: Side,
    pub role: TableRole,
    pub len: u32,
    pub storage: TableStorage,
    pub stored_bytes: u32,
    pub source: TableSource,
}

/// How a table is stored; trainers round values to it so every consumer of the
/// f32 view sees exactly the stored numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableStorage {
    F32,
    F16,
    /// int8 with one f32 scale per column of a row-major matrix of `columns`.
    I8Columns {
        columns: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableRole {
    /// `entries * group_size` values per codebook, `books` codebooks (1 or one per group).
    Codebook { books: u32, entries: u32 },
    /// Row-major `head_dim x rank` basis.
    PcaBasis,
    /// `head_dim` mean vector.
    PcaMean,
    /// `n` trained per-component coefficient scales.
    ComponentScale,
    /// `n` trained per-component zero points of asymmetric coefficients.
    ComponentZero,
    /// One trained scale of fp8 elements: per (layer, kv head), or
    /// (`shared`) one value every kv head of a layer holds.
    Fp8Scale { shared: bool },
    /// `head_dim` signs (+1/-1) of an SRHT.
    SrhtSigns,
}

/// A field's geometry, with the bit positions of its slots (the codec's
/// `slots` are the source of those positions).
#[derive(Debug, Clone, PartialEq)]
pub enum FieldLayout {
    Radius {
        offset: u32,
        groups: u32,
        group_size: u32,
        bits: u32,
        scale: RadiusScale,
        /// First page-header scale slot (1 slot, or one per group).
        slot: u32,
    },
    Codebook {
        offset: u32,
        groups: u32,
        group_size: u32,
        bits: u32,
        codewords: CodewordKind,
        per_group: bool,
        table: usize,
    },
    Coeff {
        /// Bit offset of the first f16 item scale (scale = item or group).
        item_scale: Option<u32>,
        /// Bit offset of the first f16 item zero point (item or group, zero_point).
        item_zero: Option<u32>,
        offset: u32,
        count: u32,
        bits: u32,
        scale: CoeffScale,
        /// Unsigned codes with a zero point per scale (`x = code · s + z`).
        zero_point: bool,
        /// Channels per item scale: `group`, or `count` for scale = item.
        group: u32,
        /// First header slot (page: 1, page_component: `count`).
        slot: u32,
        /// First header zero-point slot (page or page_component, zero_point).
        zero_slot: u32,
        /// Trained scale table (scale = component).
        table: Option<usize>,
        /// Trained zero-point table (scale = component, zero_point).
        zero_table: Option<usize>,
    },
    Bitmap {
        mask_offset: u32,
        groups: u32,
        group_size: u32,
        keep: u32,
        elem: BitmapElem,
        /// Bit offset of the f16 item scale (int8 elements).
        item_scale: Option<u32>,
        elems_offset: u32,
    },
    Dense {
        offset: u32,
        count: u32,
        dtype: DenseDtype,
        scale: Option<DenseScale>,
    },
}

/// Where an fp8 dense field's scale lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenseScale {
    /// Element 0 of a trained table (`tensor` or `head`).
    Table(usize),
    /// A page-header slot.
    Header(u32),
    /// The f16 item scale at this bit offset.
    Item(u32),
}

impl FieldLayout {
    /// Values of one book of a codebook field: `2^bits` codewords of `group_size`.
    pub fn book_len(&self) -> u32 {
        match *self {
            FieldLayout::Codebook {
                group_size, bits, ..
            } => (1u32 << bits) * group_size,
            _ => unreachable!("book_len of a {self:?}"),
        }
    }

    /// Index in a codebook field's table of the first value of codeword
    /// `index` of group `group` (one book per group, or one shared book).
    pub fn codeword_at(&self, group: u32, index: u32) -> u32 {
        match *self {
            FieldLayout::Codebook {
                group_size,
                per_group,
                ..
            } => {
                let book = if per_group {
                    group * self.book_len()
                } else {
                    0
                };
                book + index * group_size
            }
            _ => unreachable!("codeword_at of a {self:?}"),
        }
    }
}

/// The transform with its tables resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TransformLayout {
    Identity,
    Hadamard,
    Srht {
        seed: u64,
        signs: usize,
    },
    Pca {
        rank: u32,
        basis: usize,
        mean: usize,
    },
}

/// One codec (key or value) of one tier.
#[derive(Debug, Clone, PartialEq)]
pub struct CodecLayout {
    pub side: Side,
    /// Coordinates after the transform (rank for PCA, else head_dim).
    pub dims: u32,
    pub transform: TransformLayout,
    pub fields: Vec<FieldLayout>,
    /// The item's slots in bit order: the schema every item reader and writer walks.
    pub slots: Vec<ItemSlot>,
    /// Payload bits per item, before rounding to bytes.
    pub bits: u32,
    /// Bytes per item in the stream.
    pub stride: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TierLayout {
    pub index: u32,
    pub name: String,
    pub head_dim: u32,
    pub items_per_page: u32,
    pub key: CodecLayout,
    pub value: CodecLayout,
    /// f32 scale slots in the page header (key codec's first).
    pub header_slots: u32,
    /// What each run of header scale slots scales, in slot order.
    pub header_scales: Vec<HeaderScales>,
    pub header_bytes: u32,
    pub key_stream_offset: u32,
    pub value_stream_offset: u32,
    pub page_bytes: u32,
    /// Tables of both codecs; `FieldLayout`/`TransformLayout` index into this.
    pub tables: Vec<TableLayout>,
}

pub fn round_up(value: u32, to: u32) -> u32 {
    value.div_ceil(to) * to
}

impl TierLayout {
    /// Lays out tier `index` of a spec that passed `front::check`.
    pub fn new(spec: &FormatSpec, index: usize) -> TierLayout {
        let tier = &spec.tiers[index];
        let mut tables = Vec::new();
        let mut scales = Vec::new();
        let key = CodecLayout::new(
            Side::Key,
            &tier.key,
            spec.head_dim,
            &mut tables,
            &mut scales,
        );
        let value = CodecLayout::new(
            Side::Value,
            &tier.value,
            spec.head_dim,
            &mut tables,
            &mut scales,
        );
        let slots = scales.iter().map(|s| s.count).sum::<u32>();
        let header_bytes = round_up(HEADER_FIXED_BYTES + 4 * slots, STREAM_ALIGN);
        let mut layout = TierLayout {
            index: index as u32,
            name: tier.name.clone(),
            head_dim: spec.head_dim,
            items_per_page: 0,
            key,
            value,
            header_slots: slots,
            header_scales: scales,
            header_bytes,
            key_stream_offset: header_bytes,
            value_stream_offset: 0,
            page_bytes: 0,
            tables,
        };
        layout.set_page_items(spec.page.items);
        layout
    }

    /// Places the value stream and sizes the page for `items` items per page:
    /// the only positions that depend on the page size.
    pub(crate) fn set_page_items(&mut self, items: u32) {
        self.items_per_page = items;
        self.value_stream_offset =
            self.key_stream_offset + round_up(items * self.key.stride, STREAM_ALIGN);
        self.page_bytes = round_up(
            self.value_stream_offset + items * self.value.stride,
            PAGE_ALIGN,
        );
    }

    pub fn codec(&self, side: Side) -> &CodecLayout {
        side.pick(&self.key, &self.value)
    }

    pub fn stream_offset(&self, side: Side) -> u32 {
        side.pick(self.key_stream_offset, self.value_stream_offset)
    }

    /// Stored table bytes per (layer, kv head).
    pub fn table_bytes(&self) -> u32 {
        self.tables.iter().map(|t| t.stored_bytes).sum()
    }

    /// Bytes per token per kv head with the page header and the tables amortized
    /// over `context` tokens (full pages; the last one counted whole).
    pub fn effective_bytes_per_token(&self, context: u32) -> f64 {
        let pages = context.div_ceil(self.items_per_page).max(1) as f64;
        (pages * self.page_bytes as f64 + self.table_bytes() as f64) / context.max(1) as f64
    }
}

impl CodecLayout {
    fn new(
        side: Side,
        codec: &CodecSpec,
        head_dim: u32,
        tables: &mut Vec<TableLayout>,
        scales: &mut Vec<HeaderScales>,
    ) -> CodecLayout {
        let dims = codec.transform.dims(head_dim);
        let mut add_table = |name: &str, role, len: u32, storage, source| {
            let stored_bytes = match (source, storage) {
                (TableSource::Derived, _) => 0,
                (_, TableStorage::F32) => 4 * len,
                (_, TableStorage::F16) => 2 * len,
                (_, TableStorage::I8Columns { columns }) => len + 4 * columns,
            };
            tables.push(TableLayout {
                name: format!("{}.{}", side.name(), name),
                side,
                role,
                len,
                storage,
                stored_bytes,
                source,
            });
            tables.len() - 1
        };
        let transform = match codec.transform {
            TransformSpec::Identity => TransformLayout::Identity,
            TransformSpec::Hadamard => TransformLayout::Hadamard,
            TransformSpec::Srht { seed } => TransformLayout::Srht {
                seed,
                signs: add_table(
                    "srht_signs",
                    TableRole::SrhtSigns,
                    head_dim,
                    TableStorage::F32,
                    TableSource::Derived,
                ),
            },
            TransformSpec::Pca { rank, basis } => {
                let entries = head_dim * rank;
                let basis_storage = match basis {
                    BasisDtype::F16 => TableStorage::F16,
                    BasisDtype::I8 => TableStorage::I8Columns { columns: rank },
                };
                TransformLayout::Pca {
                    rank,
                    basis: add_table(
                        "pca_basis",
                        TableRole::PcaBasis,
                        entries,
                        basis_storage,
                        TableSource::Trained,
                    ),
                    mean: add_table(
                        "pca_mean",
                        TableRole::PcaMean,
                        head_dim,
                        TableStorage::F32,
                        TableSource::Trained,
                    ),
                }
            }
        };
        let mut slots: Vec<ItemSlot> = Vec::new();
        let mut fields = Vec::new();
        for (index, field) in codec.fields.iter().enumerate() {
            let mut offset = slots.last().map_or(0, |s| s.bits.end());
            for (role, width, count) in
                schema::field_slots(field, dims.into()).expect("checked group sizes divide dims")
            {
                let bits = BitRange {
                    offset,
                    width,
                    count: count as u32,
                };
                offset = bits.end();
                slots.push(ItemSlot {
                    field: index,
                    role,
                    bits,
                });
            }
            let scale_count = schema::header_scale_count(field, dims);
            let first = scales
                .last()
                .map_or(0, |s: &HeaderScales| s.first + s.count);
            if scale_count > 0 {
                scales.push(HeaderScales {
                    side,
                    field: index,
                    scales: match field {
                        FieldSpec::Radius { .. } => SlotRole::RadiusCode,
                        FieldSpec::Dense { .. } => SlotRole::DenseValue,
                        _ => SlotRole::Coefficient,
                    },
                    first,
                    count: scale_count,
                    zero_points: matches!(
                        field,
                        FieldSpec::Coeff {
                            zero_point: true,
                            ..
                        }
                    ),
                });
            }
            let at = |role| {
                slots
                    .iter()
                    .find(|s| s.field == index && s.role == role)
                    .map(|s| s.bits.offset)
            };
            let offset = |role| at(role).expect("the field has this slot");
            let layout = match *field {
                FieldSpec::Radius {
                    group_size,
                    bits,
                    scale,
                } => FieldLayout::Radius {
                    offset: offset(SlotRole::RadiusCode),
                    groups: dims / group_size,
                    group_size,
                    bits,
                    scale,
                    slot: first,
                },
                FieldSpec::Codebook {
                    group_size,
                    bits,
                    codewords,
                    per_group,
                    dtype,
                } => {
                    let groups = dims / group_size;
                    let books = if per_group { groups } else { 1 };
                    let entries = 1u32 << bits;
                    let storage = match dtype {
                        TableDtype::F16 => TableStorage::F16,
                        TableDtype::F32 => TableStorage::F32,
                    };
                    FieldLayout::Codebook {
                        offset: offset(SlotRole::CodebookIndex),
                        groups,
                        group_size,
                        bits,
                        codewords,
                        per_group,
                        table: add_table(
                            "codebook",
                            TableRole::Codebook { books, entries },
                            books * entries * group_size,
                            storage,
                            TableSource::Trained,
                        ),
                    }
                }
                FieldSpec::Coeff {
                    bits,
                    scale,
                    zero_point,
                    group,
                } => {
                    let component = scale == CoeffScale::Component;
                    let table = component.then(|| {
                        add_table(
                            "component_scale",
                            TableRole::ComponentScale,
                            dims,
                            TableStorage::F32,
                            TableSource::Trained,
                        )
                    });
                    let zero_table = (component && zero_point).then(|| {
                        add_table(
                            "component_zero",
                            TableRole::ComponentZero,
                            dims,
                            TableStorage::F32,
                            TableSource::Trained,
                        )
                    });
                    FieldLayout::Coeff {
                        item_scale: at(SlotRole::ItemScale),
                        item_zero: at(SlotRole::ItemZero),
                        offset: offset(SlotRole::Coefficient),
                        count: dims,
                        bits,
                        scale,
                        zero_point,
                        group: match scale {
                            CoeffScale::Group => group.expect("checked: group scales have a group"),
                            _ => dims,
                        },
                        slot: first,
                        zero_slot: first + scale_count / 2,
                        table,
                        zero_table,
                    }
                }
                FieldSpec::Bitmap {
                    group_size,
                    keep,
                    elem,
                } => FieldLayout::Bitmap {
                    mask_offset: offset(SlotRole::MaskBit),
                    groups: dims / group_size,
                    group_size,
                    keep,
                    elem,
                    item_scale: at(SlotRole::ItemScale),
                    elems_offset: offset(SlotRole::BitmapElement),
                },
                FieldSpec::Dense { dtype, scale } => FieldLayout::Dense {
                    offset: offset(SlotRole::DenseValue),
                    count: dims,
                    dtype,
                    scale: scale.map(|scale| match scale {
                        Fp8Scale::Tensor | Fp8Scale::Head => DenseScale::Table(add_table(
                            "fp8_scale",
                            TableRole::Fp8Scale {
                                shared: scale == Fp8Scale::Tensor,
                            },
                            1,
                            TableStorage::F32,
                            TableSource::Trained,
                        )),
                        Fp8Scale::Page => DenseScale::Header(first),
                        Fp8Scale::Item => DenseScale::Item(offset(SlotRole::ItemScale)),
                    }),
                },
            };
            fields.push(layout);
        }
        let bits = slots.last().map_or(0, |s| s.bits.end());
        CodecLayout {
            side,
            dims,
            transform,
            fields,
            slots,
            bits,
            stride: bits.div_ceil(8),
        }
    }

    /// The bit range of the slot holding `role` (a codec has at most one of each).
    pub fn find_slot(&self, role: SlotRole) -> Option<BitRange> {
        self.slots.iter().find(|s| s.role == role).map(|s| s.bits)
    }

    /// [`find_slot`](Self::find_slot) of a slot the codec's fields imply.
    pub fn slot(&self, role: SlotRole) -> BitRange {
        self.find_slot(role)
            .unwrap_or_else(|| panic!("the {} codec has no {} slot", self.side.name(), role.name()))
    }

    /// The field that stores the coordinates (every checked codec has exactly one).
    pub fn body(&self) -> &FieldLayout {
        self.fields
            .iter()
            .find(|f| !matches!(f, FieldLayout::Radius { .. }))
            .expect("checked codecs have a body field")
    }

    /// The radius field, if any (checked specs pair it with a direction codebook).
    pub fn radius(&self) -> Option<&FieldLayout> {
        self.fields
            .iter()
            .find(|f| matches!(f, FieldLayout::Radius { .. }))
    }
}

/// Largest magnitude of a symmetric signed code of `bits` bits (7 for int4).
pub fn coeff_max(bits: u32) -> i32 {
    (1 << (bits - 1)) - 1
}

/// Largest unsigned (zero-point) code of `bits` bits: `2^bits - 1`.
pub fn coeff_levels(bits: u32) -> u32 {
    (1 << bits) - 1
}

/// The SRHT sign vector of a seed: a fixed function so that encoder and kernels agree
/// without storing it (splitmix64 stream, one bit per sign).
pub fn srht_signs(seed: u64, n: u32) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            if z & 1 == 0 {
                1.0
            } else {
                -1.0
            }
        })
        .collect()
}
