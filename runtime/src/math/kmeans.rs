//! k-means (Euclidean and spherical) for codebook training.
//!
//! Lloyd's algorithm with k-means++ seeding. Results are deterministic for a given
//! [`KMeansOptions::seed`]: all randomness comes from [`super::rng::seeded`], and the assignment
//! step (which may run on several threads for large inputs) is computed independently per row, so
//! the output does not depend on the number of threads. Inputs are expected to be finite.

use std::borrow::Cow;

use super::rng::{below, normal, seeded, uniform_f64};

/// Parameters for [`kmeans`] and [`spherical_kmeans`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KMeansOptions {
    /// Number of centroids returned (exactly this many, always).
    pub clusters: usize,
    /// Maximum number of Lloyd iterations (stops early once no assignment changes).
    /// With 0 iterations the k-means++ seeds are returned.
    pub iterations: usize,
    /// Rows are subsampled (deterministically, without replacement) to at most this many before
    /// training. 0 means no limit.
    pub max_samples: usize,
    /// Seed for subsampling, k-means++ seeding and tie-breaking perturbations.
    pub seed: u64,
}

/// Below this many multiply-adds per assignment pass everything runs on the calling thread.
const PARALLEL_WORK: usize = 1 << 22;
/// Upper bound on worker threads for the assignment step.
const MAX_THREADS: usize = 32;
/// A point whose cosine distance to its centroid is at most this is treated as lying on it.
const SPHERICAL_ON_CENTROID: f32 = 1e-6;

/// Euclidean k-means. `data` is row-major with `dim` columns; returns `clusters × dim` centroids
/// (row-major).
///
/// - Rows beyond `max_samples` are subsampled deterministically.
/// - Seeding is k-means++; empty clusters are re-seeded from the point farthest from its centroid.
/// - If there are fewer distinct rows than clusters, the missing centroids are deterministic small
///   perturbations of existing ones, so exactly `clusters` (pairwise distinct) centroids come back.
/// - With no rows at all, all centroids are zero.
pub fn kmeans(data: &[f32], dim: usize, opts: &KMeansOptions) -> Vec<f32> {
    if dim == 0 || opts.clusters == 0 {
        return Vec::new();
    }
    debug_assert_eq!(data.len() % dim, 0, "data length is not a multiple of dim");
    let data = &data[..data.len() / dim * dim];
    let mut rng = seeded(opts.seed);
    let points = subsample(data, dim, opts.max_samples, &mut rng);
    if points.is_empty() {
        return vec![0.0; opts.clusters * dim];
    }
    train(&points, dim, opts, false, &mut rng)
}

/// Spherical k-means: rows are L2-normalized first (zero rows are skipped), points are assigned
/// to the centroid with the largest dot product (cosine), and centroids are normalized means.
/// Every returned centroid has unit norm; empty clusters (or clusters whose mean is zero) are
/// re-seeded like in [`kmeans`]. With no non-zero rows, the centroids are deterministic random
/// unit vectors.
pub fn spherical_kmeans(data: &[f32], dim: usize, opts: &KMeansOptions) -> Vec<f32> {
    if dim == 0 || opts.clusters == 0 {
        return Vec::new();
    }
    debug_assert_eq!(data.len() % dim, 0, "data length is not a multiple of dim");
    let mut normalized = Vec::with_capacity(data.len() / dim * dim);
    for row in data.chunks_exact(dim) {
        let norm_sq: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        if norm_sq > 0.0 && norm_sq.is_finite() {
            let inv = 1.0 / norm_sq.sqrt();
            normalized.extend(row.iter().map(|&v| (f64::from(v) * inv) as f32));
        }
    }
    let mut rng = seeded(opts.seed);
    let points = subsample(&normalized, dim, opts.max_samples, &mut rng);
    if points.is_empty() {
        let mut out = Vec::with_capacity(opts.clusters * dim);
        for _ in 0..opts.clusters {
            push_random_unit(&mut out, dim, &mut rng);
        }
        return out;
    }
    train(&points, dim, opts, true, &mut rng)
}

/// Deterministic subsample without replacement (partial Fisher–Yates), kept in original order.
fn subsample<'a>(
    data: &'a [f32],
    dim: usize,
    max_samples: usize,
    rng: &mut impl rand::Rng,
) -> Cow<'a, [f32]> {
    let rows = data.len() / dim;
    if max_samples == 0 || rows <= max_samples {
        return Cow::Borrowed(data);
    }
    let mut idx: Vec<usize> = (0..rows).collect();
    for i in 0..max_samples {
        let j = i + below(rng, rows - i);
        idx.swap(i, j);
    }
    idx.truncate(max_samples);
    idx.sort_unstable();
    let mut out = Vec::with_capacity(max_samples * dim);
    for i in idx {
        out.extend_from_slice(&data[i * dim..(i + 1) * dim]);
    }
    Cow::Owned(out)
}

