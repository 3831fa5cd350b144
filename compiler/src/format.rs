//! The compile pipeline: a checked spec becomes, per tier, a layout and a
//! validated IR module.

use std::path::Path;

use crate::front::check::{check_page_items, check_spec};
use crate::front::problem::Problem;
use crate::front::{load_spec, parse_spec, Diagnostic, SpecError};
use crate::layout::TierLayout;
use crate::lower::lower_tier;
use crate::spec::FormatSpec;
use crate::valid::{validate, ValidModule, ValidationError};

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// A lowering bug: the spec passed its checks but produced invalid IR.
    #[error(transparent)]
    Ir(#[from] ValidationError),
}

/// A compiled format: the spec and, per tier, its validated IR (which carries
/// the tier's layout).
#[derive(Debug, Clone)]
pub struct Format {
    spec: FormatSpec,
    tiers: Vec<ValidModule>,
}

impl Format {
    /// Compiles a spec file.
    pub fn load(path: &Path) -> Result<Format, CompileError> {
        Format::compile(load_spec(path)?)
    }

    /// Compiles spec text; `file` names it in error messages.
    pub fn parse(source: &str, file: &str) -> Result<Format, CompileError> {
        Format::compile(parse_spec(source, file)?)
    }

    /// Compiles a spec built in code. Problems are reported without source
    /// positions (there is no source), under the spec's name.
    pub fn compile(spec: FormatSpec) -> Result<Format, CompileError> {
        let problems = check_spec(&spec);
        if !problems.is_empty() {
            return Err(unplaced(&spec, problems).into());
        }
        let tiers = (0..spec.tiers.len())
            .map(|t| validate(lower_tier(&spec.name, &TierLayout::new(&spec, t))))
            .collect::<Result<_, _>>()?;
        Ok(Format { spec, tiers })
    }

    /// This format with `items` items per page, without checking or lowering
    /// it again: the page size moves only the layout's page geometry. Refused,
    /// with the error [`Format::compile`] would give, outside the spec's range.
    pub fn with_page_items(&self, items: u32) -> Result<Format, SpecError> {
        let mut spec = self.spec.clone();
        spec.page.items = items;
        if let Some(problem) = check_page_items(items) {
            return Err(unplaced(&spec, vec![problem]));
        }
        let tiers = self
            .tiers
            .iter()
            .map(|t| t.with_page_items(items))
            .collect();
        Ok(Format { spec, tiers })
    }

    pub fn spec(&self) -> &FormatSpec {
        &self.spec
    }
    pub fn name(&self) -> &str {
        &self.spec.name
    }
    pub fn head_dim(&self) -> u32 {
        self.spec.head_dim
    }
    /// Validated IR of every tier, indexed by tier.
    pub fn tiers(&self) -> &[ValidModule] {
        &self.tiers
    }
    pub fn layout(&self, tier: usize) -> &TierLayout {
        &self.tiers[tier].module().layout
    }
    pub fn tier_index(&self, name: &str) -> Option<usize> {
        self.spec.tiers.iter().position(|t| t.name == name)
    }
}

/// Problems of a spec built in code, which has no source positions to give.
fn unplaced(spec: &FormatSpec, problems: Vec<Problem>) -> SpecError {
    let file = format!("<spec `{}`>", spec.name);
    let diagnostics = problems
        .into_iter()
        .map(|p| Diagnostic {
            file: file.clone(),
            line: 0,
            column: 0,
            path: p.path_string(),
            message: p.message,
        })
        .collect();
    SpecError::Invalid(diagnostics)
}
