//! `.npy` files through npyz: one rank-4 tensor per file, read as `<f4`,
//! `<f2`, or `<u2` holding bfloat16 bits (NumPy has no bfloat16), written as
//! `<f4`.

use std::fs;
use std::io::BufWriter;
use std::path::Path;

use half::{bf16, f16};
use npyz::{DType, Endianness, NpyFile, NpyHeader, Order, TypeChar, TypeStr, WriterBuilder};

use super::check::{check_data_len, rank4};
use super::{checked_numel, file_label, io_err, Result, Tensor4, TensorIoError};

pub(super) const MAGIC: &[u8; 6] = b"\x93NUMPY";

const SUPPORTED: &str = "`<f4` float32, `<f2` float16, `<u2` bfloat16 bits saved as raw uint16";

/// Reads one rank-4 `.npy` file (`<f4`, `<f2`, or `<u2` holding bfloat16
/// bits) into f32. Values are not checked for finiteness here.
pub fn read_npy(path: &Path) -> Result<Tensor4> {
    read_named(path, &file_label(path))
}

/// Writes `t` as a little-endian f32 `.npy` file, its header padded the way
/// NumPy pads it (version 1.0 unless the header outgrows it).
pub fn write_npy(path: &Path, t: &Tensor4) -> Result<()> {
    check_data_len(path, &file_label(path), t)?;
    let f32_le: TypeStr = "<f4".parse().expect("`<f4` is a valid type string");
    let shape = t.shape.map(|d| d as u64);
    let file = fs::File::create(path).map_err(io_err("create", path))?;
    let write = || -> std::io::Result<()> {
        let mut w = npyz::WriteOptions::<f32>::new()
            .dtype(DType::Plain(f32_le))
            .shape(&shape)
            .writer(BufWriter::with_capacity(1 << 20, file))
            .begin_nd()?;
        w.extend(t.data.iter().copied())?;
        w.finish()
    };
    write().map_err(io_err("write", path))
}

/// The element types read, each as npyz decodes it.
#[derive(Clone, Copy)]
enum Elem {
    F32,
    F16,
    Bf16Bits,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 | Elem::Bf16Bits => 2,
        }
    }
}

/// [`read_npy`], naming the tensor `tensor` in errors.
pub(super) fn read_named(path: &Path, tensor: &str) -> Result<Tensor4> {
    let bytes = fs::read(path).map_err(io_err("read", path))?;
    let malformed = |reason: String| TensorIoError::NpyHeader {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        reason,
    };
    let (header, data) = parse_header(&bytes).map_err(|e| malformed(one_line(&e.to_string())))?;
    if header.order() == Order::Fortran {
        return Err(TensorIoError::FortranOrder {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
        });
    }
    let dtype = header.dtype();
    let elem = npy_elem(&dtype).map_err(|hint| TensorIoError::UnsupportedDtype {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        dtype: match &dtype {
            DType::Plain(ty) => format!("`{ty}`"),
            other => other.descr(),
        },
        supported: SUPPORTED,
        hint,
    })?;
    let shape: Vec<usize> = header
        .shape()
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| malformed(format!("shape {:?} overflows usize", header.shape())))?;
    let shape = rank4(path, tensor, &shape)?;
    let expected = checked_numel(&shape)
        .and_then(|n| n.checked_mul(elem.size()))
        .ok_or_else(|| malformed(format!("byte size of shape {shape:?} overflows")))?;
    if data.len() != expected {
        return Err(TensorIoError::DataLength {
            path: path.to_path_buf(),
            tensor: tensor.to_string(),
            shape: shape.to_vec(),
            expected,
            actual: data.len(),
        });
    }
    let file = NpyFile::with_header(header, data);
    let data = match elem {
        Elem::F32 => file.into_vec::<f32>(),
        Elem::F16 => file
            .into_vec::<f16>()
            .map(|v| v.into_iter().map(f16::to_f32).collect()),
        Elem::Bf16Bits => file
            .into_vec::<u16>()
            .map(|v| v.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect()),
    }
    .map_err(|e| malformed(e.to_string()))?;
    Ok(Tensor4 { shape, data })
}

/// The parsed header and the data bytes after it.
fn parse_header(bytes: &[u8]) -> std::io::Result<(NpyHeader, &[u8])> {
    if let Some((header, data)) = without_long_suffixes(bytes) {
        return Ok((NpyHeader::from_reader(&header[..])?, data));
    }
    let mut data = bytes;
    let header = NpyHeader::from_reader(&mut data)?;
    Ok((header, data))
}

/// Maps an npy dtype to an element type, or returns a hint for the error.
fn npy_elem(dtype: &DType) -> Result<Elem, String> {
    let DType::Plain(ty) = dtype else {
        return Err("; structured dtypes are not supported".into());
    };
    match (ty.endianness(), ty.type_char(), ty.size_field()) {
        (Endianness::Big, ..) => {
            Err("; big-endian data is not supported, convert with `a.astype('<f4')`".into())
        }
        (_, TypeChar::Float, 4) => Ok(Elem::F32),
        (_, TypeChar::Float, 2) => Ok(Elem::F16),
        (_, TypeChar::Uint, 2) => Ok(Elem::Bf16Bits),
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

/// NumPy under Python 2 could write shapes as `(3L, 4L)`, which npyz's parser
/// rejects. For such a file, the magic, version, length and header with the
/// suffixes dropped, and the data after the original header.
fn without_long_suffixes(bytes: &[u8]) -> Option<(Vec<u8>, &[u8])> {
    let len_size = match bytes.get(6..8)? {
        [1, 0] => 2,
        [2 | 3, 0] => 4,
        _ => return None,
    };
    let start = 8 + len_size;
    let len = bytes
        .get(8..start)?
        .iter()
        .rev()
        .fold(0usize, |n, &b| (n << 8) | usize::from(b));
    let end = start.checked_add(len)?;
    let text = std::str::from_utf8(bytes.get(start..end)?).ok()?;
    let fixed = strip_long_suffixes(text);
    if fixed.len() == text.len() {
        return None;
    }
    let mut header = bytes[..8].to_vec();
    header.extend_from_slice(&u32::try_from(fixed.len()).ok()?.to_le_bytes()[..len_size]);
    header.extend_from_slice(fixed.as_bytes());
    Some((header, &bytes[end..]))
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

/// A parser's multi-line message cut to its first line and its expectation:
/// "could not parse Python expression: --> 1:53 = expected digit".
fn one_line(message: &str) -> String {
    let mut lines = message.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or_default();
    std::iter::once(first)
        .chain(lines.filter(|l| l.starts_with("= ")))
        .flat_map(str::split_whitespace)
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use std::fs;

    use crate::tensor_io::test_support::*;
    use crate::tensor_io::{load_qkv, npy_sibling, read_npy, write_npy, Tensor4};

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
            text.starts_with("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 4, 3, 8, ), }"),
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
            &["malformed npy", "missing key 'shape'"],
        );
        check(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3",
            &q32,
            &["malformed npy", "could not parse Python expression"],
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
        assert!(msg.contains("unsupported version: (9, 0)"), "{msg}");
        fs::write(&bad, b"PK\x03\x04 not npy").unwrap();
        let msg = err_msg(read_npy(&bad));
        assert!(msg.contains("magic not found"), "{msg}");
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
}