/// Lloyd iterations on `points` (non-empty; already unit rows when `spherical`).
fn train(
    points: &[f32],
    dim: usize,
    opts: &KMeansOptions,
    spherical: bool,
    rng: &mut impl rand::Rng,
) -> Vec<f32> {
    let k = opts.clusters;
    let n = points.len() / dim;
    let mut centroids = init_plus_plus(points, dim, k, spherical, rng);

    let mut labels = vec![usize::MAX; n];
    // Per point: squared distance (Euclidean) or 1 - cosine (spherical) to its centroid.
    let mut score = vec![0.0f32; n];
    let mut transposed = vec![0.0f32; k * dim];
    let mut sums = vec![0.0f64; k * dim];
    let mut counts = vec![0usize; k];
    let mut empty = Vec::new();

    for _ in 0..opts.iterations {
        transpose(&centroids, dim, k, &mut transposed);
        let centroids_t = Centroids {
            transposed: &transposed,
            dim,
            k,
            spherical,
        };
        let changed = centroids_t.assign(points, &mut labels, &mut score);
        if changed == 0 {
            break;
        }

        sums.fill(0.0);
        counts.fill(0);
        for (p, &l) in points.chunks_exact(dim).zip(&labels) {
            counts[l] += 1;
            for (s, &v) in sums[l * dim..(l + 1) * dim].iter_mut().zip(p) {
                *s += f64::from(v);
            }
        }

        empty.clear();
        for c in 0..k {
            let sum = &sums[c * dim..(c + 1) * dim];
            let centroid = &mut centroids[c * dim..(c + 1) * dim];
            if counts[c] == 0 {
                empty.push(c);
            } else if spherical {
                let norm = sum.iter().map(|v| v * v).sum::<f64>().sqrt();
                if norm > 0.0 && norm.is_finite() {
                    for (o, &s) in centroid.iter_mut().zip(sum) {
                        *o = (s / norm) as f32;
                    }
                } else {
                    empty.push(c);
                }
            } else {
                let inv = 1.0 / counts[c] as f64;
                for (o, &s) in centroid.iter_mut().zip(sum) {
                    *o = (s * inv) as f32;
                }
            }
        }

        // Re-seed empty clusters from the points farthest from their centroids, each point used
        // at most once. A point that already sits on its centroid would only duplicate that
        // centroid, so in that case the previous (distinct) centroid is kept instead.
        for &c in &empty {
            let mut far = None;
            let mut far_score = if spherical {
                SPHERICAL_ON_CENTROID
            } else {
                0.0
            };
            for (i, &s) in score.iter().enumerate() {
                if s > far_score {
                    far_score = s;
                    far = Some(i);
                }
            }
            if let Some(i) = far {
                centroids[c * dim..(c + 1) * dim].copy_from_slice(&points[i * dim..(i + 1) * dim]);
                score[i] = f32::NEG_INFINITY;
                labels[i] = c;
            }
        }
    }

    if spherical {
        for c in centroids.chunks_exact_mut(dim) {
            normalize_in_place(c);
        }
    }
    centroids
}

