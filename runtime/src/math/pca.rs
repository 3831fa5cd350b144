//! Principal component analysis via a symmetric eigendecomposition of the covariance.

use nalgebra::{DMatrix, SymmetricEigen};

/// A fitted PCA basis.
#[derive(Debug, Clone, PartialEq)]
pub struct Pca {
    /// Per-coordinate mean of the data (`dim` entries).
    pub mean: Vec<f32>,
    /// `dim × rank`, row-major: `basis[i * rank + k]` is component `k`'s `i`-th entry.
    /// Columns are orthonormal.
    pub basis: Vec<f32>,
    /// Eigenvalues (variances) of the top `rank` components, descending.
    pub explained: Vec<f32>,
}

/// Fits a rank-`rank` PCA to `data` (row-major, `dim` columns).
///
/// The covariance is accumulated in f64 with the unbiased `1 / (rows - 1)` normalization
/// (`1 / rows` for a single row). Components are sorted by descending eigenvalue; each is
/// oriented so that its largest-magnitude entry (the first one on ties) is positive. Eigenvalues
/// that come out slightly negative from rounding are clamped to 0.
///
/// `rank` is clamped to `dim`, so `explained.len()` is the effective rank. With no rows the mean
/// is zero and the basis is the leading identity columns with zero explained variance. Inputs
/// should be finite; if the covariance is not, the basis falls back to identity columns and
/// `explained` is NaN.
pub fn fit_pca(data: &[f32], dim: usize, rank: usize) -> Pca {
    if dim == 0 {
        return Pca {
            mean: Vec::new(),
            basis: Vec::new(),
            explained: Vec::new(),
        };
    }
    debug_assert_eq!(data.len() % dim, 0, "data length is not a multiple of dim");
    let rank = rank.min(dim);
    let rows = data.len() / dim;

    let mut mean = vec![0.0f64; dim];
    for row in data.chunks_exact(dim) {
        for (m, &v) in mean.iter_mut().zip(row) {
            *m += f64::from(v);
        }
    }
    if rows > 0 {
        for m in &mut mean {
            *m /= rows as f64;
        }
    }

    // Upper triangle of the scatter matrix, then mirrored.
    let mut cov = vec![0.0f64; dim * dim];
    let mut centered = vec![0.0f64; dim];
    for row in data.chunks_exact(dim) {
        for ((c, &v), &m) in centered.iter_mut().zip(row).zip(&mean) {
            *c = f64::from(v) - m;
        }
        for a in 0..dim {
            let ca = centered[a];
            for (acc, &cb) in cov[a * dim + a..(a + 1) * dim]
                .iter_mut()
                .zip(&centered[a..])
            {
                *acc += ca * cb;
            }
        }
    }
    let denom = rows.saturating_sub(1).max(1) as f64;
    for a in 0..dim {
        for b in a..dim {
            let v = cov[a * dim + b] / denom;
            cov[a * dim + b] = v;
            cov[b * dim + a] = v;
        }
    }

    let mean_f32: Vec<f32> = mean.iter().map(|&m| m as f32).collect();
    let identity_fallback = |explained: f32| {
        let mut basis = vec![0.0f32; dim * rank];
        for k in 0..rank {
            basis[k * rank + k] = 1.0;
        }
        Pca {
            mean: mean_f32.clone(),
            basis,
            explained: vec![explained; rank],
        }
    };
    if !cov.iter().all(|v| v.is_finite()) {
        return identity_fallback(f32::NAN);
    }

    let matrix = DMatrix::from_row_slice(dim, dim, &cov);
    let max_iterations = 1_000 * dim + 10_000;
    let Some(eig) = SymmetricEigen::try_new(matrix, f64::EPSILON, max_iterations) else {
        return identity_fallback(f32::NAN);
    };

    let mut order: Vec<usize> = (0..dim).collect();
    // Stable sort: equal eigenvalues keep nalgebra's (deterministic) order.
    order.sort_by(|&i, &j| eig.eigenvalues[j].total_cmp(&eig.eigenvalues[i]));

    let mut basis = vec![0.0f32; dim * rank];
    let mut explained = Vec::with_capacity(rank);
    for (k, &src) in order.iter().take(rank).enumerate() {
        let column = eig.eigenvectors.column(src);
        let mut pivot = 0;
        for i in 1..dim {
            if column[i].abs() > column[pivot].abs() {
                pivot = i;
            }
        }
        let sign = if column[pivot] < 0.0 { -1.0 } else { 1.0 };
        for i in 0..dim {
            basis[i * rank + k] = (sign * column[i]) as f32;
        }
        explained.push(eig.eigenvalues[src].max(0.0) as f32);
    }

    Pca {
        mean: mean_f32,
        basis,
        explained,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::rng::{normal, seeded};

    /// `rows` samples of `offset + W z + noise * e` with `W` a random `dim × r` matrix.
    fn low_rank_data(
        rows: usize,
        dim: usize,
        r: usize,
        noise: f32,
        seed: u64,
    ) -> (Vec<f32>, Vec<f32>) {
        let mut rng = seeded(seed);
        let w: Vec<f32> = (0..dim * r).map(|_| normal(&mut rng)).collect();
        let offset: Vec<f32> = (0..dim).map(|i| i as f32 - 3.0).collect();
        let mut data = Vec::with_capacity(rows * dim);
        for _ in 0..rows {
            let z: Vec<f32> = (0..r).map(|k| (k + 1) as f32 * normal(&mut rng)).collect();
            for i in 0..dim {
                let s: f32 = (0..r).map(|k| w[i * r + k] * z[k]).sum();
                data.push(offset[i] + s + noise * normal(&mut rng));
            }
        }
        (data, w)
    }

    fn assert_orthonormal_columns(p: &Pca, dim: usize, rank: usize) {
        assert_eq!(p.basis.len(), dim * rank);
        for a in 0..rank {
            for b in 0..rank {
                let d: f32 = (0..dim)
                    .map(|i| p.basis[i * rank + a] * p.basis[i * rank + b])
                    .sum();
                let want = if a == b { 1.0 } else { 0.0 };
                assert!((d - want).abs() < 1e-5, "gram[{a}][{b}] = {d}");
            }
        }
    }

    /// Mean relative residual of projecting the centered rows onto the basis.
    fn relative_projection_error(data: &[f32], p: &Pca, dim: usize, rank: usize) -> f64 {
        let (mut resid, mut total) = (0.0f64, 0.0f64);
        for row in data.chunks_exact(dim) {
            let c: Vec<f32> = row.iter().zip(&p.mean).map(|(v, m)| v - m).collect();
            let coeffs: Vec<f32> = (0..rank)
                .map(|k| (0..dim).map(|i| c[i] * p.basis[i * rank + k]).sum())
                .collect();
            for (&ci, basis_row) in c.iter().zip(p.basis.chunks_exact(rank)) {
                let rec: f32 = coeffs.iter().zip(basis_row).map(|(a, b)| a * b).sum();
                resid += f64::from(ci - rec).powi(2);
                total += f64::from(ci).powi(2);
            }
        }
        resid / total
    }

    #[test]
    fn pca_recovers_low_rank_subspace() {
        let (dim, r) = (16, 3);
        let (data, w) = low_rank_data(4_000, dim, r, 0.01, 1);
        let p = fit_pca(&data, dim, r);
        assert_eq!(p.mean.len(), dim);
        assert_eq!(p.explained.len(), r);
        assert_orthonormal_columns(&p, dim, r);
        // Mean recovered.
        for (i, &m) in p.mean.iter().enumerate() {
            assert!((m - (i as f32 - 3.0)).abs() < 0.5, "mean[{i}] = {m}");
        }
        // Centered data lies in the span of the basis.
        let err = relative_projection_error(&data, &p, dim, r);
        assert!(err < 1e-4, "relative projection error {err}");
        // Each generating column of W lies in the span of the basis.
        for k in 0..r {
            let col: Vec<f32> = (0..dim).map(|i| w[i * r + k]).collect();
            let norm_sq: f32 = col.iter().map(|v| v * v).sum();
            let proj_sq: f32 = (0..r)
                .map(|j| {
                    (0..dim)
                        .map(|i| col[i] * p.basis[i * r + j])
                        .sum::<f32>()
                        .powi(2)
                })
                .sum();
            assert!(
                proj_sq / norm_sq > 0.9999,
                "column {k}: {}",
                proj_sq / norm_sq
            );
        }
        // Eigenvalues descending and clearly separated from the noise floor.
        assert!(p.explained.windows(2).all(|e| e[0] >= e[1]));
        let full = fit_pca(&data, dim, dim);
        assert_orthonormal_columns(&full, dim, dim);
        assert!(full.explained.windows(2).all(|e| e[0] >= e[1]));
        assert!(full.explained[r - 1] > 100.0 * full.explained[r]);
        assert!(full.explained[dim - 1] >= 0.0);
        // The leading components of the full fit are the rank-r fit.
        for i in 0..dim {
            for k in 0..r {
                assert_eq!(full.basis[i * dim + k], p.basis[i * r + k]);
            }
        }
    }

    #[test]
    fn pca_sign_convention_and_determinism() {
        let (dim, r) = (8, 4);
        let (data, _) = low_rank_data(500, dim, r, 0.1, 2);
        let p = fit_pca(&data, dim, r);
        assert_eq!(p, fit_pca(&data, dim, r));
        for k in 0..r {
            let col: Vec<f32> = (0..dim).map(|i| p.basis[i * r + k]).collect();
            let pivot = col
                .iter()
                .copied()
                .max_by(|a, b| a.abs().total_cmp(&b.abs()))
                .unwrap_or(0.0);
            assert!(pivot > 0.0, "component {k} not sign-normalized: {col:?}");
        }
        // Flipping the data's sign flips the mean but not the (sign-normalized) basis.
        let neg: Vec<f32> = data.iter().map(|v| -v).collect();
        let q = fit_pca(&neg, dim, r);
        for (a, b) in p.basis.iter().zip(&q.basis) {
            assert!((a - b).abs() < 1e-4);
        }
    }

    #[test]
    fn pca_known_axes_and_degenerate_inputs() {
        // Variance 9 on axis 2, 1 on axis 0, 0 on axis 1.
        let mut rng = seeded(4);
        let mut data = Vec::new();
        for _ in 0..20_000 {
            data.extend([normal(&mut rng), 7.0, 3.0 * normal(&mut rng)]);
        }
        let p = fit_pca(&data, 3, 2);
        assert!((p.basis[2 * 2] - 1.0).abs() < 1e-3, "{:?}", p.basis);
        assert!((p.basis[1] - 1.0).abs() < 1e-3, "{:?}", p.basis);
        assert!((p.explained[0] - 9.0).abs() < 0.3);
        assert!((p.explained[1] - 1.0).abs() < 0.05);
        assert!((p.mean[1] - 7.0).abs() < 1e-6);

        let empty = fit_pca(&[], 4, 2);
        assert_eq!(empty.mean, vec![0.0; 4]);
        assert_eq!(empty.explained, vec![0.0; 2]);
        assert_orthonormal_columns(&empty, 4, 2);
        let clamped = fit_pca(&data, 3, 10);
        assert_eq!(clamped.explained.len(), 3);
        assert_orthonormal_columns(&clamped, 3, 3);
        let single = fit_pca(&[1.0, 2.0], 2, 1);
        assert_eq!(single.mean, vec![1.0, 2.0]);
        assert_eq!(single.explained, vec![0.0]);
        assert!(fit_pca(&[], 0, 3).basis.is_empty());
    }
}
