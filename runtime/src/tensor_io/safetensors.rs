//! safetensors files: q, k and v as `<prefix>.q`, `<prefix>.k`, `<prefix>.v`
//! in one file, element types F32, F16 and BF16.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use ::safetensors::tensor::TensorView;
use ::safetensors::{Dtype, SafeTensors, View};
use half::{bf16, f16};

use super::check::{check_data_len, rank4};
use super::{io_err, Named, Qkv, Result, Tensor4, TensorIoError};

/// Writes `qkv` as three F32 tensors `<prefix>.q`, `<prefix>.k`, `<prefix>.v`
/// (bare `q`, `k`, `v` when `prefix` is empty). Shapes are not checked
/// against each other, only each tensor's data length against its shape.
pub fn save_qkv_safetensors(path: &Path, prefix: &str, qkv: &Qkv) -> Result<()> {
    let mut views = Vec::with_capacity(3);
    for (role, t) in [("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v)] {
        let name = tensor_name(prefix, role);
        check_data_len(path, &name, t)?;
        views.push((name, F32View(t)));
    }
    // safetensors writes a sibling temp file in `path.parent()`; a bare file
    // name has an empty parent, which it cannot create a file in.
    let target = match path.parent() {
        Some(p) if p.as_os_str().is_empty() => Path::new(".").join(path),
        _ => path.to_path_buf(),
    };
    ::safetensors::serialize_to_file(views, None, &target).map_err(|source| {
        TensorIoError::Safetensors {
            path: path.to_path_buf(),
            source,
        }
    })
}

pub(super) fn tensor_name(prefix: &str, role: &str) -> String {
    if prefix.is_empty() {
        role.to_string()
    } else {
        format!("{prefix}.{role}")
    }
}

/// Reads `<prefix>.q/.k/.v` from the file; with no prefix, the one prefix
/// that has all three.
pub(super) fn load(path: &Path, prefix: Option<&str>) -> Result<[Named; 3]> {
    let bytes = fs::read(path).map_err(io_err("read", path))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|source| TensorIoError::Safetensors {
        path: path.to_path_buf(),
        source,
    })?;
    let names: BTreeSet<String> = st.names().into_iter().map(String::from).collect();
    let found = || names.iter().cloned().collect::<Vec<_>>();

    let prefix = match prefix {
        Some(p) => {
            // Accept `model.layers.` as well as `model.layers`.
            let p = p.strip_suffix('.').unwrap_or(p);
            let missing: Vec<String> = ["q", "k", "v"]
                .iter()
                .map(|r| tensor_name(p, r))
                .filter(|n| !names.contains(n))
                .collect();
            if !missing.is_empty() {
                return Err(TensorIoError::MissingTensors {
                    path: path.to_path_buf(),
                    prefix: p.to_string(),
                    missing,
                    found: found(),
                });
            }
            p.to_string()
        }
        None => {
            let complete = |p: &str| {
                ["q", "k", "v"]
                    .iter()
                    .all(|r| names.contains(&tensor_name(p, r)))
            };
            let mut candidates: Vec<String> = names
                .iter()
                .filter_map(|n| n.strip_suffix(".q"))
                .filter(|p| !p.is_empty() && complete(p))
                .map(String::from)
                .collect();
            if complete("") {
                candidates.push(String::new());
            }
            match candidates.len() {
                1 => candidates.remove(0),
                0 => {
                    return Err(TensorIoError::NoPrefix {
                        path: path.to_path_buf(),
                        found: found(),
                    })
                }
                _ => {
                    return Err(TensorIoError::AmbiguousPrefix {
                        path: path.to_path_buf(),
                        candidates,
                        found: found(),
                    })
                }
            }
        }
    };

    let load = |role: &str| -> Result<Named> {
        let name = tensor_name(&prefix, role);
        let view = st
            .tensor(&name)
            .map_err(|source| TensorIoError::Safetensors {
                path: path.to_path_buf(),
                source,
            })?;
        let t = view_to_tensor(path, &name, &view)?;
        Ok(Named {
            name,
            file: path.to_path_buf(),
            t,
        })
    };
    Ok([load("q")?, load("k")?, load("v")?])
}

fn view_to_tensor(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Tensor4> {
    // The safetensors crate has already checked data length against shape.
    let bytes = view.data();
    let data = match view.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        other => {
            return Err(TensorIoError::UnsupportedDtype {
                path: path.to_path_buf(),
                tensor: name.to_string(),
                dtype: other.to_string(),
                supported: "F32, F16, BF16",
                hint: String::new(),
            })
        }
    };
    let shape = rank4(path, name, view.shape())?;
    Ok(Tensor4 { shape, data })
}

/// Serializes a [`Tensor4`] as F32 without first copying all of it.
struct F32View<'a>(&'a Tensor4);

