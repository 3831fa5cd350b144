//! A codec's layout becomes its encode description ([`CodecEncode`]): each
//! field's page scales with their statistic and rule, and the source of
//! every scale and zero point its elements are coded under.

use crate::ir::encode::{
    CodecEncode, FieldEncode, ItemScales, Measured, PageScale, ScaleRule, Source,
};
use crate::layout::{coeff_max, CodecLayout, DenseScale, FieldLayout};
use crate::spec::{CoeffScale, RadiusScale};

/// The encoder of `codec`.
pub fn lower_codec(codec: &CodecLayout) -> CodecEncode {
    let dims = codec.dims;
    let mut page_scales = Vec::new();
    let fields = codec
        .fields
        .iter()
        .map(|field| match *field {
            FieldLayout::Radius {
                groups,
                bits,
                scale,
                slot,
                ..
            } => {
                let each = scale == RadiusScale::PageGroup;
                page_scales.push(PageScale {
                    of: Measured::Radii { groups },
                    each,
                    rule: ScaleRule::Magnitude { q: 1.0 },
                    slot,
                });
                FieldEncode::Radius {
                    groups,
                    bits,
                    scale: Source::Header { slot, each },
                }
            }
            FieldLayout::Codebook {
                groups,
                group_size,
                codewords,
                ..
            } => FieldEncode::Codebook {
                groups,
                group_size,
                codewords,
            },
            FieldLayout::Coeff {
                count,
                bits,
                scale,
                zero_point,
                group,
                slot,
                zero_slot,
                table,
                zero_table,
                ..
            } => {
                let each = scale == CoeffScale::PageComponent;
                let (scale_source, zero_source) = match scale {
                    CoeffScale::Page | CoeffScale::PageComponent => {
                        page_scales.push(PageScale {
                            of: Measured::Coordinates { dims },
                            each,
                            rule: match zero_point {
                                true => ScaleRule::Range { bits, zero_slot },
                                false => ScaleRule::Magnitude {
                                    q: coeff_max(bits) as f32,
                                },
                            },
                            slot,
                        });
                        let header = |slot| Source::Header { slot, each };
                        (header(slot), zero_point.then(|| header(zero_slot)))
                    }
                    CoeffScale::Item | CoeffScale::Group => {
                        let item = Source::Item { group };
                        (item, zero_point.then_some(item))
                    }
                    CoeffScale::Component => {
                        let trained = |table: Option<usize>| Source::Table {
                            table: table.expect("the layout gives component scales tables"),
                            each: true,
                        };
                        (trained(table), zero_point.then(|| trained(zero_table)))
                    }
                };
                FieldEncode::Coeff {
                    count,
                    bits,
                    item: scale.in_item().then_some(ItemScales { group, zero_point }),
                    scale: scale_source,
                    zero: zero_source,
                }
            }
            FieldLayout::Bitmap {
                groups,
                group_size,
                keep,
                elem,
                ..
            } => FieldEncode::Bitmap {
                groups,
                group_size,
                keep,
                elem,
            },
            FieldLayout::Dense {
                count,
                dtype,
                scale,
                ..
            } => {
                let fp8 = dtype.fp8();
                let divide_by = match scale {
                    None => None,
                    Some(DenseScale::Table(table)) => Some(Source::Table { table, each: false }),
                    Some(DenseScale::Header(slot)) => {
                        let format = fp8.expect("checked: only fp8 fields have scales");
                        page_scales.push(PageScale {
                            of: Measured::Coordinates { dims },
                            each: false,
                            rule: ScaleRule::Magnitude { q: format.max() },
                            slot,
                        });
                        Some(Source::Header { slot, each: false })
                    }
                    Some(DenseScale::Item(_)) => fp8.map(|_| Source::Item { group: count }),
                };
                FieldEncode::Dense {
                    count,
                    dtype,
                    item_scale: match scale {
                        Some(DenseScale::Item(_)) => fp8,
                        _ => None,
                    },
                    divide_by,
                }
            }
        })
        .collect();
    CodecEncode {
        page_scales,
        fields,
    }
}
