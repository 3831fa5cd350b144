//! Structured synthetic keys, values and decode queries.
//!
//! Compression formats exploit structure (low rank, outlier channels, attention sinks, peaked
//! attention), so a test corpus of pure noise would rank them wrongly. [`synthesize`] builds,
//! for every kv head independently and deterministically from the seed:
//!
//! * **keys**: a low-rank latent (rank `max(1, d/8)`) whose per-token Gaussian latent `z_t`
//!   drifts smoothly over `t`, times a random mixing matrix (every channel ends up with unit
//!   variance), plus isotropic noise carrying ≈10% of the energy. Then 2–4 **outlier channels**
//!   (fewer when `d < 16`) are scaled to ≈8× the typical channel RMS, with a consistent sign per
//!   channel; they sit in low-frequency RoPE pairs, as in trained models. Finally **RoPE**
//!   (base 10000, pairs `(i, i + d/2)` as in Llama) is applied at each token's position.
//! * **sink tokens**: the first `min(4, tokens)` keys have ≈4× the typical key norm and point
//!   along a common low-frequency direction `s` (so RoPE barely moves them); every query carries a
//!   component along `s` sized so that a sink's scaled logit is about `ln(tokens) - 0.75 ± 1`,
//!   so the sinks draw real attention mass (about a third on average, at any context length).
//! * **values**: a low-rank latent (rank `max(1, d/4)`), also drifting over tokens, plus ≈10%
//!   noise; the sink tokens' values are instead a small, shared vector outside that structure.
//! * **queries**: one decode query per query head. Query head `h` reads kv head
//!   `h / (q_heads / kv_heads)`; its content part lies mostly in the span of that head's key
//!   mixing matrix (heads of one group share part of it), so the softmax at scale `1/sqrt(d)` is
//!   peaked rather than uniform. The content part is RoPE-rotated at position `tokens` (the
//!   decode position); the sink component is added in the rotated frame, which is how a trained
//!   model keeps attending to the sinks at any distance.
//!
//! Keys' typical `|x|` is about 1 (outlier channels ≈8, sink keys a few units per element);
//! values and queries are O(1) per element.

use crate::math::rng::{below, normal, seeded};
use rand_chacha::ChaCha8Rng;

/// RoPE base frequency used for keys and queries.
pub const ROPE_BASE: f64 = 10_000.0;
/// Number of attention-sink tokens at the start of the sequence.
pub const SINK_TOKENS: usize = 4;

/// Ratio of an outlier channel's RMS to a typical channel's.
const OUTLIER_SCALE: f32 = 8.0;
/// Ratio of a sink key's norm to a typical key's norm.
const SINK_KEY_SCALE: f64 = 4.0;
/// Noise standard deviation relative to a unit-variance signal channel: 1/3 gives
/// noise energy 1/9 of the signal, i.e. 10% of the total.
const NOISE_STD: f32 = 1.0 / 3.0;
/// Share of each outlier channel that is a constant, per-channel signed offset (the rest follows
/// the latent), in amplitude: `OFFSET² + (1 - OFFSET²) = 1`.
const OUTLIER_OFFSET: f32 = 0.6;
/// Per-token correlation of the slowly drifting part of the latents.
const DRIFT_RHO: f32 = 0.98;
/// Amplitude of the drifting part of the latents (the rest is fresh per token).
const DRIFT_SHARE: f32 = 0.6;
/// Query content: weight of the key-mixing subspace and of an arbitrary direction, in units of
/// `sqrt(d)` (so the per-element RMS is about `sqrt(IN² + OUT²)`).
const QUERY_IN_SUBSPACE: f64 = 0.75;
const QUERY_OFF_SUBSPACE: f64 = 0.5;
/// Share (in amplitude) of a query's subspace direction shared by all query heads of a group.
const QUERY_GROUP_SHARE: f32 = 0.7;
/// Scaled logit (at `1/sqrt(d)`) of a sink token:
/// `ln(tokens) + SINK_LOGIT + SINK_LOGIT_SPREAD * N(0, 1)` per query head. The `ln(tokens)` term
/// keeps the sinks' share of attention roughly independent of the context length (about a third
/// on average); the spread makes heads differ in how much they use them.
const SINK_LOGIT: f64 = -0.75;
const SINK_LOGIT_SPREAD: f64 = 1.0;
/// Sink values: amplitude of the shared vector and of the per-sink noise.
const SINK_VALUE_SCALE: f32 = 0.5;
const SINK_VALUE_NOISE: f32 = 0.05;