/// k-means++ seeding. If the points run out of distinct rows before `k` seeds are chosen, the
/// remaining seeds are small deterministic perturbations of the chosen ones.
fn init_plus_plus(
    points: &[f32],
    dim: usize,
    k: usize,
    spherical: bool,
    rng: &mut impl rand::Rng,
) -> Vec<f32> {
    let n = points.len() / dim;
    let row = |i: usize| &points[i * dim..(i + 1) * dim];
    let mut cents = Vec::with_capacity(k * dim);

    let first = below(rng, n);
    cents.extend_from_slice(row(first));
    let mut d2: Vec<f32> = points
        .chunks_exact(dim)
        .map(|p| sq_dist(p, row(first)))
        .collect();
    let mut filled = 1;
    while filled < k {
        let total: f64 = d2.iter().map(|&v| f64::from(v)).sum();
        if !(total > 0.0 && total.is_finite()) {
            break;
        }
        let target = uniform_f64(rng) * total;
        let mut acc = 0.0f64;
        let mut pick = None;
        let mut last_positive = None;
        for (i, &v) in d2.iter().enumerate() {
            if v > 0.0 {
                last_positive = Some(i);
                acc += f64::from(v);
                if acc > target {
                    pick = Some(i);
                    break;
                }
            }
        }
        let Some(idx) = pick.or(last_positive) else {
            break;
        };
        let seed_row = row(idx);
        cents.extend_from_slice(seed_row);
        for (d, p) in d2.iter_mut().zip(points.chunks_exact(dim)) {
            let nd = sq_dist(p, seed_row);
            if nd < *d {
                *d = nd;
            }
        }
        filled += 1;
    }

    if filled < k {
        let rms = (points
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / points.len() as f64)
            .sqrt();
        let scale = if rms > 0.0 && rms.is_finite() {
            (1e-3 * rms) as f32
        } else {
            1e-3
        };
        for c in filled..k {
            let base = (c % filled) * dim;
            for j in 0..dim {
                let v = cents[base + j] + scale * normal(rng);
                cents.push(v);
            }
            if spherical {
                let start = cents.len() - dim;
                if !normalize_in_place(&mut cents[start..]) {
                    cents.truncate(start);
                    push_random_unit(&mut cents, dim, rng);
                }
            }
        }
    }
    cents
}

/// The `k` centroids an assignment scores points against.
#[derive(Clone, Copy)]
struct Centroids<'a> {
    /// The `dim × k` transpose of the centroids.
    transposed: &'a [f32],
    dim: usize,
    k: usize,
    /// Best-aligned (cosine) rather than nearest (Euclidean).
    spherical: bool,
}

impl Centroids<'_> {
    /// Assign every point to its nearest (or best-aligned) centroid; returns how many labels changed.
    fn assign(self, points: &[f32], labels: &mut [usize], score: &mut [f32]) -> usize {
        let Centroids { dim, k, .. } = self;
        let n = labels.len();
        let threads = if n.saturating_mul(k).saturating_mul(dim) < PARALLEL_WORK {
            1
        } else {
            std::thread::available_parallelism()
                .map_or(1, |t| t.get())
                .min(MAX_THREADS)
                .min(n)
        };
        if threads <= 1 {
            return self.assign_block(points, labels, score);
        }
        let chunk = n.div_ceil(threads);
        std::thread::scope(|s| {
            let mut blocks = points
                .chunks(chunk * dim)
                .zip(labels.chunks_mut(chunk))
                .zip(score.chunks_mut(chunk));
            // The calling thread takes the first block itself.
            let Some(((p0, l0), s0)) = blocks.next() else {
                return 0;
            };
            let handles: Vec<_> = blocks
                .map(|((p, l), sc)| s.spawn(move || self.assign_block(p, l, sc)))
                .collect();
            let mut changed = self.assign_block(p0, l0, s0);
            for h in handles {
                changed += h.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            }
            changed
        })
    }

    /// Serial assignment kernel: for each point, accumulates distances (or dot products) to all `k`
    /// centroids at once, so the inner loop runs over contiguous centroid entries and vectorizes.
    /// Per centroid the terms are added in coordinate order starting from 0.0, exactly as in
    /// [`nearest`](kvcc_compiler::back::interp::encode::nearest::nearest) / [`best_direction`](kvcc_compiler::back::interp::encode::nearest::best_direction),
    /// so training and lookup agree bit for bit.
    fn assign_block(self, points: &[f32], labels: &mut [usize], score: &mut [f32]) -> usize {
        let Centroids {
            transposed,
            dim,
            k,
            spherical,
        } = self;
        let mut acc = vec![0.0f32; k];
        let mut changed = 0;
        for ((p, label), sc) in points
            .chunks_exact(dim)
            .zip(labels.iter_mut())
            .zip(score.iter_mut())
        {
            acc.fill(0.0);
            let (best, s) = if spherical {
                accumulate(&mut acc, p, transposed, k, |x, c| x * c);
                let best = arg_extreme(&acc, false);
                (best, 1.0 - acc[best])
            } else {
                accumulate(&mut acc, p, transposed, k, |x, c| {
                    let d = x - c;
                    d * d
                });
                let best = arg_extreme(&acc, true);
                (best, acc[best])
            };
            if *label != best {
                *label = best;
                changed += 1;
            }
            *sc = s;
        }
        changed
    }
}

