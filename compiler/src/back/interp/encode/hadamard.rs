//! Fast Walsh–Hadamard transform and the subsampled randomized Hadamard transform (SRHT).
//!
//! Ordering is Sylvester's: `H_1 = [1]`, `H_2n = [[H_n, H_n], [H_n, -H_n]]`, so that
//! `H[i][j] = (-1)^popcount(i & j)`.

/// In-place fast Walsh–Hadamard transform scaled by `1/sqrt(n)`: orthonormal and its own inverse.
///
/// `x.len()` must be a power of two (or zero); callers validate. In debug builds a
/// non-power-of-two length panics; in release builds it does not panic but the result is
/// meaningless.
pub fn fwht_normalized(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(
        n == 0 || n.is_power_of_two(),
        "fwht length {n} is not a power of two"
    );
    if n <= 1 {
        return;
    }
    let mut h = 1;
    while h < n {
        for block in x.chunks_exact_mut(2 * h) {
            let (lo, hi) = block.split_at_mut(h);
            for (a, b) in lo.iter_mut().zip(hi.iter_mut()) {
                let (u, v) = (*a, *b);
                *a = u + v;
                *b = u - v;
            }
        }
        h *= 2;
    }
    let scale = (1.0 / (n as f64).sqrt()) as f32;
    for v in x.iter_mut() {
        *v *= scale;
    }
}

/// SRHT forward: `x <- H (D x)` where `D = diag(signs)` (entries ±1) and `H` is the normalized FWHT.
pub fn srht_forward(x: &mut [f32], signs: &[f32]) {
    debug_assert_eq!(x.len(), signs.len(), "srht signs length mismatch");
    for (v, s) in x.iter_mut().zip(signs) {
        *v *= *s;
    }
    fwht_normalized(x);
}

/// SRHT inverse: `x <- D (H x)`; undoes [`srht_forward`] with the same `signs`.
pub fn srht_inverse(x: &mut [f32], signs: &[f32]) {
    debug_assert_eq!(x.len(), signs.len(), "srht signs length mismatch");
    fwht_normalized(x);
    for (v, s) in x.iter_mut().zip(signs) {
        *v *= *s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::back::interp::encode::test_rng::{normal, seeded};

    /// Explicit Sylvester matrix H_n (unnormalized), built by the recursion.
    fn sylvester(n: usize) -> Vec<Vec<f32>> {
        let mut h = vec![vec![1.0f32]];
        while h.len() < n {
            let m = h.len();
            let mut next = vec![vec![0.0f32; 2 * m]; 2 * m];
            for i in 0..m {
                for j in 0..m {
                    next[i][j] = h[i][j];
                    next[i][j + m] = h[i][j];
                    next[i + m][j] = h[i][j];
                    next[i + m][j + m] = -h[i][j];
                }
            }
            h = next;
        }
        h
    }

    fn random_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = seeded(seed);
        (0..n).map(|_| normal(&mut rng)).collect()
    }

    fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol)
    }

    #[test]
    fn fwht_matches_sylvester_matrix_n8() {
        let n = 8;
        let h = sylvester(n);
        let scale = 1.0 / (n as f32).sqrt();
        for col in 0..n {
            let mut e = vec![0.0f32; n];
            e[col] = 1.0;
            fwht_normalized(&mut e);
            let expected: Vec<f32> = (0..n).map(|row| h[row][col] * scale).collect();
            assert!(
                close(&e, &expected, 1e-6),
                "column {col}: {e:?} vs {expected:?}"
            );
        }
        let x = random_vec(n, 3);
        let mut y = x.clone();
        fwht_normalized(&mut y);
        let expected: Vec<f32> = (0..n)
            .map(|i| (0..n).map(|j| h[i][j] * x[j]).sum::<f32>() * scale)
            .collect();
        assert!(close(&y, &expected, 1e-5));
        // Sylvester closed form H[i][j] = (-1)^popcount(i & j).
        for (i, row) in h.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                let s = if (i & j).count_ones() % 2 == 0 {
                    1.0
                } else {
                    -1.0
                };
                assert_eq!(v, s);
            }
        }
    }

    #[test]
    fn fwht_is_orthonormal() {
        for n in [1usize, 2, 4, 16, 64, 256] {
            // Norm preservation.
            let x = random_vec(n, n as u64);
            let mut y = x.clone();
            fwht_normalized(&mut y);
            let nx: f32 = x.iter().map(|v| v * v).sum();
            let ny: f32 = y.iter().map(|v| v * v).sum();
            assert!((nx - ny).abs() <= 1e-4 * nx.max(1.0), "n={n}: {nx} vs {ny}");
            // Columns orthonormal: transform the identity, check Gram matrix.
            if n <= 64 {
                let cols: Vec<Vec<f32>> = (0..n)
                    .map(|c| {
                        let mut e = vec![0.0f32; n];
                        e[c] = 1.0;
                        fwht_normalized(&mut e);
                        e
                    })
                    .collect();
                for a in 0..n {
                    for b in 0..n {
                        let d: f32 = cols[a].iter().zip(&cols[b]).map(|(p, q)| p * q).sum();
                        let want = if a == b { 1.0 } else { 0.0 };
                        assert!((d - want).abs() < 1e-5, "n={n} gram[{a}][{b}]={d}");
                    }
                }
            }
        }
    }

    #[test]
    fn fwht_is_an_involution() {
        for n in [0usize, 1, 2, 8, 32, 1024] {
            let x = random_vec(n, 11 + n as u64);
            let mut y = x.clone();
            fwht_normalized(&mut y);
            fwht_normalized(&mut y);
            assert!(close(&x, &y, 1e-5), "n={n}");
        }
    }

    #[test]
    fn srht_inverse_undoes_forward() {
        for n in [1usize, 4, 32, 128] {
            let mut rng = seeded(99 + n as u64);
            let signs: Vec<f32> = (0..n)
                .map(|_| if normal(&mut rng) >= 0.0 { 1.0 } else { -1.0 })
                .collect();
            let x = random_vec(n, 5 + n as u64);
            let mut y = x.clone();
            srht_forward(&mut y, &signs);
            if n > 1 {
                assert!(!close(&x, &y, 1e-3), "forward should change the vector");
            }
            srht_inverse(&mut y, &signs);
            assert!(close(&x, &y, 1e-5), "n={n}");
            // And forward ∘ inverse as well.
            srht_inverse(&mut y, &signs);
            srht_forward(&mut y, &signs);
            assert!(close(&x, &y, 1e-5), "n={n}");
        }
    }
}
