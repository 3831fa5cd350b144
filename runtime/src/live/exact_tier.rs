//! The format a device live cache runs: the spec's tiers and one more, a
//! dense tier of the policy's exact dtype whose pages hold the sinks and the
//! recent tail. Exact rows are then attended by the same decode kernels and
//! merged by the same log-sum-exp merge as compressed pages.

use kvcc_compiler::spec::{CodecSpec, DenseDtype, ExactDtype, FieldSpec, TierSpec};
use kvcc_compiler::{CompileError, Format};

/// A format with its exact tier appended, and that tier's index.
#[derive(Debug, Clone)]
pub struct ServingFormat {
    pub format: Format,
    pub exact_tier: usize,
}

/// The name of the exact tier: `exact`, or the first `exact_N` no tier of
/// `format` has.
fn exact_tier_name(format: &Format) -> String {
    let taken = |name: &str| format.tier_index(name).is_some();
    std::iter::once("exact".to_string())
        .chain((2..).map(|n| format!("exact_{n}")))
        .find(|name| !taken(name))
        .expect("some name is free")
}

/// `format` with a dense tier of `exact` rows after its own tiers.
pub fn serving_format(format: &Format, exact: ExactDtype) -> Result<ServingFormat, CompileError> {
    let dtype = match exact {
        ExactDtype::F16 => DenseDtype::F16,
        ExactDtype::Bf16 => DenseDtype::Bf16,
    };
    let codec = || CodecSpec {
        transform: Default::default(),
        fields: vec![FieldSpec::Dense { dtype, scale: None }],
    };
    let mut spec = format.spec().clone();
    spec.tiers.push(TierSpec {
        name: exact_tier_name(format),
        key: codec(),
        value: codec(),
    });
    let exact_tier = spec.tiers.len() - 1;
    Ok(ServingFormat {
        format: Format::compile(spec)?,
        exact_tier,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exact_tier_follows_the_formats_tiers_with_a_free_name() {
        let spec = r#"
            name = "t"
            head_dim = 64
            [[tier]]
            name = "exact"
            key.field = [{ kind = "coeff", bits = 8, scale = "item" }]
            value.field = [{ kind = "coeff", bits = 8, scale = "item" }]
        "#;
        let format = Format::parse(spec, "t.toml").unwrap();
        let serving = serving_format(&format, ExactDtype::Bf16).unwrap();
        assert_eq!(serving.exact_tier, 1);
        let layout = serving.format.layout(1);
        assert_eq!(layout.name, "exact_2");
        let rows = kvcc_compiler::back::ptx::abi::DenseSource::of_layout(layout).unwrap();
        assert_eq!((rows.key_stride, rows.value_stride), (128, 128));
        assert_eq!(rows.dtype, kvcc_compiler::back::ptx::abi::SourceDtype::Bf16);
        assert_eq!(serving.format.layout(0), format.layout(0));
    }
}