/// `acc[c] += term(p[0], C[c][0]); acc[c] += term(p[1], C[c][1]); ...` in coordinate order, four
/// coordinates per pass over `acc` to cut loads and stores.
#[inline(always)]
fn accumulate(
    acc: &mut [f32],
    p: &[f32],
    transposed: &[f32],
    k: usize,
    term: impl Fn(f32, f32) -> f32 + Copy,
) {
    let mut columns = transposed.chunks_exact(k);
    let mut coords = p.chunks_exact(4);
    for x in &mut coords {
        let (Some(c0), Some(c1), Some(c2), Some(c3)) = (
            columns.next(),
            columns.next(),
            columns.next(),
            columns.next(),
        ) else {
            return;
        };
        let (x0, x1, x2, x3) = (x[0], x[1], x[2], x[3]);
        for ((((a, &v0), &v1), &v2), &v3) in acc.iter_mut().zip(c0).zip(c1).zip(c2).zip(c3) {
            let mut t = *a;
            t += term(x0, v0);
            t += term(x1, v1);
            t += term(x2, v2);
            t += term(x3, v3);
            *a = t;
        }
    }
    for (&x, column) in coords.remainder().iter().zip(columns) {
        for (a, &v) in acc.iter_mut().zip(column) {
            *a += term(x, v);
        }
    }
}

/// Index of the first minimum (`min == true`) or maximum of `v`, ignoring NaNs; 0 if there is no
/// finite candidate. Same result as a sequential strict-comparison scan, but the extreme value is
/// found with lane-wise comparisons that vectorize.
#[inline]
fn arg_extreme(v: &[f32], min: bool) -> usize {
    const LANES: usize = 8;
    let sentinel = if min {
        f32::INFINITY
    } else {
        f32::NEG_INFINITY
    };
    let mut lanes = [sentinel; LANES];
    let chunks = v.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            let better = if min { x < *m } else { x > *m };
            *m = if better { x } else { *m };
        }
    }
    let mut extreme = sentinel;
    for &x in lanes.iter().chain(rest) {
        if (min && x < extreme) || (!min && x > extreme) {
            extreme = x;
        }
    }
    if extreme == sentinel {
        return 0;
    }
    v.iter().position(|&x| x == extreme).unwrap_or(0)
}

/// `out[j * k + c] = centroids[c * dim + j]`.
fn transpose(centroids: &[f32], dim: usize, k: usize, out: &mut [f32]) {
    for (c, row) in centroids.chunks_exact(dim).enumerate() {
        for (j, &v) in row.iter().enumerate() {
            out[j * k + c] = v;
        }
    }
}

