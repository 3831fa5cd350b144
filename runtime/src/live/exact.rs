//! Exact rows of a live cache (sinks and the recent tail) stored as f16 or
//! bf16 bits, and exact attention over them as one online-softmax partial.

use half::{bf16, f16};
use kvcc_compiler::back::interp::Softmax;
use kvcc_compiler::spec::ExactDtype;

/// Rounds `x` to `dtype` (round to nearest, ties to even) and returns its bits.
pub fn to_bits(dtype: ExactDtype, x: f32) -> u16 {
    match dtype {
        ExactDtype::F16 => f16::from_f32(x).to_bits(),
        ExactDtype::Bf16 => bf16::from_f32(x).to_bits(),
    }
}

pub fn from_bits(dtype: ExactDtype, bits: u16) -> f32 {
    match dtype {
        ExactDtype::F16 => f16::from_bits(bits).to_f32(),
        ExactDtype::Bf16 => bf16::from_bits(bits).to_f32(),
    }
}

/// `x` as `dtype` stores it.
pub fn round(dtype: ExactDtype, x: f32) -> f32 {
    from_bits(dtype, to_bits(dtype, x))
}

/// Keys and values of one kv head, `[token][head_dim]` each, as stored bits.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExactRows {
    pub keys: Vec<u16>,
    pub values: Vec<u16>,
}

impl ExactRows {
    pub fn tokens(&self, head_dim: usize) -> usize {
        self.keys.len() / head_dim
    }

    /// Appends `[token][head_dim]` rows, rounded.
    pub fn push(&mut self, dtype: ExactDtype, keys: &[f32], values: &[f32]) {
        self.keys.extend(keys.iter().map(|&x| to_bits(dtype, x)));
        self.values
            .extend(values.iter().map(|&x| to_bits(dtype, x)));
    }

    /// Removes the first `tokens` rows and returns them as f32 keys and values.
    pub fn take_front(
        &mut self,
        dtype: ExactDtype,
        tokens: usize,
        head_dim: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let n = tokens * head_dim;
        let widen = |bits: std::vec::Drain<'_, u16>| bits.map(|b| from_bits(dtype, b)).collect();
        (widen(self.keys.drain(..n)), widen(self.values.drain(..n)))
    }
}

/// Online-softmax state and unnormalized accumulator of exact attention: the
/// same partial an executor keeps per tier, so the log-sum-exp merge takes it.
pub struct ExactPartial {
    pub softmax: Softmax,
    pub acc: Vec<f32>,
    /// Every scaled logit, in the order rows were pushed.
    pub logits: Vec<f32>,
}

impl ExactPartial {
    pub fn new(head_dim: usize) -> ExactPartial {
        ExactPartial {
            softmax: Softmax::default(),
            acc: vec![0.0; head_dim],
            logits: Vec::new(),
        }
    }

    /// Folds in every row of `rows` against `query`; logits are `scale · q·k`.
    pub fn push(&mut self, dtype: ExactDtype, rows: &ExactRows, query: &[f32], scale: f32) {
        let d = query.len();
        for (key, value) in rows.keys.chunks(d).zip(rows.values.chunks(d)) {
            let dot: f32 = key
                .iter()
                .zip(query)
                .map(|(&k, &q)| from_bits(dtype, k) * q)
                .sum();
            self.logits.push(dot * scale);
            let (decay, weight) = self.softmax.push(dot * scale);
            for (acc, &v) in self.acc.iter_mut().zip(value) {
                *acc = *acc * decay + weight * from_bits(dtype, v);
            }
        }
    }
}
