//! TOML spec files -> [`FormatSpec`], with every error at a line:column and a
//! document path.
//!
//! Three passes: the TOML syntax (`DeTable::parse`), the shape of the data
//! (`toml::from_str::<FormatSpec>`: unknown keys, wrong types, missing keys, bad
//! enum values) and the semantic rules of [`check_spec`]. Positions come from the
//! spanned `DeTable` of the document.

use std::ops::Range;
use std::path::Path;

use ::toml::de::{DeTable, DeValue, ValueDeserializer};
use ::toml::Spanned;
use serde::Deserialize;

use super::check::check_spec;
use super::diagnostic::{Diagnostic, SpecError};
use super::problem::{render_path, PathSegment};
use crate::spec::{FieldSpec, FormatSpec};

/// Reads and parses a spec file; the file name in diagnostics is `path` as given.
pub fn load_spec(path: &Path) -> Result<FormatSpec, SpecError> {
    let file = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| SpecError::Io {
        file: file.clone(),
        source,
    })?;
    let source =
        String::from_utf8(bytes).map_err(|e| not_utf8(&file, e.as_bytes(), e.utf8_error()))?;
    parse_spec(&source, &file)
}

/// Points at the first byte that breaks UTF-8: its line, its column (in the
/// characters before it) and its byte offset.
fn not_utf8(file: &str, bytes: &[u8], error: std::str::Utf8Error) -> SpecError {
    let offset = error.valid_up_to();
    let valid = std::str::from_utf8(&bytes[..offset]).unwrap_or_default();
    let (line, column) = LineIndex { source: valid }.position(offset);
    SpecError::Invalid(vec![Diagnostic {
        file: file.to_string(),
        line,
        column,
        path: String::new(),
        message: format!(
            "the spec is not UTF-8: byte 0x{:02x} at byte offset {offset}; TOML files are UTF-8",
            bytes[offset]
        ),
    }])
}

/// Parses and checks a spec. `file` names the source in diagnostics. On error,
/// returns a syntax or shape error (the first one), or every semantic problem in
/// document order.
pub fn parse_spec(source: &str, file: &str) -> Result<FormatSpec, SpecError> {
    let lines = LineIndex { source };
    let at = |offset: usize, path: String, message: String| {
        let (line, column) = lines.position(offset);
        Diagnostic {
            file: file.to_string(),
            line,
            column,
            path,
            message,
        }
    };

    let document = match DeTable::parse(source) {
        Ok(document) => document,
        Err(err) => {
            let offset = err.span().map_or(0, |span| span.start);
            let message = format!("TOML syntax error: {}", first_line(err.message()));
            return Err(SpecError::Invalid(vec![at(offset, String::new(), message)]));
        }
    };
    let root = {
        let span = document.span();
        Spanned::new(span, DeValue::Table(document.into_inner()))
    };

    let spec = match ::toml::from_str::<FormatSpec>(source) {
        Ok(spec) => spec,
        Err(err) => {
            let located = locate_shape_error(&root, err.span(), err.message());
            let path = render(&located.path);
            return Err(SpecError::Invalid(vec![at(
                located.offset,
                path,
                located.message,
            )]));
        }
    };

    let mut located: Vec<(usize, usize, Diagnostic)> = check_spec(&spec)
        .into_iter()
        .map(|problem| {
            let offset = locate_path(&root, &problem.path);
            (offset, problem.path_string(), problem.message)
        })
        .chain(unit_transform_extra_keys(&root))
        .enumerate()
        .map(|(order, (offset, path, message))| (offset, order, at(offset, path, message)))
        .collect();
    if located.is_empty() {
        return Ok(spec);
    }
    located.sort_by_key(|&(offset, order, _)| (offset, order));
    Err(SpecError::Invalid(
        located.into_iter().map(|(_, _, d)| d).collect(),
    ))
}

/// Byte offsets -> 1-based line and column (in characters).
struct LineIndex<'a> {
    source: &'a str,
}

impl LineIndex<'_> {
    fn position(&self, offset: usize) -> (usize, usize) {
        let mut offset = offset.min(self.source.len());
        while !self.source.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &self.source[..offset];
        let line = before.matches('\n').count() + 1;
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        let column = before[line_start..].chars().count() + 1;
        (line, column)
    }
}

/// The first non-empty line of a message (toml messages may carry an excerpt).
fn first_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .unwrap_or("invalid spec")
        .to_string()
}

/// A path segment with an owned key (shape errors may name keys the spec lacks).
type Seg = PathSegment<String>;

fn render(path: &[Seg]) -> String {
    render_path(&path.iter().map(Seg::as_deref).collect::<Vec<_>>())
}

