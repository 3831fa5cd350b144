//! Dense fp32 attention: the ground truth that every compressed format is measured against.
//!
//! One decode query attends over `tokens` keys and values (`[tokens][head_dim]`, row-major).
//! Dot products, the softmax and the weighted sum are accumulated in f64 so that the reference
//! itself contributes no measurable error; the softmax subtracts the maximum logit first.

/// The result of [`dense_attention`] for one query row.
#[derive(Debug, Clone, PartialEq)]
pub struct DenseAttention {
    /// Attention output, `head_dim` values.
    pub output: Vec<f32>,
    /// Scaled logits `scale * <query, key_t>`, one per token.
    pub logits: Vec<f32>,
}

/// Exact softmax attention of one `query` (`head_dim` values) over `keys` and `values`
/// (`[tokens][head_dim]`, row-major, the same number of tokens).
///
/// `logits[t] = scale * <query, keys[t]>`; `output = Σ_t softmax(logits)_t * values[t]`.
/// With zero tokens the output is all zeros and `logits` is empty.
///
/// # Panics
/// If `head_dim` is zero, or the slice lengths do not fit `head_dim`.
pub fn dense_attention(
    query: &[f32],
    keys: &[f32],
    values: &[f32],
    head_dim: usize,
    scale: f32,
) -> DenseAttention {
    assert!(head_dim > 0, "head_dim must be positive");
    assert_eq!(query.len(), head_dim, "query length != head_dim");
    assert_eq!(
        keys.len() % head_dim,
        0,
        "keys length is not a multiple of head_dim"
    );
    assert_eq!(
        keys.len(),
        values.len(),
        "keys and values hold different numbers of tokens"
    );
    let tokens = keys.len() / head_dim;
    let scale = f64::from(scale);

    let logits64: Vec<f64> = keys
        .chunks_exact(head_dim)
        .map(|k| {
            let dot: f64 = query
                .iter()
                .zip(k)
                .map(|(&q, &k)| f64::from(q) * f64::from(k))
                .sum();
            scale * dot
        })
        .collect();

    let mut acc = vec![0.0f64; head_dim];
    if tokens > 0 {
        let max = logits64.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = logits64.iter().map(|&l| (l - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        for (w, v) in weights.iter().zip(values.chunks_exact(head_dim)) {
            let p = w / total;
            for (a, &x) in acc.iter_mut().zip(v) {
                *a += p * f64::from(x);
            }
        }
    }

    DenseAttention {
        output: acc.into_iter().map(|x| x as f32).collect(),
        logits: logits64.into_iter().map(|l| l as f32).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_uniform_keys_give_mean_of_values() {
        let d = 4;
        let keys: Vec<f32> = (0..3).flat_map(|_| [0.5f32, -1.0, 2.0, 0.25]).collect();
        let values = vec![
            1.0, 2.0, 3.0, 4.0, //
            -1.0, 0.0, 1.0, 2.0, //
            3.0, 1.0, -4.0, 0.0,
        ];
        let query = [0.3f32, -0.7, 1.1, 2.0];
        let att = dense_attention(&query, &keys, &values, d, 0.5);
        let expect = [1.0f32, 1.0, 0.0, 2.0];
        for (o, e) in att.output.iter().zip(expect) {
            assert!((o - e).abs() < 1e-6, "{:?}", att.output);
        }
        // All logits equal 0.5 * <q, k>.
        let l = 0.5 * (0.3 * 0.5 + 0.7 + 2.2 + 0.5);
        assert_eq!(att.logits.len(), 3);
        for &x in &att.logits {
            assert!((x - l).abs() < 1e-6);
        }
    }

    #[test]
    fn reference_dominant_key_gives_its_value() {
        let d = 2;
        let keys = vec![0.0, 1.0, 100.0, 0.0, 0.0, -1.0];
        let values = vec![5.0, 6.0, -2.0, 7.0, 9.0, 9.0];
        let att = dense_attention(&[1.0, 0.0], &keys, &values, d, 1.0);
        assert!((att.output[0] + 2.0).abs() < 1e-6);
        assert!((att.output[1] - 7.0).abs() < 1e-6);
        assert_eq!(att.logits, vec![0.0, 100.0, 0.0]);
    }

    #[test]
    fn reference_softmax_is_stable_for_huge_logits() {
        // exp(1e4) overflows; the max-subtracted softmax must not.
        let keys = vec![1e4, 1e4 - 2.0_f32.ln()];
        let values = vec![3.0, 0.0];
        let att = dense_attention(&[1.0], &keys, &values, 1, 1.0);
        assert!(att.output[0].is_finite());
        // weights 2/3 and 1/3 (up to f32 rounding of the key)
        assert!((att.output[0] - 2.0).abs() < 2e-3, "{:?}", att.output);
    }

    #[test]
    fn reference_two_tokens_hand_computed() {
        // logits 0 and ln 3 -> weights 1/4, 3/4
        let keys = vec![0.0, 3.0_f32.ln()];
        let values = vec![4.0, 8.0];
        let att = dense_attention(&[1.0], &keys, &values, 1, 1.0);
        assert!((att.output[0] - 7.0).abs() < 1e-5);
    }

    #[test]
    fn reference_zero_tokens_gives_zero_output() {
        let att = dense_attention(&[1.0, 2.0], &[], &[], 2, 1.0);
        assert_eq!(att.output, vec![0.0, 0.0]);
        assert!(att.logits.is_empty());
    }
}
