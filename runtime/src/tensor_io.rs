//! Loading the query/key/value tensors a user dumped from a model
//! (`kvcc eval SPEC --qkv FILE`).
//!
//! Two input formats are accepted:
//!
//! * **safetensors** (`*.safetensors`, or any file that is not an npy file):
//!   three tensors named `<prefix>.q`, `<prefix>.k`, `<prefix>.v` (or bare
//!   `q`, `k`, `v` for the empty prefix). Element types F32, F16 and BF16.
//! * **npy**: three sibling files `<stem>.q.npy`, `<stem>.k.npy`,
//!   `<stem>.v.npy`. The path may name any of the three or the `<stem>`
//!   itself. Element types `<f4`, `<f2`, and `<u2` (bfloat16 bit patterns
//!   saved as raw uint16, since NumPy has no bfloat16).
//!
//! Every tensor is `[layers, heads, tokens, head_dim]`, row-major. After
//! loading, [`load_qkv`] checks that the three tensors fit together (see
//! [`load_qkv`]) and contain only finite values. Nothing here panics on bad
//! input: every problem comes back as a [`TensorIoError`] whose message names
//! the file and, where relevant, the tensor.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::fs;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use npyz::{Endianness, TypeChar, TypeStr};
use py_literal::Value;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensorError, SafeTensors, View};

/// A dense f32 tensor `[layers, heads, tokens, head_dim]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor4 {
    pub shape: [usize; 4],
    pub data: Vec<f32>,
}

impl Tensor4 {
    /// Number of elements the shape calls for (`None` on overflow).
    pub fn numel(&self) -> Option<usize> {
        checked_numel(&self.shape)
    }
}

/// Queries, keys and values of one dump.
///
/// `q` is `[layers, q_heads, q_tokens, head_dim]`; `k` and `v` are
/// `[layers, kv_heads, kv_tokens, head_dim]` with `q_heads` a positive
/// multiple of `kv_heads` (grouped-query attention).
#[derive(Debug, Clone, PartialEq)]
pub struct Qkv {
    pub q: Tensor4,
    pub k: Tensor4,
    pub v: Tensor4,
}

/// Everything that can go wrong reading or writing q/k/v tensors.
#[derive(Debug, thiserror::Error)]
pub enum TensorIoError {
    /// The operating system refused a read or write.
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The safetensors crate rejected the file (malformed header, bad offsets, I/O while saving).
    #[error("{}: safetensors error: {source}", path.display())]
    Safetensors {
        path: PathBuf,
        #[source]
        source: SafeTensorError,
    },

    /// The path names neither a safetensors file nor a set of npy siblings.
    #[error("{}: {reason}", path.display())]
    UnrecognizedInput { path: PathBuf, reason: String },

