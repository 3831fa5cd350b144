//! Checks on tensors: rank and data length as read or before writing, and
//! whether q, k and v fit together and hold only finite values.

use std::path::Path;

use super::{Named, Result, Tensor4, TensorIoError};

pub(super) fn rank4(path: &Path, tensor: &str, shape: &[usize]) -> Result<[usize; 4]> {
    <[usize; 4]>::try_from(shape).map_err(|_| TensorIoError::BadRank {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        shape: shape.to_vec(),
    })
}

pub(super) fn check_data_len(path: &Path, name: &str, t: &Tensor4) -> Result<()> {
    match t.numel() {
        Some(n) if n == t.data.len() => Ok(()),
        Some(n) => Err(TensorIoError::InvalidTensor {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            reason: format!(
                "shape {:?} has {n} elements but the data has {}",
                t.shape,
                t.data.len()
            ),
        }),
        None => Err(TensorIoError::InvalidTensor {
            path: path.to_path_buf(),
            tensor: name.to_string(),
            reason: format!("element count of shape {:?} overflows", t.shape),
        }),
    }
}

/// No zero-sized dimension, shapes that fit together (see
/// [`super::load_qkv`]), only finite values.
pub(super) fn validate(label: &Path, q: &Named, k: &Named, v: &Named) -> Result<()> {
    for n in [q, k, v] {
        if n.t.shape.contains(&0) {
            return Err(TensorIoError::ZeroDim {
                path: n.file.clone(),
                tensor: n.name.clone(),
                shape: n.t.shape,
            });
        }
    }
    let mismatch = |reason: String| TensorIoError::ShapeMismatch {
        path: label.to_path_buf(),
        reason,
    };
    if k.t.shape != v.t.shape {
        return Err(mismatch(format!(
            "`{}` has shape {:?} but `{}` has shape {:?}; k and v must have the same shape",
            k.name, k.t.shape, v.name, v.t.shape
        )));
    }
    let [q_layers, q_heads, _, q_dim] = q.t.shape;
    let [kv_layers, kv_heads, _, kv_dim] = k.t.shape;
    if q_layers != kv_layers {
        return Err(mismatch(format!(
            "`{}` has {q_layers} layers (shape {:?}) but `{}` has {kv_layers} (shape {:?})",
            q.name, q.t.shape, k.name, k.t.shape
        )));
    }
    if q_dim != kv_dim {
        return Err(mismatch(format!(
            "`{}` has head_dim {q_dim} (shape {:?}) but `{}` has head_dim {kv_dim} (shape {:?})",
            q.name, q.t.shape, k.name, k.t.shape
        )));
    }
    if !q_heads.is_multiple_of(kv_heads) {
        return Err(mismatch(format!(
            "`{}` has {q_heads} heads (shape {:?}), not a positive multiple of the {kv_heads} kv heads of `{}` (shape {:?})",
            q.name, q.t.shape, k.name, k.t.shape
        )));
    }
    for n in [q, k, v] {
        check_finite(n)?;
    }
    Ok(())
}

fn check_finite(n: &Named) -> Result<()> {
    let Some((i, &value)) = n.t.data.iter().enumerate().find(|(_, x)| !x.is_finite()) else {
        return Ok(());
    };
    let [_, heads, tokens, dim] = n.t.shape;
    let position = [
        i / (heads * tokens * dim),
        i / (tokens * dim) % heads,
        i / dim % tokens,
        i % dim,
    ];
    Err(TensorIoError::NonFinite {
        path: n.file.clone(),
        tensor: n.name.clone(),
        value,
        position,
    })
}

#[cfg(test)]
mod tests {
    use ::safetensors::Dtype;
    use half::f16;

    use crate::tensor_io::test_support::*;
    use crate::tensor_io::{load_qkv, npy_sibling, save_qkv_safetensors, write_npy, Qkv};

    #[test]
    fn tensor_io_validation_bad_rank() {
        let dir = tempfile::tempdir().unwrap();
        let qkv = sample();
        let path = dir.path().join("rank.safetensors");
        write_st(
            &path,
            &[
                f32_entry("p.q", &qkv.q),
                ("p.k", Dtype::F32, vec![2, 2, 40], f32_bytes(&qkv.k)),
                f32_entry("p.v", &qkv.v),
            ],
        );
        let msg = err_msg(load_qkv(&path, None));
        assert!(msg.contains("rank.safetensors"), "{msg}");
        assert!(
            msg.contains("tensor `p.k` has rank 3 (shape [2, 2, 40])"),
            "{msg}"
        );
    }