/// Shape and seed of a synthetic K/V/Q set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SynthOptions {
    pub seed: u64,
    pub kv_heads: usize,
    pub q_heads: usize,
    pub tokens: usize,
    pub head_dim: usize,
}

impl Default for SynthOptions {
    /// 2 kv heads, 8 query heads, 512 tokens, head_dim 64, seed 0.
    fn default() -> Self {
        SynthOptions {
            seed: 0,
            kv_heads: 2,
            q_heads: 8,
            tokens: 512,
            head_dim: 64,
        }
    }
}

/// Synthetic keys, values and decode queries (see the module documentation).
#[derive(Debug, Clone, PartialEq)]
pub struct SynthKv {
    /// `[kv_head][token][head_dim]`, row-major, RoPE applied.
    pub keys: Vec<f32>,
    /// `[kv_head][token][head_dim]`, row-major.
    pub values: Vec<f32>,
    /// `[q_head][head_dim]`: one decode query per query head, RoPE applied at position `tokens`.
    pub queries: Vec<f32>,
    /// The shape and seed the set was synthesized from.
    pub options: SynthOptions,
}

impl SynthKv {
    /// Keys of kv head `g`, `[token][head_dim]`.
    pub fn head_keys(&self, g: usize) -> &[f32] {
        let n = self.options.tokens * self.options.head_dim;
        &self.keys[g * n..(g + 1) * n]
    }

    /// Values of kv head `g`, `[token][head_dim]`.
    pub fn head_values(&self, g: usize) -> &[f32] {
        let n = self.options.tokens * self.options.head_dim;
        &self.values[g * n..(g + 1) * n]
    }

    /// The decode query of query head `h`.
    pub fn query(&self, h: usize) -> &[f32] {
        let d = self.options.head_dim;
        &self.queries[h * d..(h + 1) * d]
    }

    /// The kv head that query head `h` reads.
    pub fn kv_head_of(&self, h: usize) -> usize {
        h / (self.options.q_heads / self.options.kv_heads)
    }
}

/// Rotates `x` (`head_dim` values, even) in place by RoPE at `position`: pair `(i, i + d/2)`
/// turns by `position * base^(-2i/d)` radians.
///
/// # Panics
/// If `x.len()` is odd.
pub fn apply_rope(x: &mut [f32], position: usize, base: f64) {
    assert!(x.len().is_multiple_of(2), "RoPE needs an even head_dim");
    let half = x.len() / 2;
    let d = x.len() as f64;
    for i in 0..half {
        let theta = base.powf(-2.0 * i as f64 / d);
        let (sin, cos) = (position as f64 * theta).sin_cos();
        let (a, b) = (f64::from(x[i]), f64::from(x[i + half]));
        x[i] = (a * cos - b * sin) as f32;
        x[i + half] = (a * sin + b * cos) as f32;
    }
}

