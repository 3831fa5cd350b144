//! Deterministic random numbers.
//!
//! Everything in `math` draws randomness through [`seeded`] so that results are reproducible
//! for a given seed on every platform. Only the core `rand::Rng` trait (`next_u32`/`next_u64`)
//! is used; the conversions to floats and bounded integers below are our own, so their output
//! does not depend on `rand`'s distribution implementations.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A ChaCha8 generator deterministically seeded from `seed`.
pub fn seeded(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// One standard-normal sample (mean 0, variance 1) via the Box–Muller transform.
///
/// Consumes exactly two `u64`s from `rng`; the second Box–Muller variate is discarded so that the
/// function is stateless.
pub fn normal(rng: &mut impl rand::Rng) -> f32 {
    // u1 in (0, 1] so that ln(u1) is finite; u2 in [0, 1).
    let u1 = 1.0 - uniform_f64(rng);
    let u2 = uniform_f64(rng);
    let r = (-2.0 * u1.ln()).sqrt();
    (r * (std::f64::consts::TAU * u2).cos()) as f32
}

/// Uniform in `[0, 1)` with 53 random bits.
pub(crate) fn uniform_f64(rng: &mut impl rand::Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Uniform integer in `0..n` (`n > 0`), by the multiply-shift method (bias < 2^-64 * n).
pub(crate) fn below(rng: &mut impl rand::Rng, n: usize) -> usize {
    debug_assert!(n > 0);
    ((u128::from(rng.next_u64()) * n as u128) >> 64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_is_deterministic() {
        let mut a = seeded(42);
        let mut b = seeded(42);
        let mut c = seeded(43);
        let xa: Vec<f32> = (0..16).map(|_| normal(&mut a)).collect();
        let xb: Vec<f32> = (0..16).map(|_| normal(&mut b)).collect();
        let xc: Vec<f32> = (0..16).map(|_| normal(&mut c)).collect();
        assert_eq!(xa, xb);
        assert_ne!(xa, xc);
    }

    #[test]
    fn normal_has_unit_moments() {
        let mut rng = seeded(7);
        let n = 200_000;
        let (mut s1, mut s2) = (0.0f64, 0.0f64);
        for _ in 0..n {
            let z = f64::from(normal(&mut rng));
            assert!(z.is_finite());
            s1 += z;
            s2 += z * z;
        }
        let mean = s1 / n as f64;
        let var = s2 / n as f64 - mean * mean;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
    }

    #[test]
    fn below_stays_in_range() {
        let mut rng = seeded(1);
        let mut hits = [0usize; 5];
        for _ in 0..10_000 {
            hits[below(&mut rng, 5)] += 1;
        }
        assert!(hits.iter().all(|&h| h > 1_500));
        assert!((0..1000).all(|_| uniform_f64(&mut rng) < 1.0));
    }
}