    #[test]
    fn tensor_io_validation_shape_mismatches() {
        type Edit = fn(&mut Qkv);
        let cases: [(&str, Edit, &[&str]); 6] = [
            (
                "gqa",
                |qkv| qkv.q = ramp([2, 3, 3, 8], 0.0),
                &[
                    "`p.q` has 3 heads",
                    "not a positive multiple of the 2 kv heads",
                ],
            ),
            (
                "gqa1",
                |qkv| qkv.q = ramp([2, 1, 3, 8], 0.0),
                &["not a positive multiple"],
            ),
            (
                "kv",
                |qkv| qkv.v = ramp([2, 2, 6, 8], 0.0),
                &["`p.k` has shape [2, 2, 5, 8] but `p.v` has shape [2, 2, 6, 8]"],
            ),
            (
                "layers",
                |qkv| qkv.q = ramp([3, 4, 3, 8], 0.0),
                &["`p.q` has 3 layers"],
            ),
            (
                "dim",
                |qkv| qkv.q = ramp([2, 4, 3, 16], 0.0),
                &["`p.q` has head_dim 16", "`p.k` has head_dim 8"],
            ),
            (
                "zero",
                |qkv| {
                    qkv.k = ramp([2, 2, 0, 8], 0.0);
                    qkv.v = ramp([2, 2, 0, 8], 0.0);
                },
                &["tensor `p.k` has a zero-sized dimension"],
            ),
        ];
        for (name, edit, expected) in cases {
            let mut qkv = sample();
            edit(&mut qkv);
            let file = format!("{name}.safetensors");
            let msg = load_err(&qkv, &file);
            assert!(msg.contains(&file), "{msg}");
            for part in expected {
                assert!(msg.contains(part), "{name}: {msg}");
            }
        }
    }

    #[test]
    fn tensor_io_validation_non_finite() {
        // NaN in k at [1, 0, 2, 3].
        let mut qkv = sample();
        let [_, h, t, d] = qkv.k.shape;
        qkv.k.data[(h * t + 2) * d + 3] = f32::NAN;
        let msg = load_err(&qkv, "nan.safetensors");
        assert!(msg.contains("nan.safetensors"), "{msg}");
        assert!(msg.contains("tensor `p.k`"), "{msg}");
        assert!(msg.contains("NaN"), "{msg}");
        assert!(
            msg.contains("[layer, head, token, channel] = [1, 0, 2, 3]"),
            "{msg}"
        );

        // -Inf in v at [0, 1, 4, 7]: the last channel of the last token of head 1.
        let mut qkv = sample();
        let [_, _, t, d] = qkv.v.shape;
        qkv.v.data[(t + 4) * d + 7] = f32::NEG_INFINITY;
        let msg = load_err(&qkv, "inf.safetensors");
        assert!(msg.contains("tensor `p.v`"), "{msg}");
        assert!(msg.contains("-inf"), "{msg}");
        assert!(msg.contains("= [0, 1, 4, 7]"), "{msg}");

        // +Inf from an f16 overflow in q (npy input): the error names the q file.
        let dir = tempfile::tempdir().unwrap();
        let qkv = sample();
        let stem = write_npy_triplet(dir.path(), "d", &qkv);
        let mut bytes = f16_bytes(&qkv.q);
        let last = bytes.len() - 2;
        bytes[last..].copy_from_slice(&f16::INFINITY.to_bits().to_le_bytes());
        let shape = qkv.q.shape;
        write_raw_npy(
            &npy_sibling(&stem, "q"),
            1,
            &format!(
                "{{'descr': '<f2', 'fortran_order': False, 'shape': ({}, {}, {}, {}), }}",
                shape[0], shape[1], shape[2], shape[3]
            ),
            &bytes,
        );
        let msg = err_msg(load_qkv(&stem, None));
        assert!(msg.contains("d.q.npy"), "{msg}");
        assert!(msg.contains("tensor `q`"), "{msg}");
        assert!(
            msg.contains("inf at [layer, head, token, channel] = [1, 3, 2, 7]"),
            "{msg}"
        );
    }

    #[test]
    fn tensor_io_writers_reject_inconsistent_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let mut qkv = sample();
        qkv.v.data.pop();
        let msg = err_msg(save_qkv_safetensors(
            &dir.path().join("x.safetensors"),
            "p",
            &qkv,
        ));
        assert!(
            msg.contains("x.safetensors") && msg.contains("`p.v`"),
            "{msg}"
        );
        assert!(msg.contains("160 elements but the data has 159"), "{msg}");
        let msg = err_msg(write_npy(&dir.path().join("v.npy"), &qkv.v));
        assert!(msg.contains("v.npy") && msg.contains("has 159"), "{msg}");
    }
}