/// Builds a structured synthetic K/V/Q set; deterministic in `opts.seed`.
///
/// # Panics
/// If `kv_heads` is zero, `q_heads` is not a positive multiple of `kv_heads`, or `head_dim` is
/// not a positive even number.
pub fn synthesize(opts: &SynthOptions) -> SynthKv {
    let &SynthOptions {
        seed,
        kv_heads,
        q_heads,
        tokens,
        head_dim: d,
    } = opts;
    assert!(kv_heads > 0, "kv_heads must be positive");
    assert!(
        q_heads > 0 && q_heads.is_multiple_of(kv_heads),
        "q_heads ({q_heads}) must be a positive multiple of kv_heads ({kv_heads})"
    );
    assert!(
        d > 0 && d.is_multiple_of(2),
        "head_dim ({d}) must be positive and even"
    );
    let group = q_heads / kv_heads;

    let mut rng = seeded(seed);
    let mut keys = Vec::with_capacity(kv_heads * tokens * d);
    let mut values = Vec::with_capacity(kv_heads * tokens * d);
    let mut queries = Vec::with_capacity(q_heads * d);
    for _ in 0..kv_heads {
        let head = synth_head(&mut rng, tokens, d, group);
        keys.extend_from_slice(&head.keys);
        values.extend_from_slice(&head.values);
        queries.extend_from_slice(&head.queries);
    }
    SynthKv {
        keys,
        values,
        queries,
        options: *opts,
    }
}

struct Head {
    keys: Vec<f32>,
    values: Vec<f32>,
    queries: Vec<f32>,
}

fn gaussian_vec(rng: &mut ChaCha8Rng, n: usize, std: f32) -> Vec<f32> {
    (0..n).map(|_| std * normal(rng)).collect()
}

fn norm(x: &[f32]) -> f64 {
    x.iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        .sqrt()
}

fn normalize(x: &mut [f32]) {
    let n = norm(x);
    if n > 0.0 {
        for v in x.iter_mut() {
            *v = (f64::from(*v) / n) as f32;
        }
    }
}

/// `[tokens][rank]` unit-variance latents: a fresh Gaussian part plus an AR(1) part that drifts
/// slowly over tokens.
fn drifting_latents(rng: &mut ChaCha8Rng, tokens: usize, rank: usize) -> Vec<f32> {
    let fresh = (1.0 - DRIFT_SHARE * DRIFT_SHARE).sqrt();
    let innov = (1.0 - DRIFT_RHO * DRIFT_RHO).sqrt();
    let mut drift = gaussian_vec(rng, rank, 1.0);
    let mut out = Vec::with_capacity(tokens * rank);
    for _ in 0..tokens {
        for m in drift.iter_mut() {
            *m = DRIFT_RHO * *m + innov * normal(rng);
        }
        for &m in &drift {
            out.push(fresh * normal(rng) + DRIFT_SHARE * m);
        }
    }
    out
}

/// `latent [rank] × mix [rank][d]` into `out [d]`.
fn mix_into(latent: &[f32], mix: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (&z, row) in latent.iter().zip(mix.chunks_exact(out.len())) {
        for (o, &a) in out.iter_mut().zip(row) {
            *o += z * a;
        }
    }
}