/// A value of the document with its path and, for table entries, its key's span.
#[derive(Clone)]
struct Node<'a, 'i> {
    path: Vec<Seg>,
    key_span: Option<Range<usize>>,
    value: &'a Spanned<DeValue<'i>>,
}

impl<'a, 'i> Node<'a, 'i> {
    /// Children in document order (tables are stored sorted by key).
    fn children(&self) -> Vec<Node<'a, 'i>> {
        let mut out = Vec::new();
        match self.value.get_ref() {
            DeValue::Table(table) => {
                for (key, value) in table.iter() {
                    let mut path = self.path.clone();
                    path.push(Seg::Key(key.get_ref().to_string()));
                    out.push(Node {
                        path,
                        key_span: Some(key.span()),
                        value,
                    });
                }
                out.sort_by_key(|n| n.key_span.clone().map_or(0, |s| s.start));
            }
            DeValue::Array(array) => {
                for (index, value) in array.iter().enumerate() {
                    let mut path = self.path.clone();
                    path.push(Seg::Index(index));
                    out.push(Node {
                        path,
                        key_span: None,
                        value,
                    });
                }
            }
            _ => {}
        }
        out
    }

    fn child_key(&self, key: &str) -> Option<Node<'a, 'i>> {
        self.children()
            .into_iter()
            .find(|n| n.path.last() == Some(&Seg::Key(key.to_string())))
    }
}

fn contains(outer: &Range<usize>, inner: &Range<usize>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end
}

/// The deepest node whose key or value span contains `span` (ties: the smaller
/// value span). Every node is visited: the span of an `[[array.of.tables]]`
/// element is its header, which does not contain its entries.
fn deepest<'a, 'i>(root: &Node<'a, 'i>, span: &Range<usize>) -> Node<'a, 'i> {
    fn visit<'a, 'i>(node: &Node<'a, 'i>, span: &Range<usize>, best: &mut Node<'a, 'i>) {
        for child in node.children() {
            let hit = contains(&child.value.span(), span)
                || child.key_span.as_ref().is_some_and(|k| contains(k, span));
            if hit {
                let better = child.path.len() > best.path.len()
                    || (child.path.len() == best.path.len()
                        && child.value.span().len() < best.value.span().len());
                if better {
                    *best = child.clone();
                }
            }
            visit(&child, span, best);
        }
    }
    let mut best = root.clone();
    visit(root, span, &mut best);
    best
}

struct Located {
    path: Vec<Seg>,
    offset: usize,
    message: String,
}

/// Where a deserialization error is and what it says, readably.
///
/// Errors inside a `kind`-tagged table (fields, transforms) lose their own span:
/// serde buffers such tables, so toml reports the enclosing array or table. The
/// failing `field` element is found again by deserializing the elements one by one,
/// and the offending key inside a table by the key or value the message names.
fn locate_shape_error(
    root: &Spanned<DeValue<'_>>,
    span: Option<Range<usize>>,
    raw_message: &str,
) -> Located {
    let raw = first_line(raw_message);
    let root = Node {
        path: Vec::new(),
        key_span: None,
        value: root,
    };
    let span = span.unwrap_or(0..0);
    let mut node = deepest(&root, &span);
    let mut offset = span.start;

    // A `field` array or one of its elements: find the element that fails.
    let array = match node.path.as_slice() {
        [.., Seg::Key(k)] if k == "field" && matches!(node.value.get_ref(), DeValue::Array(_)) => {
            Some(node.clone())
        }
        [.., Seg::Key(k), Seg::Index(_)] if k == "field" => {
            let parent = node.path[..node.path.len() - 1].to_vec();
            find_path(&root, &parent)
        }
        _ => None,
    };
    if let Some(array) = array {
        let failing = array.children().into_iter().find(|element| {
            FieldSpec::deserialize(ValueDeserializer::from(element.value.clone())).is_err()
        });
        if let Some(element) = failing {
            offset = element.value.span().start;
            node = element;
        }
    }

    // Inside a table whose error span lost precision: the key or value named.
    if matches!(node.value.get_ref(), DeValue::Table(_)) {
        if let Some(name) = quoted_after(&raw, "unknown field `") {
            if let Some(child) = node.child_key(&name) {
                offset = child.key_span.clone().map_or(offset, |s| s.start);
                node = child;
            }
        } else if let Some(variant) = quoted_after(&raw, "unknown variant `") {
            let hit = node
                .children()
                .into_iter()
                .find(|c| matches!(c.value.get_ref(), DeValue::String(s) if s.as_ref() == variant));
            if let Some(child) = hit {
                offset = child.value.span().start;
                node = child;
            }
        } else if let Some(unexpected) = unexpected_of(&raw) {
            let hit = node
                .children()
                .into_iter()
                .find(|c| describe(c.value.get_ref()).as_deref() == Some(unexpected.as_str()));
            if let Some(child) = hit {
                offset = child.value.span().start;
                node = child;
            }
        }
    }

    let message = humanize(&raw, &node);
    Located {
        path: node.path,
        offset,
        message,
    }
}

