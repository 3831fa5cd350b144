//! Where a spec goes wrong: a path into the document
//! (`tier[1].key.field[0].group_size`) and what is wrong there. The checks
//! produce them; `front::toml` turns their paths into line:column.

use std::fmt;

/// One step of a path into the spec document. The checker names keys it
/// knows (`&'static str`); the TOML reader owns keys the spec may lack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PathSegment<K = &'static str> {
    /// A key of a table (`head_dim`, `tier`, `field`, ...), as written in TOML.
    Key(K),
    /// An element of an array (`tier[1]`, `field[0]`).
    Index(usize),
}

impl PathSegment<String> {
    /// This step with its key borrowed, as [`render_path`] takes it.
    pub fn as_deref(&self) -> PathSegment<&str> {
        match self {
            PathSegment::Key(key) => PathSegment::Key(key),
            PathSegment::Index(index) => PathSegment::Index(*index),
        }
    }
}

/// One semantic problem: where (a path into the document) and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: Vec<PathSegment>,
    pub message: String,
}

impl Problem {
    /// The path in dotted form, e.g. `tier[1].key.field[0].group_size`.
    pub fn path_string(&self) -> String {
        render_path(&self.path)
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path_string(), self.message)
        }
    }
}

/// Renders a path as `tier[1].key.field[0].group_size` (`""` for the document).
pub fn render_path(path: &[PathSegment<&str>]) -> String {
    let mut out = String::new();
    for segment in path {
        match segment {
            PathSegment::Key(key) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(key);
            }
            PathSegment::Index(index) => {
                out.push('[');
                out.push_str(&index.to_string());
                out.push(']');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_render_dotted() {
        use PathSegment::*;
        let path = [
            Key("tier"),
            Index(1),
            Key("key"),
            Key("field"),
            Index(0),
            Key("bits"),
        ];
        assert_eq!(render_path(&path), "tier[1].key.field[0].bits");
        assert_eq!(render_path(&[]), "");
    }
}
