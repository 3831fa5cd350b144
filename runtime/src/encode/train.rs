//! Fitting a tier's tables (codebooks, PCA bases, scales) to one kv head's data.

use half::f16;
use kvcc_compiler::layout::{
    srht_signs, CodecLayout, DenseScale, FieldLayout, TableRole, TableStorage, TierLayout,
    TransformLayout,
};
use kvcc_compiler::spec::{CodewordKind, CoeffScale};

use crate::math::kmeans::{kmeans, spherical_kmeans, KMeansOptions};
use crate::math::pca::fit_pca;
use kvcc_compiler::back::interp::encode::ops::{
    coeff_scale, fp8_scale, max_abs, min_max, zero_point_scale,
};
use kvcc_compiler::back::interp::encode::transform;

/// Training effort: samples and Lloyd iterations per codebook.
#[derive(Debug, Clone, Copy)]
pub struct TrainOptions {
    pub seed: u64,
    pub max_samples: usize,
    pub iterations: usize,
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            seed: 0x6b76_6363,
            max_samples: 16_384,
            iterations: 12,
        }
    }
}

/// Tables of one tier for one kv head, from its keys and values (`[token][head_dim]`).
pub fn train_tables(
    layout: &TierLayout,
    keys: &[f32],
    values: &[f32],
    options: &TrainOptions,
) -> Vec<Vec<f32>> {
    let mut tables: Vec<Vec<f32>> = layout
        .tables
        .iter()
        .map(|t| vec![0.0; t.len as usize])
        .collect();
    let head_dim = layout.head_dim as usize;
    for (codec, data) in [(&layout.key, keys), (&layout.value, values)] {
        fit_transform(codec, layout, data, head_dim, &mut tables);
        let transformed: Vec<Vec<f32>> = data
            .chunks(head_dim)
            .map(|x| transform::forward(codec.transform, &tables, x))
            .collect();
        fit_fields(codec, layout, &transformed, options, &mut tables);
    }
    tables
}

fn fit_transform(
    codec: &CodecLayout,
    layout: &TierLayout,
    data: &[f32],
    head_dim: usize,
    tables: &mut [Vec<f32>],
) {
    match codec.transform {
        TransformLayout::Identity | TransformLayout::Hadamard => {}
        TransformLayout::Srht { seed, signs } => tables[signs] = srht_signs(seed, layout.head_dim),
        TransformLayout::Pca { rank, basis, mean } => {
            let pca = fit_pca(data, head_dim, rank as usize);
            tables[basis] = stored(layout.tables[basis].storage, pca.basis);
            tables[mean] = pca.mean;
        }
    }
}

fn fit_fields(
    codec: &CodecLayout,
    layout: &TierLayout,
    items: &[Vec<f32>],
    options: &TrainOptions,
    tables: &mut [Vec<f32>],
) {
    for field in &codec.fields {
        match *field {
            FieldLayout::Codebook {
                groups,
                group_size,
                codewords,
                per_group,
                table,
                ..
            } => {
                let g = group_size as usize;
                let TableRole::Codebook { books, entries } = layout.tables[table].role else {
                    unreachable!("codebook fields own codebook tables")
                };
                let mut book = Vec::with_capacity(layout.tables[table].len as usize);
                for b in 0..books as usize {
                    // One codebook per group, or one shared by every group.
                    let sample_groups: Vec<usize> = if per_group {
                        vec![b]
                    } else {
                        (0..groups as usize).collect()
                    };
                    let data: Vec<f32> = items
                        .iter()
                        .flat_map(|x| {
                            sample_groups
                                .iter()
                                .flat_map(move |&j| x[j * g..(j + 1) * g].iter().copied())
                        })
                        .collect();
                    let opts = KMeansOptions {
                        clusters: entries as usize,
                        iterations: options.iterations,
                        max_samples: options.max_samples,
                        seed: options.seed ^ ((table as u64) << 32) ^ b as u64,
                    };
                    book.extend(match codewords {
                        CodewordKind::Direction => spherical_kmeans(&data, g, &opts),
                        CodewordKind::Vector => kmeans(&data, g, &opts),
                    });
                }
                tables[table] = stored(layout.tables[table].storage, book);
            }
            FieldLayout::Coeff {
                count,
                bits,
                scale: CoeffScale::Component,
                table: Some(table),
                zero_table,
                ..
            } => {
                let component = |c: usize| items.iter().map(move |x| &x[c]);
                match zero_table {
                    None => {
                        tables[table] = (0..count as usize)
                            .map(|c| coeff_scale(max_abs(component(c)), bits))
                            .collect();
                    }
                    Some(zero_table) => {
                        let (s, z): (Vec<f32>, Vec<f32>) = (0..count as usize)
                            .map(|c| {
                                let (lo, hi) = min_max(component(c));
                                zero_point_scale(lo, hi, bits)
                            })
                            .unzip();
                        tables[table] = s;
                        tables[zero_table] = z;
                    }
                }
            }
            FieldLayout::Dense {
                dtype,
                scale: Some(DenseScale::Table(table)),
                ..
            } => {
                let format = dtype.fp8().expect("checked: only fp8 fields have scales");
                tables[table] = vec![fp8_scale(max_abs(items.iter().flatten()), format)];
            }
            _ => {}
        }
    }
}

/// Rounds a table to its storage dtype, so kernels see exactly the stored values.
pub fn stored(storage: TableStorage, values: Vec<f32>) -> Vec<f32> {
    match storage {
        TableStorage::F32 => values,
        TableStorage::F16 => values
            .into_iter()
            .map(|v| f16::from_f32(v).to_f32())
            .collect(),
        TableStorage::I8Columns { columns } => {
            let columns = columns as usize;
            let scales: Vec<f32> = (0..columns)
                .map(|k| {
                    let max = values
                        .iter()
                        .skip(k)
                        .step_by(columns)
                        .fold(0.0f32, |m, v| m.max(v.abs()));
                    if max > 0.0 {
                        max / 127.0
                    } else {
                        1.0
                    }
                })
                .collect();
            values
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    let s = scales[i % columns];
                    (v / s).round().clamp(-127.0, 127.0) * s
                })
                .collect()
        }
    }
}