fn find_path<'a, 'i>(root: &Node<'a, 'i>, path: &[Seg]) -> Option<Node<'a, 'i>> {
    let mut node = root.clone();
    for segment in path {
        node = node
            .children()
            .into_iter()
            .find(|c| c.path.last() == Some(segment))?;
    }
    Some(node)
}

/// The text between `prefix` and the next backtick: "unknown field `x`" -> "x".
fn quoted_after(message: &str, prefix: &str) -> Option<String> {
    let rest = message.strip_prefix(prefix)?;
    rest.find('`').map(|end| rest[..end].to_string())
}

/// The unexpected value of `"invalid type: <unexpected>, expected ..."` (or
/// `"invalid value: ..."`).
fn unexpected_of(message: &str) -> Option<String> {
    let rest = message
        .strip_prefix("invalid type: ")
        .or_else(|| message.strip_prefix("invalid value: "))?;
    let end = rest.find(", expected")?;
    Some(rest[..end].to_string())
}

/// How serde's `Unexpected` would describe a value, to match it against a message.
fn describe(value: &DeValue<'_>) -> Option<String> {
    Some(match value {
        DeValue::String(s) => format!("string {:?}", s.as_ref()),
        DeValue::Integer(i) => {
            let digits: String = i.as_str().chars().filter(|&c| c != '_').collect();
            let digits = digits
                .trim_start_matches('+')
                .trim_start_matches("0x")
                .trim_start_matches("0o")
                .trim_start_matches("0b");
            let n = i128::from_str_radix(digits, i.radix()).ok()?;
            format!("integer `{n}`")
        }
        DeValue::Float(f) => {
            let x: f64 = f.as_str().replace('_', "").parse().ok()?;
            let mut text = x.to_string();
            if x.is_finite() && !text.contains('.') && !text.contains('e') {
                text.push_str(".0");
            }
            format!("floating point `{text}`")
        }
        DeValue::Boolean(b) => format!("boolean `{b}`"),
        DeValue::Array(_) => "sequence".to_string(),
        DeValue::Table(_) => "map".to_string(),
        DeValue::Datetime(_) => return None,
    })
}

/// Serde's words -> spec words, plus what to add for a missing key.
fn humanize(message: &str, node: &Node<'_, '_>) -> String {
    let mut text = message
        .replace("unknown field `", "unknown key `")
        .replace("unknown variant `", "unknown value `")
        .replace(
            ", there are no fields",
            "; this table takes no keys besides `kind`",
        )
        .replace("expected u32", "expected a non-negative 32-bit integer")
        .replace("expected u64", "expected a non-negative 64-bit integer")
        .replace(
            "expected internally tagged enum FieldSpec",
            "expected a field table such as { kind = \"dense\", dtype = \"f16\" }",
        )
        .replace(
            "expected internally tagged enum TransformSpec",
            "expected a transform table such as { kind = \"hadamard\" }",
        )
        .replace("expected a sequence", "expected an array");
    if let Some(start) = text.find("expected struct ") {
        let rest = &text[start + "expected struct ".len()..];
        let end = rest
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(rest.len());
        text.replace_range(
            start..start + "expected struct ".len() + end,
            "expected a table",
        );
    }
    if let Some(key) = quoted_after(message, "missing field `") {
        text = text.replace("missing field `", "missing key `");
        if let Some(hint) = missing_key_hint(&key, node) {
            text.push_str("; add ");
            text.push_str(&hint);
        }
    }
    text
}

