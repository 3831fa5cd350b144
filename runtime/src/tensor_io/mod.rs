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

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use ::safetensors::SafeTensorError;

mod check;
mod npy;
mod safetensors;
#[cfg(test)]
mod test_support;

pub use self::npy::{read_npy, write_npy};
pub use self::safetensors::save_qkv_safetensors;

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
            let tensors = self::safetensors::load(&file, prefix)?;
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
                let t = npy::read_named(&file, role)?;
                Ok(Named {
                    name: role.to_string(),
                    file,
                    t,
                })
            };
            (PathBuf::from(label), [load("q")?, load("k")?, load("v")?])
        }
    };
    check::validate(&label, &q, &k, &v)?;
    Ok(Qkv {
        q: q.t,
        k: k.t,
        v: v.t,
    })
}

/// A tensor read from a file, with the names used in error messages.
struct Named {
    name: String,
    file: PathBuf,
    t: Tensor4,
}

/// The file name, for error messages about one file.
fn file_label(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

enum Input {
    Safetensors(PathBuf),
    /// The stem of `<stem>.q.npy`, `<stem>.k.npy`, `<stem>.v.npy`.
    Npy(PathBuf),
}

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
        if n == magic.len() && &magic == npy::MAGIC {
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
