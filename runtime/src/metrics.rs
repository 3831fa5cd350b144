//! Fidelity of an approximate attention against the dense reference
//! ([`crate::reference::dense_attention`]).
//!
//! Feed one row (one query head at one decode step) at a time to a [`FidelityAccumulator`], then
//! call [`FidelityAccumulator::finish`].

/// Aggregate fidelity over all rows added to a [`FidelityAccumulator`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Fidelity {
    /// `sqrt(Σ_rows ||o - o_ref||²) / sqrt(Σ_rows ||o_ref||²)`. Zero when both are zero,
    /// infinite when only the reference is zero.
    pub output_rel_error: f64,
    /// Largest `|logit - logit_ref|` over all tokens read of all rows (a
    /// token a selection did not read has logit -inf).
    pub max_logit_drift: f64,
    /// Mean `|logit - logit_ref|` over all tokens read of all rows.
    pub mean_logit_drift: f64,
    /// Mean over rows of the reference softmax mass on the tokens read: 1
    /// where every token is read.
    pub attention_mass_recall: f64,
    /// Mean over rows of `|top8(approx) ∩ top8(ref)| / 8` (`/ tokens` when a row has fewer than
    /// eight tokens; a row with no tokens counts as a full overlap). Ties break by lower index.
    pub top8_overlap: f64,
    /// Number of rows added.
    pub rows: usize,
}

/// Running sums behind a [`Fidelity`].
impl Fidelity {
    /// Column headers of [`Fidelity::cells`].
    pub const HEADERS: [&str; 4] = ["out rel err", "max logit drift", "mean drift", "top-8"];

    /// Table cells: output error, max and mean logit drift with `digits`
    /// decimals, then the top-8 overlap.
    pub fn cells(&self, digits: usize) -> [String; 4] {
        [
            format!("{:.digits$}", self.output_rel_error),
            format!("{:.digits$}", self.max_logit_drift),
            format!("{:.digits$}", self.mean_logit_drift),
            format!("{:.3}", self.top8_overlap),
        ]
    }
}

#[derive(Debug, Clone, Default)]
pub struct FidelityAccumulator {
    err_sq: f64,
    ref_sq: f64,
    max_drift: f64,
    drift_sum: f64,
    drift_count: usize,
    overlap_sum: f64,
    recall_sum: f64,
    rows: usize,
}

/// How many of the top tokens [`Fidelity::top8_overlap`] compares.
const TOP_K: usize = 8;

impl FidelityAccumulator {
    /// Adds one row: the approximate `output` and `logits` and their reference counterparts.
    ///
    /// # Panics
    /// If `output` and `reference_output`, or `logits` and `reference_logits`, differ in length.
    pub fn add_row(
        &mut self,
        output: &[f32],
        logits: &[f32],
        reference_output: &[f32],
        reference_logits: &[f32],
    ) {
        assert_eq!(
            output.len(),
            reference_output.len(),
            "output and reference output differ in length"
        );
        assert_eq!(
            logits.len(),
            reference_logits.len(),
            "logits and reference logits differ in length"
        );
        for (&o, &r) in output.iter().zip(reference_output) {
            let (o, r) = (f64::from(o), f64::from(r));
            self.err_sq += (o - r) * (o - r);
            self.ref_sq += r * r;
        }
        let read = |l: f32| l != f32::NEG_INFINITY;
        for (&l, &r) in logits.iter().zip(reference_logits) {
            if read(l) {
                let drift = (f64::from(l) - f64::from(r)).abs();
                self.max_drift = self.max_drift.max(drift);
                self.drift_sum += drift;
                self.drift_count += 1;
            }
        }
        let max = reference_logits
            .iter()
            .copied()
            .fold(f32::NEG_INFINITY, f32::max);
        let weight = |r: f32| f64::from(r - max).exp();
        let total: f64 = reference_logits.iter().map(|&r| weight(r)).sum();
        let kept: f64 = (logits.iter().zip(reference_logits))
            .filter(|(&l, _)| read(l))
            .map(|(_, &r)| weight(r))
            .sum();
        self.recall_sum += if total > 0.0 { kept / total } else { 1.0 };

        let k = TOP_K.min(logits.len());
        self.overlap_sum += if k == 0 {
            1.0
        } else {
            let approx = top_k(logits, k);
            let reference = top_k(reference_logits, k);
            let common = approx.iter().filter(|i| reference.contains(i)).count();
            common as f64 / k as f64
        };
        self.rows += 1;
    }

    /// The fidelity over all rows added so far (all zeros when there are none).
    pub fn finish(&self) -> Fidelity {
        let output_rel_error = if self.ref_sq > 0.0 {
            (self.err_sq / self.ref_sq).sqrt()
        } else if self.err_sq > 0.0 {
            f64::INFINITY
        } else {
            0.0
        };
        Fidelity {
            output_rel_error,
            max_logit_drift: self.max_drift,
            mean_logit_drift: if self.drift_count > 0 {
                self.drift_sum / self.drift_count as f64
            } else {
                0.0
            },
            top8_overlap: if self.rows > 0 {
                self.overlap_sum / self.rows as f64
            } else {
                0.0
            },
            attention_mass_recall: if self.rows > 0 {
                self.recall_sum / self.rows as f64
            } else {
                0.0
            },
            rows: self.rows,
        }
    }
}