/// Squared L2 distance with four independent accumulators (used for seeding).
#[inline]
fn sq_dist(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 4];
    let ca = a.chunks_exact(4);
    let cb = b.chunks_exact(4);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..4 {
            let d = x[l] - y[l];
            acc[l] += d * d;
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        let d = x - y;
        tail += d * d;
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// Normalizes `v` to unit L2 norm; returns false (leaving `v` unchanged) if its norm is zero or
/// not finite.
fn normalize_in_place(v: &mut [f32]) -> bool {
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 && norm.is_finite() {
        for x in v.iter_mut() {
            *x = (f64::from(*x) / norm) as f32;
        }
        true
    } else {
        false
    }
}

/// Appends a deterministic random unit vector of length `dim` (`dim > 0`).
fn push_random_unit(out: &mut Vec<f32>, dim: usize, rng: &mut impl rand::Rng) {
    let start = out.len();
    loop {
        out.extend((0..dim).map(|_| normal(rng)));
        if normalize_in_place(&mut out[start..]) {
            return;
        }
        out.truncate(start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvcc_compiler::back::interp::encode::nearest::{best_direction, nearest};

    fn opts(clusters: usize, seed: u64) -> KMeansOptions {
        KMeansOptions {
            clusters,
            iterations: 30,
            max_samples: 0,
            seed,
        }
    }

    /// `per` noisy points around each of `centers`, shuffled deterministically.
    fn blobs(centers: &[Vec<f32>], per: usize, noise: f32, seed: u64) -> Vec<f32> {
        let mut rng = seeded(seed);
        let dim = centers[0].len();
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for _ in 0..per {
            for c in centers {
                rows.push(c.iter().map(|&v| v + noise * normal(&mut rng)).collect());
            }
        }
        for i in (1..rows.len()).rev() {
            let j = below(&mut rng, i + 1);
            rows.swap(i, j);
        }
        let out: Vec<f32> = rows.concat();
        assert_eq!(out.len(), centers.len() * per * dim);
        out
    }

    fn separated_centers(count: usize, dim: usize) -> Vec<Vec<f32>> {
        (0..count)
            .map(|i| {
                let mut c = vec![0.0f32; dim];
                c[i % dim] = if i < dim { 10.0 } else { -10.0 };
                c
            })
            .collect()
    }

    /// Each true center has exactly one centroid within `tol` (so the match is a bijection).
    fn assert_recovers(centroids: &[f32], dim: usize, centers: &[Vec<f32>], tol: f32) {
        assert_eq!(centroids.len(), centers.len() * dim);
        let mut used = vec![false; centers.len()];
        for c in centers {
            let i = nearest(centroids, dim, c);
            assert!(!used[i], "two true centers map to centroid {i}");
            used[i] = true;
            let d = sq_dist(&centroids[i * dim..(i + 1) * dim], c).sqrt();
            assert!(d < tol, "centroid {i} is {d} away from {c:?}");
        }
    }

    fn norm(v: &[f32]) -> f32 {
        v.iter().map(|x| x * x).sum::<f32>().sqrt()
    }

    #[test]
    fn kmeans_recovers_separated_clusters() {
        let dim = 8;
        let centers = separated_centers(6, dim);
        let data = blobs(&centers, 200, 0.3, 1);
        let centroids = kmeans(&data, dim, &opts(6, 7));
        assert_recovers(&centroids, dim, &centers, 0.1);
    }

    #[test]
    fn kmeans_subsamples_when_larger_than_max_samples() {
        let dim = 4;
        let centers = separated_centers(4, dim);
        let data = blobs(&centers, 2_000, 0.2, 2);
        let o = KMeansOptions {
            max_samples: 400,
            ..opts(4, 3)
        };
        let centroids = kmeans(&data, dim, &o);
        assert_recovers(&centroids, dim, &centers, 0.1);
        // Subsampling changes the result relative to using all rows, but deterministically.
        assert_eq!(centroids, kmeans(&data, dim, &o));
    }

    #[test]
    fn kmeans_is_deterministic() {
        let dim = 6;
        let mut rng = seeded(5);
        let data: Vec<f32> = (0..3_000 * dim).map(|_| normal(&mut rng)).collect();
        let o = KMeansOptions {
            max_samples: 2_000,
            ..opts(16, 11)
        };
        let a = kmeans(&data, dim, &o);
        let b = kmeans(&data, dim, &o);
        assert_eq!(a, b);
        let c = kmeans(&data, dim, &KMeansOptions { seed: 12, ..o });
        assert_ne!(a, c);
        assert_eq!(c.len(), 16 * dim);
    }

    #[test]
    fn kmeans_parallel_assignment_matches_serial() {
        // Large enough to take the multi-threaded path; compare against a single-threaded pass.
        let (dim, k, n) = (16, 64, 8_192);
        assert!(n * k * dim >= PARALLEL_WORK);
        let mut rng = seeded(21);
        let points: Vec<f32> = (0..n * dim).map(|_| normal(&mut rng)).collect();
        let centroids: Vec<f32> = (0..k * dim).map(|_| normal(&mut rng)).collect();
        let mut t = vec![0.0; k * dim];
        transpose(&centroids, dim, k, &mut t);
        for spherical in [false, true] {
            let (mut l1, mut s1) = (vec![usize::MAX; n], vec![0.0; n]);
            let (mut l2, mut s2) = (vec![usize::MAX; n], vec![0.0; n]);
            let c = Centroids {
                transposed: &t,
                dim,
                k,
                spherical,
            };
            assert_eq!(c.assign(&points, &mut l1, &mut s1), n);
            assert_eq!(c.assign_block(&points, &mut l2, &mut s2), n);
            assert_eq!(l1, l2);
            assert_eq!(s1, s2);
            for (i, p) in points.chunks_exact(dim).enumerate() {
                let want = if spherical {
                    best_direction(&centroids, dim, p)
                } else {
                    nearest(&centroids, dim, p)
                };
                assert_eq!(l1[i], want);
            }
        }
    }

    #[test]
    fn kmeans_returns_exactly_k_with_few_distinct_rows() {
        let dim = 3;
        let distinct = [[1.0f32, 2.0, 3.0], [-1.0, 0.0, 4.0], [5.0, 5.0, 5.0]];
        let data: Vec<f32> = (0..30).flat_map(|i| distinct[i % 3]).collect();
        for spherical in [false, true] {
            let o = opts(8, 4);
            let c = if spherical {
                spherical_kmeans(&data, dim, &o)
            } else {
                kmeans(&data, dim, &o)
            };
            assert_eq!(c.len(), 8 * dim);
            assert!(c.iter().all(|v| v.is_finite()));
            // Every distinct row is represented (exactly, or as its direction).
            for d in &distinct {
                let target: Vec<f32> = if spherical {
                    let n = norm(d);
                    d.iter().map(|v| v / n).collect()
                } else {
                    d.to_vec()
                };
                let i = nearest(&c, dim, &target);
                assert!(sq_dist(&c[i * dim..(i + 1) * dim], &target) < 1e-10);
            }
            // Centroids are pairwise distinct.
            for a in 0..8 {
                for b in a + 1..8 {
                    assert_ne!(&c[a * dim..(a + 1) * dim], &c[b * dim..(b + 1) * dim]);
                }
            }
            assert_eq!(
                c,
                if spherical {
                    spherical_kmeans(&data, dim, &o)
                } else {
                    kmeans(&data, dim, &o)
                }
            );
        }
        // A single repeated row, and a single row.
        let one = vec![0.5f32; 4 * 10];
        assert_eq!(kmeans(&one, 4, &opts(5, 1)).len(), 20);
        assert_eq!(kmeans(&one[..4], 4, &opts(5, 1)).len(), 20);
    }

    #[test]
    fn kmeans_degenerate_inputs() {
        assert_eq!(kmeans(&[], 4, &opts(3, 0)), vec![0.0; 12]);
        assert!(kmeans(&[1.0, 2.0], 2, &opts(0, 0)).is_empty());
        assert!(kmeans(&[], 0, &opts(3, 0)).is_empty());
        let zeros = vec![0.0f32; 40];
        let c = kmeans(&zeros, 4, &opts(3, 0));
        assert_eq!(c.len(), 12);
        assert!(c.iter().all(|v| v.is_finite() && v.abs() < 0.1));
        // Zero iterations: the k-means++ seeds, which are data rows.
        let data: Vec<f32> = (0..20).map(|v| v as f32).collect();
        let c = kmeans(
            &data,
            2,
            &KMeansOptions {
                iterations: 0,
                ..opts(3, 9)
            },
        );
        for row in c.chunks_exact(2) {
            assert!(data.chunks_exact(2).any(|d| d == row));
        }
    }

    #[test]
    fn spherical_centroids_are_unit() {
        let dim = 8;
        let mut rng = seeded(3);
        let mut data: Vec<f32> = (0..2_000 * dim).map(|_| 5.0 * normal(&mut rng)).collect();
        // Some zero rows, which must be ignored.
        for r in (0..2_000).step_by(7) {
            data[r * dim..(r + 1) * dim].fill(0.0);
        }
        let o = opts(32, 5);
        let c = spherical_kmeans(&data, dim, &o);
        assert_eq!(c.len(), 32 * dim);
        for row in c.chunks_exact(dim) {
            assert!((norm(row) - 1.0).abs() < 1e-5, "norm {}", norm(row));
        }
        assert_eq!(c, spherical_kmeans(&data, dim, &o));
        // All-zero input still yields unit centroids.
        let z = spherical_kmeans(&vec![0.0; 10 * dim], dim, &opts(4, 1));
        assert_eq!(z.len(), 4 * dim);
        for row in z.chunks_exact(dim) {
            assert!((norm(row) - 1.0).abs() < 1e-5);
        }
    }

    #[test]
    fn spherical_kmeans_recovers_directions() {
        let dim = 6;
        let directions = separated_centers(5, dim);
        // Points along each direction with widely varying magnitudes, plus angular noise.
        let mut rng = seeded(8);
        let mut data = Vec::new();
        for i in 0..1_500 {
            let d = &directions[i % 5];
            let mag = 0.01 + 100.0 * uniform_f64(&mut rng) as f32;
            for &v in d {
                data.push(mag * (v / 10.0 + 0.05 * normal(&mut rng)));
            }
        }
        let c = spherical_kmeans(&data, dim, &opts(5, 2));
        let mut used = [false; 5];
        for d in &directions {
            let unit: Vec<f32> = d.iter().map(|v| v / 10.0).collect();
            let i = best_direction(&c, dim, &unit);
            assert!(!used[i]);
            used[i] = true;
            let cos: f32 = c[i * dim..(i + 1) * dim]
                .iter()
                .zip(&unit)
                .map(|(a, b)| a * b)
                .sum();
            assert!(cos > 0.99, "cos {cos}");
        }
    }
}
