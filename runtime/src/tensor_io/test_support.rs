//! Builders of sample tensors and of files, good and bad, for the tests.

use std::fs;
use std::path::{Path, PathBuf};

use ::safetensors::tensor::TensorView;
use ::safetensors::Dtype;
use half::{bf16, f16};

use super::{npy, npy_sibling, save_qkv_safetensors, write_npy, Qkv, Result, Tensor4};

pub(super) fn ramp(shape: [usize; 4], seed: f32) -> Tensor4 {
    let n = shape.iter().product();
    // Multiples of 1/8 in a small range: exact in f16 and bf16.
    let data = (0..n)
        .map(|i| seed + ((i * 7 + 3) % 29) as f32 / 8.0 - 1.5)
        .collect();
    Tensor4 { shape, data }
}

/// GQA example: 4 query heads over 2 kv heads, 3 query tokens over 5 kv tokens.
pub(super) fn sample() -> Qkv {
    Qkv {
        q: ramp([2, 4, 3, 8], 0.0),
        k: ramp([2, 2, 5, 8], 1.0),
        v: ramp([2, 2, 5, 8], -1.0),
    }
}

pub(super) fn err_msg<T: std::fmt::Debug>(r: Result<T>) -> String {
    r.expect_err("expected an error").to_string()
}

pub(super) fn f32_bytes(t: &Tensor4) -> Vec<u8> {
    t.data.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(super) fn f16_bytes(t: &Tensor4) -> Vec<u8> {
    t.data
        .iter()
        .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}

pub(super) fn bf16_bytes(t: &Tensor4) -> Vec<u8> {
    t.data
        .iter()
        .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}

/// Writes a safetensors file with the given (name, dtype, shape, bytes).
pub(super) fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            (
                name.to_string(),
                TensorView::new(*dtype, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    let buf = safetensors::serialize(views, None).unwrap();
    fs::write(path, buf).unwrap();
}

pub(super) fn f32_entry(name: &str, t: &Tensor4) -> (&'static str, Dtype, Vec<usize>, Vec<u8>) {
    (
        Box::leak(name.to_string().into_boxed_str()),
        Dtype::F32,
        t.shape.to_vec(),
        f32_bytes(t),
    )
}

/// F32 entries `<prefix>.q`, `<prefix>.k`, `<prefix>.v` for [`write_st`].
pub(super) fn f32_qkv(prefix: &str, qkv: &Qkv) -> Vec<(&'static str, Dtype, Vec<usize>, Vec<u8>)> {
    [("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v)]
        .into_iter()
        .map(|(role, t)| f32_entry(&format!("{prefix}.{role}"), t))
        .collect()
}

/// Writes an npy file with a raw header dict string and payload.
pub(super) fn write_raw_npy(path: &Path, major: u8, dict: &str, payload: &[u8]) {
    let mut header = dict.to_string();
    header.push('\n');
    let mut out = npy::MAGIC.to_vec();
    out.extend([major, 0]);
    if major == 1 {
        out.extend((header.len() as u16).to_le_bytes());
    } else {
        out.extend((header.len() as u32).to_le_bytes());
    }
    out.extend(header.as_bytes());
    out.extend(payload);
    fs::write(path, out).unwrap();
}

pub(super) fn write_npy_triplet(dir: &Path, stem: &str, qkv: &Qkv) -> PathBuf {
    let stem = dir.join(stem);
    write_npy(&npy_sibling(&stem, "q"), &qkv.q).unwrap();
    write_npy(&npy_sibling(&stem, "k"), &qkv.k).unwrap();
    write_npy(&npy_sibling(&stem, "v"), &qkv.v).unwrap();
    stem
}

/// Saves `qkv` under prefix `p` and returns the load error message.
pub(super) fn load_err(qkv: &Qkv, file: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(file);
    save_qkv_safetensors(&path, "p", qkv).unwrap();
    err_msg(super::load_qkv(&path, None))
}