impl View for F32View<'_> {
    fn dtype(&self) -> Dtype {
        Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let mut out = Vec::with_capacity(self.data_len());
        for x in &self.0.data {
            out.extend_from_slice(&x.to_le_bytes());
        }
        Cow::Owned(out)
    }
    fn data_len(&self) -> usize {
        self.0.data.len() * 4
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use ::safetensors::Dtype;

    use crate::tensor_io::test_support::*;
    use crate::tensor_io::{load_qkv, save_qkv_safetensors, Tensor4};

    #[test]
    fn tensor_io_safetensors_round_trip_f32() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dump.safetensors");
        let qkv = sample();
        save_qkv_safetensors(&path, "model.layers", &qkv).unwrap();
        assert_eq!(load_qkv(&path, Some("model.layers")).unwrap(), qkv);
        assert_eq!(load_qkv(&path, Some("model.layers.")).unwrap(), qkv);
        assert_eq!(load_qkv(&path, None).unwrap(), qkv);

        // The empty prefix means bare q/k/v.
        let bare = dir.path().join("bare.safetensors");
        save_qkv_safetensors(&bare, "", &qkv).unwrap();
        assert_eq!(load_qkv(&bare, None).unwrap(), qkv);
        assert_eq!(load_qkv(&bare, Some("")).unwrap(), qkv);

        // Extension is not required: a non-npy file is read as safetensors.
        let noext = dir.path().join("dump.bin");
        fs::copy(&path, &noext).unwrap();
        assert_eq!(load_qkv(&noext, None).unwrap(), qkv);
    }

    #[test]
    fn tensor_io_safetensors_f16_and_bf16_inputs() {
        let dir = tempfile::tempdir().unwrap();
        let qkv = sample();
        for (dtype, enc) in [
            (Dtype::F16, f16_bytes as fn(&Tensor4) -> Vec<u8>),
            (Dtype::BF16, bf16_bytes),
        ] {
            let path = dir.path().join(format!("{dtype:?}.safetensors"));
            write_st(
                &path,
                &[
                    ("p.q", dtype, qkv.q.shape.to_vec(), enc(&qkv.q)),
                    ("p.k", dtype, qkv.k.shape.to_vec(), enc(&qkv.k)),
                    ("p.v", dtype, qkv.v.shape.to_vec(), enc(&qkv.v)),
                ],
            );
            assert_eq!(load_qkv(&path, None).unwrap(), qkv, "{dtype:?}");
        }
        // Mixed element types in one file are fine too.
        let path = dir.path().join("mixed.safetensors");
        write_st(
            &path,
            &[
                ("p.q", Dtype::BF16, qkv.q.shape.to_vec(), bf16_bytes(&qkv.q)),
                ("p.k", Dtype::F16, qkv.k.shape.to_vec(), f16_bytes(&qkv.k)),
                ("p.v", Dtype::F32, qkv.v.shape.to_vec(), f32_bytes(&qkv.v)),
            ],
        );
        assert_eq!(load_qkv(&path, None).unwrap(), qkv);
    }

    #[test]
    fn tensor_io_safetensors_unsupported_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let qkv = sample();
        let path = dir.path().join("f64.safetensors");
        let f64_bytes: Vec<u8> = qkv
            .k
            .data
            .iter()
            .flat_map(|&x| (x as f64).to_le_bytes())
            .collect();
        write_st(
            &path,
            &[
                f32_entry("p.q", &qkv.q),
                ("p.k", Dtype::F64, qkv.k.shape.to_vec(), f64_bytes),
                f32_entry("p.v", &qkv.v),
            ],
        );
        let msg = err_msg(load_qkv(&path, None));
        assert!(msg.contains("f64.safetensors"), "{msg}");
        assert!(msg.contains("`p.k`"), "{msg}");
        assert!(msg.contains("F64"), "{msg}");
        assert!(msg.contains("F32, F16, BF16"), "{msg}");
    }

    #[test]
    fn tensor_io_prefix_autodetect_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let qkv = sample();

        // One complete prefix among distractors.
        let path = dir.path().join("one.safetensors");
        let mut entries = f32_qkv("model.layers", &qkv);
        entries.extend([
            f32_entry("other.q", &qkv.q),
            f32_entry("other.k", &qkv.k),
            f32_entry("extra", &qkv.v),
        ]);
        write_st(&path, &entries);
        assert_eq!(load_qkv(&path, None).unwrap(), qkv);

        // Explicit prefix lacking a tensor: names the missing one and lists the file's.
        let msg = err_msg(load_qkv(&path, Some("other")));
        assert!(msg.contains("one.safetensors"), "{msg}");
        assert!(msg.contains("missing tensor(s) `other.v`"), "{msg}");
        assert!(
            msg.contains("`model.layers.q`") && msg.contains("`extra`"),
            "{msg}"
        );

        // Two complete prefixes: ambiguous.
        let path = dir.path().join("two.safetensors");
        write_st(&path, &[f32_qkv("a", &qkv), f32_qkv("b", &qkv)].concat());
        let msg = err_msg(load_qkv(&path, None));
        assert!(msg.contains("two.safetensors"), "{msg}");
        assert!(msg.contains("ambiguous prefix: `a`, `b`"), "{msg}");
        assert!(
            msg.contains("tensors in file: `a.k`, `a.q`, `a.v`, `b.k`, `b.q`, `b.v`"),
            "{msg}"
        );
        // An explicit prefix resolves it.
        assert_eq!(load_qkv(&path, Some("b")).unwrap(), qkv);

        // No complete prefix.
        let path = dir.path().join("none.safetensors");
        write_st(&path, &[f32_entry("x.q", &qkv.q), f32_entry("x.k", &qkv.k)]);
        let msg = err_msg(load_qkv(&path, None));
        assert!(msg.contains("none.safetensors"), "{msg}");
        assert!(msg.contains("no prefix P"), "{msg}");
        assert!(msg.contains("`x.k`, `x.q`"), "{msg}");
    }
}