fn synth_head(rng: &mut ChaCha8Rng, tokens: usize, d: usize, group: usize) -> Head {
    let half = d / 2;
    let key_rank = (d / 8).max(1);
    let value_rank = (d / 4).max(1);

    // Key mixing matrix [key_rank][d]: entries N(0, 1/rank) so each channel has unit variance.
    let key_mix = gaussian_vec(rng, key_rank * d, (1.0 / key_rank as f32).sqrt());

    // Low-frequency channels: both members of the RoPE pairs (i, i + d/2) with i >= d/4.
    let low_freq: Vec<usize> = (half / 2..half).flat_map(|i| [i, i + half]).collect();

    // Outlier channels: 2–4 distinct low-frequency channels (at most d/8), each with a sign.
    let n_outliers = (2 + below(rng, 3)).min((d / 8).max(1)).min(low_freq.len());
    let mut pool = low_freq.clone();
    let mut outliers = Vec::with_capacity(n_outliers);
    for _ in 0..n_outliers {
        let c = pool.swap_remove(below(rng, pool.len()));
        let sign = if normal(rng) < 0.0 { -1.0f32 } else { 1.0 };
        outliers.push((c, sign));
    }

    // Sink direction: unit vector on the low-frequency channels.
    let mut sink_dir = vec![0.0f32; d];
    for &c in &low_freq {
        sink_dir[c] = normal(rng);
    }
    normalize(&mut sink_dir);

    // Keys before RoPE.
    let latents = drifting_latents(rng, tokens, key_rank);
    let mut keys = vec![0.0f32; tokens * d];
    let outlier_latent = (1.0 - OUTLIER_OFFSET * OUTLIER_OFFSET).sqrt();
    for (t, k) in keys.chunks_exact_mut(d).enumerate() {
        mix_into(&latents[t * key_rank..(t + 1) * key_rank], &key_mix, k);
        for x in k.iter_mut() {
            *x += NOISE_STD * normal(rng);
        }
        for &(c, sign) in &outliers {
            k[c] = OUTLIER_SCALE * (OUTLIER_OFFSET * sign + outlier_latent * k[c]);
        }
    }

    // Sink keys: SINK_KEY_SCALE × the expected norm of an ordinary key, along the sink direction.
    let channel_energy = 1.0 + f64::from(NOISE_STD * NOISE_STD);
    let outlier_energy = f64::from(OUTLIER_SCALE * OUTLIER_SCALE)
        * (f64::from(OUTLIER_OFFSET * OUTLIER_OFFSET)
            + f64::from(outlier_latent * outlier_latent) * channel_energy);
    let typical_key_norm =
        ((d - n_outliers) as f64 * channel_energy + n_outliers as f64 * outlier_energy).sqrt();
    let sink_key_norm = SINK_KEY_SCALE * typical_key_norm;
    let sinks = SINK_TOKENS.min(tokens);
    for k in keys.chunks_exact_mut(d).take(sinks) {
        let jitter = 0.1 / (d as f32).sqrt();
        for (x, &s) in k.iter_mut().zip(&sink_dir) {
            *x = s + jitter * normal(rng);
        }
        normalize(k);
        for x in k.iter_mut() {
            *x = (f64::from(*x) * sink_key_norm) as f32;
        }
    }
    for (t, k) in keys.chunks_exact_mut(d).enumerate() {
        apply_rope(k, t, ROPE_BASE);
    }

    // Values.
    let value_mix = gaussian_vec(rng, value_rank * d, (1.0 / value_rank as f32).sqrt());
    let value_latents = drifting_latents(rng, tokens, value_rank);
    let mut values = vec![0.0f32; tokens * d];
    for (t, v) in values.chunks_exact_mut(d).enumerate() {
        mix_into(
            &value_latents[t * value_rank..(t + 1) * value_rank],
            &value_mix,
            v,
        );
        for x in v.iter_mut() {
            *x += NOISE_STD * normal(rng);
        }
    }
    let sink_value = gaussian_vec(rng, d, SINK_VALUE_SCALE);
    for v in values.chunks_exact_mut(d).take(sinks) {
        for (x, &s) in v.iter_mut().zip(&sink_value) {
            *x = s + SINK_VALUE_NOISE * normal(rng);
        }
    }

    // Queries.
    let sqrt_d = (d as f64).sqrt();
    let shared = gaussian_vec(rng, key_rank, 1.0);
    let own_share = (1.0 - QUERY_GROUP_SHARE * QUERY_GROUP_SHARE).sqrt();
    let mut queries = vec![0.0f32; group * d];
    for q in queries.chunks_exact_mut(d) {
        let w: Vec<f32> = shared
            .iter()
            .map(|&s| QUERY_GROUP_SHARE * s + own_share * normal(rng))
            .collect();
        let mut inside = vec![0.0f32; d];
        mix_into(&w, &key_mix, &mut inside);
        normalize(&mut inside);
        let mut outside = gaussian_vec(rng, d, 1.0);
        normalize(&mut outside);
        for ((x, &a), &b) in q.iter_mut().zip(&inside).zip(&outside) {
            *x = (sqrt_d * (QUERY_IN_SUBSPACE * f64::from(a) + QUERY_OFF_SUBSPACE * f64::from(b)))
                as f32;
        }
        apply_rope(q, tokens, ROPE_BASE);
        // Replace the (rotated) content's component along the sink direction so that a sink's
        // scaled logit is the per-head target (sink keys barely rotate at positions < 4).
        let sink_logit =
            (tokens.max(1) as f64).ln() + SINK_LOGIT + SINK_LOGIT_SPREAD * f64::from(normal(rng));
        let sink_weight = sink_logit * sqrt_d / sink_key_norm;
        let along: f64 = q
            .iter()
            .zip(&sink_dir)
            .map(|(&x, &s)| f64::from(x) * f64::from(s))
            .sum();
        for (x, &s) in q.iter_mut().zip(&sink_dir) {
            *x += ((sink_weight - along) * f64::from(s)) as f32;
        }
    }

    Head {
        keys,
        values,
        queries,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::dense_attention;

    fn opts(seed: u64) -> SynthOptions {
        SynthOptions {
            seed,
            kv_heads: 2,
            q_heads: 8,
            tokens: 512,
            head_dim: 64,
        }
    }

    /// Softmax probabilities of query head `h` at scale 1/sqrt(d).
    fn probs(s: &SynthKv, h: usize) -> Vec<f64> {
        let g = s.kv_head_of(h);
        let scale = 1.0 / (s.options.head_dim as f32).sqrt();
        let att = dense_attention(
            s.query(h),
            s.head_keys(g),
            s.head_values(g),
            s.options.head_dim,
            scale,
        );
        let max = att.logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = att
            .logits
            .iter()
            .map(|&l| f64::from(l - max).exp())
            .collect();
        let total: f64 = w.iter().sum();
        w.into_iter().map(|x| x / total).collect()
    }

    fn top8_mass(p: &[f64]) -> f64 {
        let mut sorted = p.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        sorted.iter().take(8).sum()
    }

    #[test]
    fn synth_shapes() {
        let o = SynthOptions {
            seed: 3,
            kv_heads: 2,
            q_heads: 6,
            tokens: 37,
            head_dim: 32,
        };
        let s = synthesize(&o);
        assert_eq!(s.keys.len(), 2 * 37 * 32);
        assert_eq!(s.values.len(), 2 * 37 * 32);
        assert_eq!(s.queries.len(), 6 * 32);
        assert_eq!(
            (
                s.options.kv_heads,
                s.options.q_heads,
                s.options.tokens,
                s.options.head_dim
            ),
            (2, 6, 37, 32)
        );
        assert_eq!(s.kv_head_of(2), 0);
        assert_eq!(s.kv_head_of(3), 1);
        assert_eq!(s.head_keys(1).len(), 37 * 32);
        assert_eq!(s.query(5).len(), 32);
    }

    #[test]
    fn synth_small_and_degenerate_shapes() {
        for (tokens, d) in [(0, 8), (1, 2), (3, 4), (5, 8), (9, 16)] {
            let s = synthesize(&SynthOptions {
                seed: 1,
                kv_heads: 1,
                q_heads: 2,
                tokens,
                head_dim: d,
            });
            assert_eq!(s.keys.len(), tokens * d);
            assert_eq!(s.queries.len(), 2 * d);
            assert!(s
                .keys
                .iter()
                .chain(&s.values)
                .chain(&s.queries)
                .all(|x| x.is_finite()));
        }
    }

    #[test]
    fn synth_is_deterministic_in_seed() {
        let a = synthesize(&opts(11));
        let b = synthesize(&opts(11));
        let c = synthesize(&opts(12));
        assert_eq!(a, b);
        assert_ne!(a.keys, c.keys);
        assert_ne!(a.values, c.values);
        assert_ne!(a.queries, c.queries);
    }

    #[test]
    fn synth_values_are_finite_and_order_one() {
        let s = synthesize(&opts(5));
        let all = s.keys.iter().chain(&s.values).chain(&s.queries);
        assert!(all.clone().all(|x| x.is_finite()));
        let max = all.fold(0.0f32, |m, &x| m.max(x.abs()));
        assert!(max < 100.0, "max |x| = {max}");
        // Typical key magnitude ~1: the median |x| of keys.
        let mut mags: Vec<f32> = s.keys.iter().map(|x| x.abs()).collect();
        mags.sort_by(f32::total_cmp);
        let median = mags[mags.len() / 2];
        assert!((0.4..1.5).contains(&median), "median |k| = {median}");
        let rms = |x: &[f32]| (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
        let (v_rms, q_rms) = (rms(&s.values), rms(&s.queries));
        assert!((0.5..2.0).contains(&v_rms), "value rms {v_rms}");
        assert!((0.5..2.0).contains(&q_rms), "query rms {q_rms}");
    }

    #[test]
    fn synth_attention_is_peaked() {
        for seed in 0..4 {
            let s = synthesize(&opts(seed));
            let masses: Vec<f64> = (0..s.options.q_heads)
                .map(|h| top8_mass(&probs(&s, h)))
                .collect();
            let mean = masses.iter().sum::<f64>() / masses.len() as f64;
            assert!(mean > 0.2, "seed {seed}: top-8 mass {masses:?}");
            // ...but not degenerate: attention is not all on one token.
            assert!(mean < 0.98, "seed {seed}: top-8 mass {masses:?}");
        }
    }

    #[test]
    fn synth_sinks_draw_attention() {
        let s = synthesize(&opts(2));
        let d = s.options.head_dim;
        let mut sink_mass = 0.0;
        for h in 0..s.options.q_heads {
            sink_mass += probs(&s, h)[..SINK_TOKENS].iter().sum::<f64>();
        }
        sink_mass /= s.options.q_heads as f64;
        // 4 of 512 tokens would get 0.8% under uniform attention.
        assert!(sink_mass > 0.05, "sink mass {sink_mass}");
        assert!(sink_mass < 0.9, "sink mass {sink_mass}");
        // Sink keys have several times the norm of ordinary keys.
        let keys = s.head_keys(0);
        let n = |t: usize| norm(&keys[t * d..(t + 1) * d]);
        let ordinary = (SINK_TOKENS..s.options.tokens).map(n).sum::<f64>()
            / (s.options.tokens - SINK_TOKENS) as f64;
        for t in 0..SINK_TOKENS {
            let r = n(t) / ordinary;
            assert!((3.0..5.0).contains(&r), "sink {t} norm ratio {r}");
        }
    }

    #[test]
    fn synth_outlier_channels_are_visible() {
        let s = synthesize(&opts(9));
        let d = s.options.head_dim;
        for g in 0..s.options.kv_heads {
            let keys = s.head_keys(g);
            let mut rms: Vec<f64> = (0..d)
                .map(|c| {
                    let sum: f64 = keys
                        .chunks_exact(d)
                        .skip(SINK_TOKENS)
                        .map(|k| f64::from(k[c]).powi(2))
                        .sum();
                    (sum / (s.options.tokens - SINK_TOKENS) as f64).sqrt()
                })
                .collect();
            rms.sort_by(f64::total_cmp);
            let ratio = rms[d - 1] / rms[d / 2];
            assert!(ratio > 4.0, "head {g}: max/median channel rms {ratio}");
        }
    }

    #[test]
    fn synth_rope_is_a_rotation() {
        let mut x: Vec<f32> = (0..16).map(|i| (i as f32 * 0.7).cos()).collect();
        let before = norm(&x);
        let orig = x.clone();
        apply_rope(&mut x, 0, ROPE_BASE);
        assert_eq!(x, orig);
        apply_rope(&mut x, 1234, ROPE_BASE);
        assert!((norm(&x) - before).abs() < 1e-5);
        // Pair 0 turns by exactly `position` radians.
        let mut y = vec![0.0f32; 4];
        y[0] = 1.0;
        apply_rope(&mut y, 1, ROPE_BASE);
        assert!((y[0] - 1f32.cos()).abs() < 1e-6 && (y[2] - 1f32.sin()).abs() < 1e-6);
    }
}