    /// A prefix was given, but the file lacks some of `<prefix>.q/.k/.v`.
    #[error(
        "{}: prefix `{prefix}`: missing tensor(s) {}; tensors in file: {}",
        path.display(),
        quoted(missing),
        name_list(found)
    )]
    MissingTensors {
        path: PathBuf,
        prefix: String,
        missing: Vec<String>,
        found: Vec<String>,
    },

    /// No prefix was given and no prefix P has all of `P.q`, `P.k`, `P.v`.
    #[error(
        "{}: no prefix P with all three tensors `P.q`, `P.k`, `P.v`; tensors in file: {}",
        path.display(),
        name_list(found)
    )]
    NoPrefix { path: PathBuf, found: Vec<String> },

    /// No prefix was given and several prefixes have all three tensors.
    #[error(
        "{}: ambiguous prefix: {} each have `.q`, `.k` and `.v`; pass the prefix explicitly; tensors in file: {}",
        path.display(),
        quoted(candidates),
        name_list(found)
    )]
    AmbiguousPrefix {
        path: PathBuf,
        candidates: Vec<String>,
        found: Vec<String>,
    },

    /// A tensor prefix was given for an npy input, where it has no meaning.
    #[error(
        "{}: a tensor prefix (`{prefix}`) applies only to safetensors inputs, not to npy files",
        path.display()
    )]
    PrefixNotApplicable { path: PathBuf, prefix: String },

    /// The element type is not one we read.
    #[error(
        "{}: tensor `{tensor}` has unsupported dtype {dtype} (supported: {supported}){hint}",
        path.display()
    )]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
        supported: &'static str,
        hint: String,
    },

    /// The npy magic, version or header dictionary is malformed.
    #[error("{}: tensor `{tensor}`: malformed npy file: {reason}", path.display())]
    NpyHeader {
        path: PathBuf,
        tensor: String,
        reason: String,
    },

    /// The npy file stores its data in Fortran (column-major) order.
    #[error(
        "{}: tensor `{tensor}` is stored with fortran_order True; save a C-contiguous array \
         (e.g. `np.save(f, np.ascontiguousarray(a))`)",
        path.display()
    )]
    FortranOrder { path: PathBuf, tensor: String },

    /// The data section is shorter or longer than the shape and dtype call for.
    #[error(
        "{}: tensor `{tensor}` of shape {shape:?} needs {expected} data bytes but the file has {actual}",
        path.display()
    )]
    DataLength {
        path: PathBuf,
        tensor: String,
        shape: Vec<usize>,
        expected: usize,
        actual: usize,
    },

    /// An in-memory tensor handed to a writer is inconsistent.
    #[error("{}: tensor `{tensor}`: {reason}", path.display())]
    InvalidTensor {
        path: PathBuf,
        tensor: String,
        reason: String,
    },

    /// A tensor is not rank 4.
    #[error(
        "{}: tensor `{tensor}` has rank {} (shape {shape:?}); expected rank 4 [layers, heads, tokens, head_dim]",
        path.display(),
        shape.len()
    )]
    BadRank {
        path: PathBuf,
        tensor: String,
        shape: Vec<usize>,
    },

    /// A tensor has a dimension of size zero.
    #[error(
        "{}: tensor `{tensor}` has a zero-sized dimension (shape {shape:?} = [layers, heads, tokens, head_dim])",
        path.display()
    )]
    ZeroDim {
        path: PathBuf,
        tensor: String,
        shape: [usize; 4],
    },

    /// q, k and v do not fit together.
    #[error("{}: shape mismatch: {reason}", path.display())]
    ShapeMismatch { path: PathBuf, reason: String },

    /// A tensor holds a NaN or an infinity.
    #[error(
        "{}: tensor `{tensor}` has non-finite value {value} at [layer, head, token, channel] = {position:?}",
        path.display()
    )]
    NonFinite {
        path: PathBuf,
        tensor: String,
        value: f32,
        position: [usize; 4],
    },
}

type Result<T, E = TensorIoError> = std::result::Result<T, E>;

/// At most this many tensor names are listed in an error message.
const MAX_LISTED_NAMES: usize = 40;

fn name_list(names: &[String]) -> String {
    if names.is_empty() {
        return "(none)".to_string();
    }
    let mut out = quoted(&names[..names.len().min(MAX_LISTED_NAMES)]);
    if names.len() > MAX_LISTED_NAMES {
        out.push_str(&format!(", ... ({} more)", names.len() - MAX_LISTED_NAMES));
    }
    out
}

fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

fn io_err(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> TensorIoError {
    let path = path.to_path_buf();
    move |source| TensorIoError::Io {
        action,
        path,
        source,
    }
}

// ---------------------------------------------------------------------------
// Public entry points
// ---------------------------------------------------------------------------

/// Loads and validates q, k and v from `path`.
///
/// `path` is a safetensors file (tensors `<prefix>.q`, `<prefix>.k`,
/// `<prefix>.v`; with `prefix` `None` the unique complete prefix is found,
/// and `Some("")` means bare `q`, `k`, `v`), or names a set of npy siblings
/// `<stem>.q.npy`, `<stem>.k.npy`, `<stem>.v.npy` (any of the three, or the
/// stem). A prefix given for npy input is an error.
///
/// Checks: all tensors rank 4 with no zero-sized dimension; k and v of equal
/// shape; q with the same layers and head_dim as k, and a head count that is
/// a positive multiple of k's (tokens may differ); every value finite.
pub fn load_qkv(path: &Path, prefix: Option<&str>) -> Result<Qkv> {
    let (label, [q, k, v]) = match resolve_input(path)? {
        Input::Safetensors(file) => {
            let tensors = load_safetensors(&file, prefix)?;
            (file, tensors)
        }
        Input::Npy(stem) => {
            if let Some(p) = prefix {
                return Err(TensorIoError::PrefixNotApplicable {
                    path: path.to_path_buf(),
                    prefix: p.to_string(),
                });
            }
            let mut label = stem.clone().into_os_string();
            label.push(".{q,k,v}.npy");
            let load = |role: &str| -> Result<Named> {
                let file = npy_sibling(&stem, role);
                let t = read_npy_named(&file, role)?;
                Ok(Named {
                    name: role.to_string(),
                    file,
                    t,
                })
            };
            (PathBuf::from(label), [load("q")?, load("k")?, load("v")?])
        }
    };
    validate(&label, &q, &k, &v)?;
    Ok(Qkv {
        q: q.t,
        k: k.t,
        v: v.t,
    })
}

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
    safetensors::serialize_to_file(views, None, &target).map_err(|source| {
        TensorIoError::Safetensors {
            path: path.to_path_buf(),
            source,
        }
    })
}

