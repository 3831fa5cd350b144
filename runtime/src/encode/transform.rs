//! Applying a codec's transform to dense vectors (encoding) and its inverse
//! (reference decoding). Kernels never do this to stored data: they move the
//! transform onto the query and the output.

use kvcc_compiler::layout::TransformLayout;

use super::ops::{fwht_normalized, pca_forward, pca_inverse, srht_forward, srht_inverse};

/// x (head_dim) -> x' (codec dims).
pub fn forward(transform: TransformLayout, tables: &[Vec<f32>], x: &[f32]) -> Vec<f32> {
    match transform {
        TransformLayout::Identity => x.to_vec(),
        TransformLayout::Hadamard => {
            let mut y = x.to_vec();
            fwht_normalized(&mut y);
            y
        }
        TransformLayout::Srht { signs, .. } => {
            let mut y = x.to_vec();
            srht_forward(&mut y, &tables[signs]);
            y
        }
        TransformLayout::Pca { rank, basis, mean } => {
            let mut c = vec![0.0f32; rank as usize];
            pca_forward(&tables[basis], &tables[mean], x, &mut c);
            c
        }
    }
}

/// x' (codec dims) -> x (head_dim).
pub fn inverse(
    transform: TransformLayout,
    tables: &[Vec<f32>],
    y: &[f32],
    head_dim: usize,
) -> Vec<f32> {
    match transform {
        TransformLayout::Identity => y.to_vec(),
        TransformLayout::Hadamard => {
            let mut x = y.to_vec();
            fwht_normalized(&mut x);
            x
        }
        TransformLayout::Srht { signs, .. } => {
            let mut x = y.to_vec();
            srht_inverse(&mut x, &tables[signs]);
            x
        }
        TransformLayout::Pca { basis, mean, .. } => {
            let mut x = vec![0.0f32; head_dim];
            pca_inverse(&tables[basis], &tables[mean], y, &mut x);
            x
        }
    }
}