/// What to write for a required key that is missing from `node`'s table.
fn missing_key_hint(key: &str, node: &Node<'_, '_>) -> Option<String> {
    let in_transform = node
        .path
        .iter()
        .any(|s| matches!(s, Seg::Key(k) if k == "transform"));
    let kind = node
        .child_key("kind")
        .and_then(|c| match c.value.get_ref() {
            DeValue::String(s) => Some(s.to_string()),
            _ => None,
        });
    Some(match (key, kind.as_deref()) {
        ("name", _) => "name = \"...\" (letters, digits, '_' and '-')".into(),
        ("head_dim", _) => "head_dim = <a multiple of 8 in 8..=1024>, e.g. 128".into(),
        ("tier", _) => "at least one [[tier]] table with name, key and value".into(),
        ("key" | "value", _) => {
            format!("the {key} codec, e.g. {key}.field = [{{ kind = \"dense\", dtype = \"f16\" }}]")
        }
        ("field", _) => {
            "field = [...] listing the stored fields, e.g. [{ kind = \"dense\", dtype = \"f16\" }]"
                .into()
        }
        ("kind", _) if in_transform => {
            "kind = \"identity\", \"hadamard\", \"srht\" or \"pca\"".into()
        }
        ("kind", _) => "kind = \"radius\", \"codebook\", \"coeff\", \"bitmap\" or \"dense\"".into(),
        ("group_size", Some("bitmap")) => "group_size = 1, 2 or 4".into(),
        ("group_size", _) => "group_size = <a divisor of the codec's dimensions>".into(),
        ("bits", Some("radius")) => "bits = <1..=16>, e.g. 8".into(),
        ("bits", Some("codebook")) => "bits = <1..=12>, e.g. 8".into(),
        ("bits", Some("coeff")) => "bits = 2, 3, 4 or 8".into(),
        ("codewords", _) => {
            "codewords = \"direction\" (unit vectors, with a radius) or \"vector\"".into()
        }
        ("scale", Some("dense")) => "scale = \"tensor\", \"head\", \"page\" or \"item\"".into(),
        ("scale", Some("radius")) => "scale = \"page\" or \"page_group\"".into(),
        ("scale", _) => {
            "scale = \"item\", \"group\", \"page\", \"page_component\" or \"component\"".into()
        }
        ("group", _) => "group = <channels per scale, a divisor of the dimensions>".into(),
        ("zero_point", _) => "zero_point = true (unsigned codes with a zero point) or false".into(),
        ("keep", _) => "keep = <how many groups each item keeps>".into(),
        ("elem", _) => "elem = \"f16\", \"int8\", \"fp8e4m3\" or \"fp8e5m2\"".into(),
        ("dtype", _) => "dtype = \"f16\", \"bf16\", \"f32\", \"fp8e4m3\" or \"fp8e5m2\"".into(),
        ("seed", _) => "seed = <an integer that seeds the random signs>".into(),
        ("rank", _) => "rank = <1..=head_dim>".into(),
        _ => return None,
    })
}

/// Keys besides `kind` in an `identity` or `hadamard` transform table. Serde
/// accepts them silently (unit variants of a tagged enum ignore other keys), so
/// they are found here: `(offset, path, message)`.
fn unit_transform_extra_keys(root: &Spanned<DeValue<'_>>) -> Vec<(usize, String, String)> {
    let root = Node {
        path: Vec::new(),
        key_span: None,
        value: root,
    };
    let mut out = Vec::new();
    let Some(tiers) = root.child_key("tier") else {
        return out;
    };
    for tier in tiers.children() {
        for side in ["key", "value"] {
            let Some(transform) = tier.child_key(side).and_then(|c| c.child_key("transform"))
            else {
                continue;
            };
            let kind = match transform
                .child_key("kind")
                .map(|k| k.value.get_ref().clone())
            {
                Some(DeValue::String(kind)) => kind.to_string(),
                _ => continue,
            };
            let article = match kind.as_str() {
                "identity" => "an",
                "hadamard" => "a",
                _ => continue,
            };
            for child in transform.children() {
                if matches!(child.path.last(), Some(Seg::Key(k)) if k == "kind") {
                    continue;
                }
                let Some(Seg::Key(key)) = child.path.last() else {
                    continue;
                };
                out.push((
                    child.key_span.clone().map_or(0, |s| s.start),
                    render(&child.path),
                    format!(
                        "unknown key `{key}`; {article} {kind} transform takes no keys besides `kind` \
                         (`seed` belongs to srht, `rank` and `basis` to pca)"
                    ),
                ));
            }
        }
    }
    out
}

/// Offset of the value at `path`, or of the nearest existing ancestor (a key
/// left to its default, a table given implicitly).
fn locate_path(root: &Spanned<DeValue<'_>>, path: &[PathSegment]) -> usize {
    let mut value = root;
    for segment in path {
        let next = match (segment, value.get_ref()) {
            (PathSegment::Key(key), DeValue::Table(table)) => table.get(*key),
            (PathSegment::Index(index), DeValue::Array(array)) => array.get(*index),
            _ => None,
        };
        match next {
            Some(next) => value = next,
            None => break,
        }
    }
    value.span().start
}