/// Reads one rank-4 `.npy` file (`<f4`, `<f2`, or `<u2` holding bfloat16
/// bits) into f32. Values are not checked for finiteness here.
pub fn read_npy(path: &Path) -> Result<Tensor4> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    read_npy_named(path, &name)
}

/// Writes `t` as a little-endian f32 `.npy` file with a version 1.0 header.
pub fn write_npy(path: &Path, t: &Tensor4) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    check_data_len(path, &name, t)?;

    let [a, b, c, d] = t.shape;
    let dict =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({a}, {b}, {c}, {d}), }}");
    // Like NumPy: pad with spaces so magic + version + length + header
    // (ending in '\n') is a multiple of 64 bytes.
    let unpadded = NPY_MAGIC.len() + 2 + 2 + dict.len() + 1;
    let pad = (64 - unpadded % 64) % 64;
    let mut header = dict;
    header.extend(std::iter::repeat_n(' ', pad));
    header.push('\n');
    let header_len = u16::try_from(header.len()).map_err(|_| TensorIoError::InvalidTensor {
        path: path.to_path_buf(),
        tensor: name.clone(),
        reason: "npy header longer than 65535 bytes".to_string(),
    })?;

    let file = fs::File::create(path).map_err(io_err("create", path))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let write_all = |w: &mut BufWriter<fs::File>| -> std::io::Result<()> {
        w.write_all(NPY_MAGIC)?;
        w.write_all(&[1, 0])?;
        w.write_all(&header_len.to_le_bytes())?;
        w.write_all(header.as_bytes())?;
        let mut buf = Vec::with_capacity(4 * 8192);
        for chunk in t.data.chunks(8192) {
            buf.clear();
            for x in chunk {
                buf.extend_from_slice(&x.to_le_bytes());
            }
            w.write_all(&buf)?;
        }
        w.flush()
    };
    write_all(&mut w).map_err(io_err("write", path))
}

// ---------------------------------------------------------------------------
// Input resolution
// ---------------------------------------------------------------------------

enum Input {
    Safetensors(PathBuf),
    /// The stem of `<stem>.q.npy`, `<stem>.k.npy`, `<stem>.v.npy`.
    Npy(PathBuf),
}

const NPY_MAGIC: &[u8; 6] = b"\x93NUMPY";

fn npy_sibling(stem: &Path, role: &str) -> PathBuf {
    let mut s = stem.as_os_str().to_os_string();
    s.push(format!(".{role}.npy"));
    PathBuf::from(s)
}

