//! Applying a codec's transform to dense vectors (encoding) and its inverse
//! (reference decoding). Kernels never do this to stored data: they move the
//! transform onto the query and the output.

use crate::layout::TransformLayout;

use super::ops::{fwht_normalized, pca_forward, pca_inverse, srht_forward, srht_inverse};

/// x (head_dim) -> x' (codec dims).
pub fn forward(transform: TransformLayout, tables: &[Vec<f32>], x: &[f32]) -> Vec<f32> {
    apply(transform, tables, x, Direction::Forward)
}

/// x' (codec dims) -> x (head_dim).
pub fn inverse(
    transform: TransformLayout,
    tables: &[Vec<f32>],
    y: &[f32],
    head_dim: usize,
) -> Vec<f32> {
    apply(transform, tables, y, Direction::Inverse { head_dim })
}

#[derive(Clone, Copy)]
enum Direction {
    Forward,
    Inverse { head_dim: usize },
}

fn apply(
    transform: TransformLayout,
    tables: &[Vec<f32>],
    v: &[f32],
    direction: Direction,
) -> Vec<f32> {
    let mut out = v.to_vec();
    match (transform, direction) {
        (TransformLayout::Identity, _) => {}
        (TransformLayout::Hadamard, _) => fwht_normalized(&mut out),
        (TransformLayout::Srht { signs, .. }, Direction::Forward) => {
            srht_forward(&mut out, &tables[signs])
        }
        (TransformLayout::Srht { signs, .. }, Direction::Inverse { .. }) => {
            srht_inverse(&mut out, &tables[signs])
        }
        (TransformLayout::Pca { rank, basis, mean }, Direction::Forward) => {
            out = vec![0.0f32; rank as usize];
            pca_forward(&tables[basis], &tables[mean], v, &mut out);
        }
        (TransformLayout::Pca { basis, mean, .. }, Direction::Inverse { head_dim }) => {
            out = vec![0.0f32; head_dim];
            pca_inverse(&tables[basis], &tables[mean], v, &mut out);
        }
    }
    out
}
