//! The nearest (Euclidean) or best-aligned (dot product) of a set of centroids: the lookup
//! encoders run per vector, and the rule k-means assignment agrees with bit for bit.

/// A vector length known at run time (`usize`) or at compile time ([`Fixed`]). The searches
/// below are written once, generic over it: with a constant length (the encoders `kv_format!`
/// generates pass `Fixed<N>`) the compiler unrolls the per-coordinate loop and vectorizes across
/// codewords; the results are the same either way.
pub trait Dim: Copy {
    fn get(self) -> usize;
}

impl Dim for usize {
    #[inline(always)]
    fn get(self) -> usize {
        self
    }
}

/// A vector length fixed at compile time.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fixed<const N: usize>;

impl<const N: usize> Dim for Fixed<N> {
    #[inline(always)]
    fn get(self) -> usize {
        N
    }
}

/// Index of the centroid closest to `x` in L2 distance (first one on ties; 0 if there are none).
#[inline]
pub fn nearest<D: Dim>(centroids: &[f32], dim: D, x: &[f32]) -> usize {
    search(
        centroids,
        dim,
        x,
        f32::INFINITY,
        |s, a, b| {
            let d = a - b;
            s + d * d
        },
        |s, best| s < best,
    )
}

/// Index of the centroid with the largest dot product with `x` (first one on ties; 0 if there
/// are none).
#[inline]
pub fn best_direction<D: Dim>(centroids: &[f32], dim: D, x: &[f32]) -> usize {
    search(
        centroids,
        dim,
        x,
        f32::NEG_INFINITY,
        |s, a, b| s + a * b,
        |s, best| s > best,
    )
}

/// Centroids scored together: one per lane of a 128-bit vector, the baseline width of x86-64
/// (8 lanes measured slower there: the compiler shuffles the lane masks between registers).
const LANES: usize = 4;

/// Index of the first centroid whose score beats every earlier one (`better` is strict), 0 if
/// none beats `worst`. A centroid's score is `step` folded over its coordinates from 0 in order,
/// so scoring `LANES` centroids side by side gives each the value a one-centroid loop would;
/// each lane keeps the first best of its centroids.
#[inline(always)]
fn search<D: Dim>(
    centroids: &[f32],
    dim: D,
    x: &[f32],
    worst: f32,
    step: impl Fn(f32, f32, f32) -> f32,
    better: impl Fn(f32, f32) -> bool,
) -> usize {
    let dim = dim.get();
    if dim == 0 {
        return 0;
    }
    let x = &x[..dim.min(x.len())];
    let mut best = [worst; LANES];
    let mut index = [0u32; LANES];
    let blocks = centroids.chunks_exact(LANES * dim);
    let tail = blocks.remainder();
    for (b, block) in blocks.enumerate() {
        let mut score = [0.0f32; LANES];
        for (t, &xt) in x.iter().enumerate() {
            for (l, s) in score.iter_mut().enumerate() {
                *s = step(*s, xt, block[l * dim + t]);
            }
        }
        let first = (b * LANES) as u32;
        for l in 0..LANES {
            let win = better(score[l], best[l]);
            best[l] = if win { score[l] } else { best[l] };
            index[l] = if win { first + l as u32 } else { index[l] };
        }
    }
    // The first best overall is the best lane's, the lowest index among equals.
    let (mut best_score, mut best_index) = (worst, 0);
    for (&s, &i) in best.iter().zip(&index) {
        let i = i as usize;
        if better(s, best_score) || (s == best_score && i < best_index) {
            best_score = s;
            best_index = i;
        }
    }
    let first = (centroids.len() - tail.len()) / dim;
    for (i, c) in tail.chunks_exact(dim).enumerate() {
        let s = x.iter().zip(c).fold(0.0f32, |s, (&a, &b)| step(s, a, b));
        if better(s, best_score) {
            best_score = s;
            best_index = first + i;
        }
    }
    best_index
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::back::interp::encode::test_rng::{below, normal, seeded};

    #[test]
    fn nearest_and_best_direction_differ_and_break_ties_low() {
        // Centroid 0 is close to x; centroid 1 is far but better aligned and longer.
        let centroids = [1.0f32, 0.1, 10.0, 0.0, 1.0, 0.1];
        let x = [1.0f32, 0.2];
        assert_eq!(nearest(&centroids, 2, &x), 0);
        assert_eq!(best_direction(&centroids, 2, &x), 1);
        // Ties go to the lowest index (centroids 0 and 2 are identical).
        assert_eq!(nearest(&centroids, 2, &[1.0, 0.1]), 0);
        assert_eq!(best_direction(&[0.0, 1.0, 0.0, 1.0], 2, &[0.0, 1.0]), 0);
        assert_eq!(nearest(&[], 2, &x), 0);
        assert_eq!(best_direction(&[], 2, &x), 0);
    }

    #[test]
    fn blocked_searches_equal_a_one_centroid_scan() {
        // The first best of a plain scan, as the searches promise, on centroid counts around
        // the lane blocks, coarse values (many exact ties), infinities and NaN.
        fn scan(c: &[f32], dim: usize, x: &[f32], init: f32, nearest: bool) -> usize {
            let (mut best, mut at) = (init, 0);
            for (i, c) in c.chunks_exact(dim).enumerate() {
                let mut s = 0.0f32;
                for (&a, &b) in x.iter().zip(c) {
                    s += if nearest { (a - b) * (a - b) } else { a * b };
                }
                if (nearest && s < best) || (!nearest && s > best) {
                    best = s;
                    at = i;
                }
            }
            at
        }
        let mut rng = seeded(11);
        for count in [1, 3, 4, 5, 8, 9, 31, 64, 67] {
            for trial in 0..40 {
                let mut c: Vec<f32> = (0..count * 4)
                    .map(|_| (2.0 * normal(&mut rng)).round())
                    .collect();
                let at = below(&mut rng, c.len());
                match trial % 4 {
                    1 => c[at] = f32::NAN,
                    2 => c[at] = f32::INFINITY,
                    3 => c.fill(0.0),
                    _ => {}
                }
                let x: Vec<f32> = (0..4).map(|_| normal(&mut rng).round()).collect();
                let near = scan(&c, 4, &x, f32::INFINITY, true);
                let dir = scan(&c, 4, &x, f32::NEG_INFINITY, false);
                assert_eq!(nearest(&c, 4, &x), near, "nearest of {count}");
                assert_eq!(nearest(&c, Fixed::<4>, &x), near, "nearest of {count}");
                assert_eq!(best_direction(&c, 4, &x), dir, "direction of {count}");
                assert_eq!(
                    best_direction(&c, Fixed::<4>, &x),
                    dir,
                    "direction of {count}"
                );
            }
        }
    }
}