fn resolve_input(path: &Path) -> Result<Input> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if ext.eq_ignore_ascii_case("safetensors") {
        return Ok(Input::Safetensors(path.to_path_buf()));
    }
    // `<stem>.q.npy`, `<stem>.k.npy`, `<stem>.v.npy`
    for suffix in [".q.npy", ".k.npy", ".v.npy"] {
        if name.len() > suffix.len() && name.ends_with(suffix) {
            // Strip `.npy`, then `.q`: both are plain extensions, so this
            // stays lossless for non-UTF-8 names.
            if let Some(stem_name) = path
                .file_stem()
                .and_then(|s| Path::new(s).file_stem())
                .map(|s| s.to_os_string())
            {
                return Ok(Input::Npy(path.with_file_name(stem_name)));
            }
        }
    }
    // `<stem>` itself.
    if npy_sibling(path, "q").is_file() {
        return Ok(Input::Npy(path.to_path_buf()));
    }
    let siblings_hint = "expected three sibling files <stem>.q.npy, <stem>.k.npy, <stem>.v.npy";
    if ext == "npy" {
        // `<stem>.npy` standing for the stem.
        let stem = path.with_extension("");
        if npy_sibling(&stem, "q").is_file() {
            return Ok(Input::Npy(stem));
        }
        return Err(TensorIoError::UnrecognizedInput {
            path: path.to_path_buf(),
            reason: format!("not one of a set of q/k/v npy files; {siblings_hint}"),
        });
    }
    if path.is_file() {
        let mut magic = [0u8; 6];
        let n = fs::File::open(path)
            .and_then(|mut f| {
                let mut n = 0;
                while n < magic.len() {
                    match f.read(&mut magic[n..])? {
                        0 => break,
                        k => n += k,
                    }
                }
                Ok(n)
            })
            .map_err(io_err("read", path))?;
        if n == magic.len() && &magic == NPY_MAGIC {
            return Err(TensorIoError::UnrecognizedInput {
                path: path.to_path_buf(),
                reason: format!("a single npy file; {siblings_hint}"),
            });
        }
        return Ok(Input::Safetensors(path.to_path_buf()));
    }
    Err(TensorIoError::UnrecognizedInput {
        path: path.to_path_buf(),
        reason: format!(
            "no such file, and no npy siblings {} / .k.npy / .v.npy",
            npy_sibling(path, "q").display()
        ),
    })
}

// ---------------------------------------------------------------------------
// safetensors
// ---------------------------------------------------------------------------

fn tensor_name(prefix: &str, role: &str) -> String {
    if prefix.is_empty() {
        role.to_string()
    } else {
        format!("{prefix}.{role}")
    }
}

/// A tensor read from a file, with the names used in error messages.
struct Named {
    name: String,
    file: PathBuf,
    t: Tensor4,
}

