//! Errors of the spec front end, each with a source position and a document path.

use std::fmt;

/// One problem in a spec file, at a 1-based line and column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub file: String,
    /// 1-based line; 0 for a spec built in code (no source text).
    pub line: usize,
    /// 1-based column, in characters.
    pub column: usize,
    /// Path of the offending key or value, e.g. `tier[1].key.field[0].group_size`;
    /// `""` for the document as a whole (syntax errors, missing top-level keys).
    pub path: String,
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Specs built in code have no source; they carry line 0 and no position.
        if self.line == 0 {
            write!(f, "{}: ", self.file)?;
        } else {
            write!(f, "{}:{}:{}: ", self.file, self.line, self.column)?;
        }
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        f.write_str(&self.message)
    }
}

/// Why a spec could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The file could not be read.
    #[error("{file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    /// The spec has syntax, shape or semantic errors, in document order.
    #[error("{}", render_all(.0))]
    Invalid(Vec<Diagnostic>),
}

impl SpecError {
    /// The positioned problems (empty for I/O errors).
    pub fn diagnostics(&self) -> &[Diagnostic] {
        match self {
            SpecError::Io { .. } => &[],
            SpecError::Invalid(diagnostics) => diagnostics,
        }
    }
}

fn render_all(diagnostics: &[Diagnostic]) -> String {
    diagnostics
        .iter()
        .map(Diagnostic::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}