/// Indices of the `k` largest logits, ties broken by lower index (NaN sorts below everything).
fn top_k(logits: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let key = |i: usize| {
        let x = logits[i];
        if x.is_nan() {
            f32::NEG_INFINITY
        } else {
            x
        }
    };
    idx.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn metrics_exact_match_is_perfect() {
        let mut acc = FidelityAccumulator::default();
        let logits: Vec<f32> = (0..20).map(|i| (i as f32 * 0.37).sin()).collect();
        acc.add_row(&[1.0, 2.0], &logits, &[1.0, 2.0], &logits);
        let f = acc.finish();
        assert_eq!(f.rows, 1);
        assert_eq!(f.output_rel_error, 0.0);
        assert_eq!(f.max_logit_drift, 0.0);
        assert_eq!(f.mean_logit_drift, 0.0);
        assert_eq!(f.top8_overlap, 1.0);
    }

    #[test]
    fn metrics_hand_computed_two_rows() {
        let mut acc = FidelityAccumulator::default();
        // Row 1: o = (3, 4), ref = (3, 0): err² = 16, ref² = 9.
        // logits drift |0.5|, |0|, |-1| (values chosen exact in f32).
        acc.add_row(&[3.0, 4.0], &[1.5, 2.0, 0.0], &[3.0, 0.0], &[1.0, 2.0, 1.0]);
        // Row 2: o = (0, 0), ref = (0, 4): err² = 16, ref² = 16. drift 0.25, 0.25.
        acc.add_row(&[0.0, 0.0], &[0.25, 0.0], &[0.0, 4.0], &[0.0, 0.25]);
        let f = acc.finish();
        assert_eq!(f.rows, 2);
        // sqrt(32) / sqrt(25)
        assert!(close(f.output_rel_error, 32f64.sqrt() / 5.0), "{f:?}");
        assert!(close(f.max_logit_drift, 1.0));
        // (0.5 + 0 + 1 + 0.25 + 0.25) / 5
        assert!(close(f.mean_logit_drift, 0.4));
        // Fewer than 8 tokens: top-k is all tokens, so overlap is 1 in both rows.
        assert!(close(f.top8_overlap, 1.0));
    }

    #[test]
    fn metrics_top8_overlap_counts_common_indices() {
        // Reference ranks tokens 0..8 highest (descending in index order).
        let reference: Vec<f32> = (0..12).map(|i| 12.0 - i as f32).collect();
        // Approx: swap tokens 6, 7 with 10, 11 -> top8 = {0..5, 10, 11}: 6 common.
        let mut approx = reference.clone();
        approx.swap(6, 10);
        approx.swap(7, 11);
        let mut acc = FidelityAccumulator::default();
        acc.add_row(&[1.0], &approx, &[1.0], &reference);
        // Second row: identical -> 8/8.
        acc.add_row(&[1.0], &reference, &[1.0], &reference);
        let f = acc.finish();
        assert!(close(f.top8_overlap, (6.0 / 8.0 + 1.0) / 2.0), "{f:?}");
        assert!(close(f.max_logit_drift, 4.0));
        // Four tokens drift by 4 each, over 24 tokens.
        assert!(close(f.mean_logit_drift, 16.0 / 24.0));
    }

    #[test]
    fn metrics_top8_ties_break_by_lower_index() {
        // Ten equal logits: the top 8 are tokens 0..8.
        assert_eq!(top_k(&[1.0; 10], 8), (0..8).collect::<Vec<_>>());
        // Approx all equal (top8 = 0..8), reference prefers tokens 2..10.
        let approx = [0.0f32; 10];
        let mut reference = [0.0f32; 10];
        reference[8] = 1.0;
        reference[9] = 1.0;
        // reference top8 = {8, 9, 0, 1, 2, 3, 4, 5}: 6 in common with {0..7}.
        let mut acc = FidelityAccumulator::default();
        acc.add_row(&[], &approx, &[], &reference);
        let f = acc.finish();
        assert!(close(f.top8_overlap, 6.0 / 8.0), "{f:?}");
    }

    #[test]
    fn metrics_empty_accumulator_is_default() {
        let f = FidelityAccumulator::default().finish();
        assert_eq!(f.rows, 0);
        assert_eq!(f.output_rel_error, 0.0);
        assert_eq!(f.top8_overlap, 0.0);
        let json = serde_json::to_value(&f).unwrap();
        assert_eq!(json["rows"], 0);
    }

    #[test]
    fn metrics_zero_reference_with_error_is_infinite() {
        let mut acc = FidelityAccumulator::default();
        acc.add_row(&[1.0], &[], &[0.0], &[]);
        let f = acc.finish();
        assert!(f.output_rel_error.is_infinite());
        assert_eq!(f.top8_overlap, 1.0);
    }
}