fn load_safetensors(path: &Path, prefix: Option<&str>) -> Result<[Named; 3]> {
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

fn rank4(path: &Path, tensor: &str, shape: &[usize]) -> Result<[usize; 4]> {
    <[usize; 4]>::try_from(shape).map_err(|_| TensorIoError::BadRank {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        shape: shape.to_vec(),
    })
}

fn view_to_tensor(path: &Path, name: &str, view: &TensorView<'_>) -> Result<Tensor4> {
    let elem = match view.dtype() {
        Dtype::F32 => Elem::F32,
        Dtype::F16 => Elem::F16,
        Dtype::BF16 => Elem::Bf16,
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
    // The safetensors crate has already checked data length against shape.
    Ok(Tensor4 {
        shape,
        data: decode(view.data(), elem),
    })
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

fn check_data_len(path: &Path, name: &str, t: &Tensor4) -> Result<()> {
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

// ---------------------------------------------------------------------------
// Element decoding
// ---------------------------------------------------------------------------

#[derive(Clone, Copy)]
enum Elem {
    F32,
    F16,
    /// bfloat16 bit patterns.
    Bf16,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 | Elem::Bf16 => 2,
        }
    }
}

/// Little-endian bytes to f32; `bytes.len()` must be a multiple of the size.
fn decode(bytes: &[u8], elem: Elem) -> Vec<f32> {
    match elem {
        Elem::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Elem::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Elem::Bf16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
    }
}

// ---------------------------------------------------------------------------
// npy
// ---------------------------------------------------------------------------

const NPY_SUPPORTED: &str = "`<f4` float32, `<f2` float16, `<u2` bfloat16 bits saved as raw uint16";

struct NpyHeader {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
    data_offset: usize,
}

fn read_npy_named(path: &Path, tensor: &str) -> Result<Tensor4> {
    let bytes = fs::read(path).map_err(io_err("read", path))?;
    let header = parse_npy_header(&bytes).map_err(|reason| TensorIoError::NpyHeader {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        reason,
    })?;
    if header.fortran_order {
        return Err(TensorIoError::FortranOrder {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
        });
    }
    let elem = npy_elem(&header.descr).map_err(|hint| TensorIoError::UnsupportedDtype {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        dtype: format!("`{}`", header.descr),
        supported: NPY_SUPPORTED,
        hint,
    })?;
    let shape = rank4(path, tensor, &header.shape)?;
    let expected = checked_numel(&shape)
        .and_then(|n| n.checked_mul(elem.size()))
        .ok_or_else(|| TensorIoError::NpyHeader {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
            reason: format!("byte size of shape {shape:?} overflows"),
        })?;
    let data = &bytes[header.data_offset..];
    if data.len() != expected {
        return Err(TensorIoError::DataLength {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
            shape: shape.to_vec(),
            expected,
            actual: data.len(),
        });
    }
    Ok(Tensor4 {
        shape,
        data: decode(data, elem),
    })
}

/// Maps an npy `descr` to an element type, or returns a hint for the error.
fn npy_elem(descr: &str) -> Result<Elem, String> {
    let ty: TypeStr = descr.parse().map_err(|e| format!("; {e}"))?;
    match (ty.endianness(), ty.type_char(), ty.size_field()) {
        (Endianness::Big, ..) => {
            Err("; big-endian data is not supported, convert with `a.astype('<f4')`".into())
        }
        (_, TypeChar::Float, 4) => Ok(Elem::F32),
        (_, TypeChar::Float, 2) => Ok(Elem::F16),
        (_, TypeChar::Uint, 2) => Ok(Elem::Bf16),
        (_, TypeChar::Int, 2) => Err(
            "; for bfloat16 save the raw bits as uint16: `t.view(torch.int16).numpy().view(np.uint16)`"
                .into(),
        ),
        (_, TypeChar::RawData, _) => Err(
            "; NumPy cannot store bfloat16 natively: save the raw bits as uint16 \
             (`t.view(torch.int16).numpy().view(np.uint16)`) or convert to float32"
                .into(),
        ),
        _ => Err("; convert with `a.astype(np.float32)`".into()),
    }
}

fn parse_npy_header(bytes: &[u8]) -> Result<NpyHeader, String> {
    if bytes.len() < 8 || &bytes[..6] != NPY_MAGIC {
        return Err("bad magic (not an npy file)".to_string());
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let (header_len, start) = match major {
        1 => {
            let b = bytes.get(8..10).ok_or("truncated header length")?;
            (usize::from(u16::from_le_bytes([b[0], b[1]])), 10usize)
        }
        2 | 3 => {
            let b = bytes.get(8..12).ok_or("truncated header length")?;
            let n = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            (
                usize::try_from(n).map_err(|_| "header length overflows")?,
                12,
            )
        }
        _ => return Err(format!("unsupported npy format version {major}.{minor}")),
    };
    let end = start
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| {
            format!(
                "header of {header_len} bytes runs past the end of the {}-byte file",
                bytes.len()
            )
        })?;
    let raw = &bytes[start..end];
    let text: String = if major >= 3 {
        std::str::from_utf8(raw)
            .map_err(|e| format!("header is not UTF-8: {e}"))?
            .to_string()
    } else {
        // Versions 1 and 2 use latin-1.
        raw.iter().map(|&b| b as char).collect()
    };

    let value: Value =
        strip_long_suffixes(text.trim())
            .parse()
            .map_err(|e: py_literal::ParseError| {
                format!("cannot parse header {text:?}: {}", one_line(&e.to_string()))
            })?;
    let Value::Dict(entries) = value else {
        return Err(format!("header is not a dict: {}", text.trim()));
    };
    let get = |key: &str| {
        entries
            .iter()
            .find(|(k, _)| k.as_string().is_some_and(|s| s == key))
            .map(|(_, v)| v)
            .ok_or_else(|| format!("header has no '{key}' key: {}", text.trim()))
    };
    let descr = match get("descr")? {
        Value::String(s) => s.clone(),
        other => {
            return Err(format!(
                "'descr' is {other}; structured dtypes are not supported"
            ))
        }
    };
    let fortran_order = match get("fortran_order")? {
        Value::Boolean(b) => *b,
        other => {
            return Err(format!(
                "'fortran_order' is {other}, expected True or False"
            ))
        }
    };
    let shape = match get("shape")? {
        Value::Tuple(items) | Value::List(items) => items
            .iter()
            .map(|d| match d {
                Value::Integer(n) => {
                    usize::try_from(n).map_err(|_| format!("'shape' has invalid dimension {n}"))
                }
                other => Err(format!("'shape' has non-integer entry {other}")),
            })
            .collect::<Result<Vec<_>, _>>()?,
        other => return Err(format!("'shape' is {other}, expected a tuple")),
    };
    Ok(NpyHeader {
        descr,
        fortran_order,
        shape,
        data_offset: end,
    })
}

/// The position and expectation of a multi-line parser message:
/// "--> 1:53 = expected digit".
fn one_line(message: &str) -> String {
    let lines: Vec<&str> = message.lines().map(str::trim).collect();
    let key: Vec<&str> = lines
        .iter()
        .filter_map(|l| match l.find("-->") {
            Some(at) => Some(&l[at..]),
            None => l.starts_with("= ").then_some(*l),
        })
        .collect();
    if key.is_empty() { lines } else { key }.join(" ")
}

/// Drops the `L` of Python 2 long integers (`(3L, 4L)`), as NumPy's
/// `_filter_header` does before `ast.literal_eval`.
fn strip_long_suffixes(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut quote = None;
    let mut prev = ' ';
    for c in text.chars() {
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) => {}
            None if c == '\'' || c == '"' => quote = Some(c),
            None if (c == 'L' || c == 'l') && prev.is_ascii_digit() => {
                prev = c;
                continue;
            }
            None => {}
        }
        out.push(c);
        prev = c;
    }
    out
}

// ---------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------

fn validate(label: &Path, q: &Named, k: &Named, v: &Named) -> Result<()> {
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

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(shape: [usize; 4], seed: f32) -> Tensor4 {
        let n = shape.iter().product();
        // Multiples of 1/8 in a small range: exact in f16 and bf16.
        let data = (0..n)
            .map(|i| seed + ((i * 7 + 3) % 29) as f32 / 8.0 - 1.5)
            .collect();
        Tensor4 { shape, data }
    }

    /// GQA example: 4 query heads over 2 kv heads, 3 query tokens over 5 kv tokens.
    fn sample() -> Qkv {
        Qkv {
            q: ramp([2, 4, 3, 8], 0.0),
            k: ramp([2, 2, 5, 8], 1.0),
            v: ramp([2, 2, 5, 8], -1.0),
        }
    }

    fn err_msg<T: std::fmt::Debug>(r: Result<T>) -> String {
        r.expect_err("expected an error").to_string()
    }

    fn f32_bytes(t: &Tensor4) -> Vec<u8> {
        t.data.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn f16_bytes(t: &Tensor4) -> Vec<u8> {
        t.data
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
            .collect()
    }

    fn bf16_bytes(t: &Tensor4) -> Vec<u8> {
        t.data
            .iter()
            .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
            .collect()
    }

    /// Writes a safetensors file with the given (name, dtype, shape, bytes).
    fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
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

    fn f32_entry(name: &str, t: &Tensor4) -> (&'static str, Dtype, Vec<usize>, Vec<u8>) {
        (
            Box::leak(name.to_string().into_boxed_str()),
            Dtype::F32,
            t.shape.to_vec(),
            f32_bytes(t),
        )
    }

    /// Writes an npy file with a raw header dict string and payload.
    fn write_raw_npy(path: &Path, major: u8, dict: &str, payload: &[u8]) {
        let mut header = dict.to_string();
        header.push('\n');
        let mut out = NPY_MAGIC.to_vec();
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

    fn write_npy_triplet(dir: &Path, stem: &str, qkv: &Qkv) -> PathBuf {
        let stem = dir.join(stem);
        write_npy(&npy_sibling(&stem, "q"), &qkv.q).unwrap();
        write_npy(&npy_sibling(&stem, "k"), &qkv.k).unwrap();
        write_npy(&npy_sibling(&stem, "v"), &qkv.v).unwrap();
        stem
    }

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
        write_st(
            &path,
            &[
                f32_entry("model.layers.q", &qkv.q),
                f32_entry("model.layers.k", &qkv.k),
                f32_entry("model.layers.v", &qkv.v),
                f32_entry("other.q", &qkv.q),
                f32_entry("other.k", &qkv.k),
                f32_entry("extra", &qkv.v),
            ],
        );
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
        write_st(
            &path,
            &[
                f32_entry("a.q", &qkv.q),
                f32_entry("a.k", &qkv.k),
                f32_entry("a.v", &qkv.v),
                f32_entry("b.q", &qkv.q),
                f32_entry("b.k", &qkv.k),
                f32_entry("b.v", &qkv.v),
            ],
        );
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

    #[test]
    fn tensor_io_npy_round_trip_and_sibling_spellings() {
        let dir = tempfile::tempdir().unwrap();
        let qkv = sample();
        let stem = write_npy_triplet(dir.path(), "run.v2", &qkv);

        assert_eq!(read_npy(&npy_sibling(&stem, "k")).unwrap(), qkv.k);
        for spelling in [
            npy_sibling(&stem, "q"),
            npy_sibling(&stem, "k"),
            npy_sibling(&stem, "v"),
            stem.clone(),
            stem.with_extension("v2.npy"), // `<stem>.npy`
        ] {
            assert_eq!(
                load_qkv(&spelling, None).unwrap(),
                qkv,
                "{}",
                spelling.display()
            );
        }

        // Header is NumPy-style: v1.0, 64-byte aligned, '\n'-terminated.
        let bytes = fs::read(npy_sibling(&stem, "q")).unwrap();
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        assert_eq!(bytes[10 + hlen - 1], b'\n');
        let text = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
        assert!(
            text.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4, 3, 8), }"),
            "{text}"
        );

        // A prefix makes no sense for npy input.
        let msg = err_msg(load_qkv(&stem, Some("p")));
        assert!(msg.contains("applies only to safetensors"), "{msg}");

        // Missing sibling: the error names the missing file.
        fs::remove_file(npy_sibling(&stem, "v")).unwrap();
        let msg = err_msg(load_qkv(&stem, None));
        assert!(msg.contains("run.v2.v.npy"), "{msg}");

        // A lone npy file is not a q/k/v set.
        let lone = dir.path().join("lone.npy");
        write_npy(&lone, &qkv.q).unwrap();
        let msg = err_msg(load_qkv(&lone, None));
        assert!(
            msg.contains("lone.npy") && msg.contains("<stem>.q.npy"),
            "{msg}"
        );

        // Nothing at all.
        let msg = err_msg(load_qkv(&dir.path().join("nothing"), None));
        assert!(msg.contains("no such file"), "{msg}");
    }

    #[test]
    fn tensor_io_npy_f16_bf16_versions_and_header_forms() {
        let dir = tempfile::tempdir().unwrap();
        let qkv = sample();
        let stem = dir.path().join("h");
        let shape = |t: &Tensor4| {
            format!(
                "({}, {}, {}, {})",
                t.shape[0], t.shape[1], t.shape[2], t.shape[3]
            )
        };
        // q: f16, version 2, double quotes and no trailing comma.
        write_raw_npy(
            &npy_sibling(&stem, "q"),
            2,
            &format!(
                "{{\"descr\": \"<f2\", \"fortran_order\": False, \"shape\": {}}}",
                shape(&qkv.q)
            ),
            &f16_bytes(&qkv.q),
        );
        // k: bf16 bits as uint16, version 3, Python-2 long suffixes.
        let [a, b, c, d] = qkv.k.shape;
        write_raw_npy(
            &npy_sibling(&stem, "k"),
            3,
            &format!(
                "{{'descr': '<u2', 'fortran_order': False, 'shape': ({a}L, {b}L, {c}L, {d}L), }}  "
            ),
            &bf16_bytes(&qkv.k),
        );
        // v: f32, version 1.
        write_raw_npy(
            &npy_sibling(&stem, "v"),
            1,
            &format!(
                "{{'descr': '<f4', 'fortran_order': False, 'shape': {}, }}",
                shape(&qkv.v)
            ),
            &f32_bytes(&qkv.v),
        );
        assert_eq!(load_qkv(&stem, None).unwrap(), qkv);

        let bad = dir.path().join("bad.npy");
        let check = |dict: &str, payload: &[u8], needles: &[&str]| {
            write_raw_npy(&bad, 1, dict, payload);
            let msg = err_msg(read_npy(&bad));
            assert!(msg.contains("bad.npy"), "{msg}");
            for n in needles {
                assert!(msg.contains(n), "expected {n:?} in {msg}");
            }
        };
        let q32 = f32_bytes(&qkv.q);
        let sq = shape(&qkv.q);
        check(
            &format!("{{'descr': '<f8', 'fortran_order': False, 'shape': {sq}, }}"),
            &q32,
            &["unsupported dtype `<f8`", "`<f4` float32"],
        );
        check(
            &format!("{{'descr': '>f4', 'fortran_order': False, 'shape': {sq}, }}"),
            &q32,
            &["`>f4`", "big-endian"],
        );
        check(
            &format!("{{'descr': '<V2', 'fortran_order': False, 'shape': {sq}, }}"),
            &q32,
            &["`<V2`", "uint16"],
        );
        check(
            &format!("{{'descr': '<f4', 'fortran_order': True, 'shape': {sq}, }}"),
            &q32,
            &["fortran_order True"],
        );
        check(
            &format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {sq}, }}"),
            &q32[..q32.len() - 4],
            &["needs 768 data bytes", "has 764"],
        );
        check(
            "{'descr': '<f4', 'fortran_order': False}",
            &q32,
            &["malformed npy", "no 'shape' key"],
        );
        check(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3",
            &q32,
            &["malformed npy", "cannot parse header"],
        );
        check(
            "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }",
            &[0; 8],
            &["structured dtypes"],
        );
        check(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (6,), }",
            &[0; 24],
            &["rank 1", "expected rank 4"],
        );

        fs::write(&bad, b"\x93NUMPY\x09\x00\x10\x00").unwrap();
        let msg = err_msg(read_npy(&bad));
        assert!(msg.contains("version 9.0"), "{msg}");
        fs::write(&bad, b"PK\x03\x04 not npy").unwrap();
        let msg = err_msg(read_npy(&bad));
        assert!(msg.contains("bad magic"), "{msg}");
    }

    #[test]
    fn tensor_io_npy_header_syntax_errors_say_where() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("cut.npy");
        write_raw_npy(&bad, 1, "{'descr': '<f4', 'shape': (2, 3", &[]);
        let msg = err_msg(read_npy(&bad));
        assert!(
            msg.contains("cut.npy") && msg.contains("`cut.npy`"),
            "{msg}"
        );
        assert!(msg.contains(": --> 1:32 = expected "), "{msg}");
        assert_eq!(msg.lines().count(), 1, "{msg}");
    }

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

    /// Saves `qkv` under prefix `p` and returns the load error message.
    fn load_err(qkv: &Qkv, file: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(file);
        save_qkv_safetensors(&path, "p", qkv).unwrap();
        err_msg(load_qkv(&path, None))
    }

    #[test]
    fn tensor_io_validation_shape_mismatches() {
        // 3 query heads over 2 kv heads.
        let mut qkv = sample();
        qkv.q = ramp([2, 3, 3, 8], 0.0);
        let msg = load_err(&qkv, "gqa.safetensors");
        assert!(msg.contains("gqa.safetensors"), "{msg}");
        assert!(msg.contains("`p.q` has 3 heads"), "{msg}");
        assert!(
            msg.contains("not a positive multiple of the 2 kv heads"),
            "{msg}"
        );

        // Fewer query heads than kv heads.
        let mut qkv = sample();
        qkv.q = ramp([2, 1, 3, 8], 0.0);
        let msg = load_err(&qkv, "gqa1.safetensors");
        assert!(msg.contains("not a positive multiple"), "{msg}");

        // k and v differ.
        let mut qkv = sample();
        qkv.v = ramp([2, 2, 6, 8], 0.0);
        let msg = load_err(&qkv, "kv.safetensors");
        assert!(
            msg.contains("`p.k` has shape [2, 2, 5, 8] but `p.v` has shape [2, 2, 6, 8]"),
            "{msg}"
        );

        // Layers differ.
        let mut qkv = sample();
        qkv.q = ramp([3, 4, 3, 8], 0.0);
        let msg = load_err(&qkv, "layers.safetensors");
        assert!(msg.contains("`p.q` has 3 layers"), "{msg}");

        // head_dim differs.
        let mut qkv = sample();
        qkv.q = ramp([2, 4, 3, 16], 0.0);
        let msg = load_err(&qkv, "dim.safetensors");
        assert!(msg.contains("`p.q` has head_dim 16"), "{msg}");
        assert!(msg.contains("`p.k` has head_dim 8"), "{msg}");

        // Zero-sized dimension.
        let mut qkv = sample();
        qkv.k = ramp([2, 2, 0, 8], 0.0);
        qkv.v = ramp([2, 2, 0, 8], 0.0);
        let msg = load_err(&qkv, "zero.safetensors");
        assert!(msg.contains("zero.safetensors"), "{msg}");
        assert!(
            msg.contains("tensor `p.k` has a zero-sized dimension"),
            "{msg}"
        );
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
