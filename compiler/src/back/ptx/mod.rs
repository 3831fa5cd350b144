//! The PTX backend: per tier of a format, a flash-decoding kernel that computes
//! attention straight from the tier's pages, plus one merge kernel per format.
//! Pure Rust; no CUDA toolkit is needed to generate. The kernel design and the
//! mapping of every IR construct are in `docs/ptx-backend.md`; the launch
//! contract is [`abi`].
//!
//! - [`abi`]: the launch contract: kernel names, parameters, launch shapes,
//!   buffer layouts, the shared-memory symbol.
//! - `options`: what a kernel is generated for and its [`Schedule`], the
//!   choices that change speed but not results.
//! - [`defaults`]: the default schedule and page size of a tier for a
//!   workload, from a cost model of the decode step.
//! - [`builder`]: the typed PTX builder (registers, instructions, modules).
//! - `plan`: tile geometry, work split and shared-memory layout of a tier;
//!   `streams` (where a tile's items sit), `tensor_cores` (which tiers the
//!   tensor cores serve, and their fragment geometry) and `lane_split` (a
//!   score split over lanes) are the parts it decides from.
//! - `expr`: IR expressions -> PTX, generic over programs.
//! - `kernel`: the decode kernel, phase by phase, around a tier's programs.
//! - `merge`: the log-sum-exp merge kernel.
//! - [`encode`]: the page-compress kernel of a tier (dense K/V rows in, the
//!   tier's page out, byte-identical to the CPU encoder).

pub mod abi;
mod append;
pub mod builder;
pub mod defaults;
pub mod encode;
mod expr;
mod kernel;
mod lane_split;
mod merge;
mod options;
mod plan;
pub mod select;
mod streams;
mod tensor_cores;

pub use append::NotExact;
pub use options::{Options, Schedule};
pub use streams::shared_stride;

use crate::target::Target;
use crate::valid::ValidModule;
use crate::Format;

/// PTX ISA version of the modules: accepted by CUDA 12.0+ drivers (the target
/// GPUs run CUDA 13.0's) and by ptxas for both targets.
pub const PTX_VERSION: &str = "8.0";

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error("invalid PTX options: {0}")]
    Options(String),
    #[error(
        "format {format}, tier {tier}: the decode kernel needs {needed} bytes of shared memory, \
         more than {target} allows ({limit}); lower page.max_query_group, tile_items or tile_bytes"
    )]
    SharedMemory {
        format: String,
        tier: String,
        needed: u32,
        limit: u32,
        target: &'static str,
    },
    #[error("format {format}, tier {tier}: no encode kernel: {reason}")]
    Encoder {
        format: String,
        tier: String,
        reason: String,
    },
}

/// One tier's module.
#[derive(Debug, Clone)]
pub struct TierKernel {
    pub tier: String,
    /// The PTX module text (one `.entry`).
    pub ptx: String,
    pub kernel: abi::DecodeKernel,
}

/// The format's merge module.
#[derive(Debug, Clone)]
pub struct MergeOutput {
    pub ptx: String,
    pub kernel: abi::MergeKernel,
}

#[derive(Debug, Clone)]
pub struct Output {
    pub target: Target,
    /// Indexed by tier.
    pub tiers: Vec<TierKernel>,
    pub merge: MergeOutput,
}

/// Generates the decode module of every tier and the merge module of `format`.
pub fn write(format: &Format, options: &Options) -> Result<Output, Error> {
    let group_max = group_max(format, options)?;
    let tiers = format
        .tiers()
        .iter()
        .map(|module| write_tier(module, group_max, options))
        .collect::<Result<_, _>>()?;
    Ok(Output {
        target: options.target,
        tiers,
        merge: write_merge(format, options),
    })
}

/// Query heads per kv head the kernels are sized for: `options.query_group`,
/// at most the spec's `page.max_query_group`.
pub fn group_max(format: &Format, options: &Options) -> Result<u32, Error> {
    options.check()?;
    let spec_group = format.spec().page.max_query_group;
    match options.query_group {
        Some(g) if g > spec_group => Err(Error::Options(format!(
            "query_group {g} is larger than the spec's page.max_query_group {spec_group}"
        ))),
        Some(g) => Ok(g),
        None => Ok(spec_group),
    }
}

/// The format's merge module (its block size from `options.warps`).
pub fn write_merge(format: &Format, options: &Options) -> MergeOutput {
    let name = format!("kvcc_{}_merge", identifier(format.name()));
    let shape = merge::MergeShape {
        head_dim: format.head_dim(),
        group_threads: 32 * options.schedule.warps,
    };
    let ptx = builder::module(
        PTX_VERSION,
        options.target.name(),
        abi::SHARED_SYMBOL,
        &[merge::merge(
            shape,
            &name,
            options.target.dependent_launches(),
        )],
    );
    MergeOutput {
        ptx,
        kernel: abi::MergeKernel {
            name,
            threads: shape.threads(),
            shared_bytes: shape.shared_bytes(),
            partials: abi::PartialLayout::new(format.head_dim()),
        },
    }
}

/// The decode module of one tier, its shared memory sized for `group_max`
/// query heads per kv head.
pub fn write_tier(
    module: &ValidModule,
    group_max: u32,
    options: &Options,
) -> Result<TierKernel, Error> {
    let (module, plan) = planned(module, group_max, options)?;
    let module = &*module;
    let m = module.module();
    let name = format!(
        "kvcc_{}_{}_decode",
        identifier(&m.format),
        identifier(&m.tier)
    );
    let entry = kernel::decode(module, &plan, &name);
    let ptx = builder::module(
        PTX_VERSION,
        options.target.name(),
        abi::SHARED_SYMBOL,
        &[entry],
    );
    Ok(TierKernel {
        tier: m.tier.clone(),
        ptx,
        kernel: plan.decode_kernel(name, m),
    })
}

/// The module as `options.target` runs it (lookup tables inlined where they
/// do not pay) and its kernel's plan.
fn planned<'a>(
    module: &'a ValidModule,
    group_max: u32,
    options: &Options,
) -> Result<(std::borrow::Cow<'a, ValidModule>, plan::Plan), Error> {
    options.check()?;
    let module = crate::target::shared_memory::for_target(module, group_max, options.target);
    let plan = plan::Plan::new(module.module(), group_max, options)?;
    Ok((module, plan))
}

/// Which phases of `tier`'s kernel run on the tensor cores with `options`
/// (the decisions [`write_tier`] makes; a plan error counts as none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TensorCorePhases {
    pub score: bool,
    pub accumulate: bool,
    /// The values take per-group scales (and zero points): one B fragment
    /// per group and a zero sum per group and head.
    pub grouped_values: bool,
    /// The score gathers its key rows' groups from a bitmap.
    pub gathered_keys: bool,
}

pub fn tensor_core_phases(format: &Format, tier: usize, options: &Options) -> TensorCorePhases {
    let plan = group_max(format, options)
        .and_then(|group_max| planned(&format.tiers()[tier], group_max, options));
    match plan.ok().and_then(|(_, plan)| plan.mma) {
        Some(m) => TensorCorePhases {
            score: m.score.is_some(),
            accumulate: true,
            grouped_values: m.channel.groups.is_some(),
            gathered_keys: m.score.is_some() && m.key_rows.gather.is_some(),
        },
        None => TensorCorePhases::default(),
    }
}

/// The append module of a live cache whose exact rows are `layout`'s pages
/// (a dense f16 or bf16 tier, see [`abi::DenseSource::of_layout`]), reading
/// new rows of `input` (the f32 kernel keeps the plain name).
pub fn write_append(
    format_name: &str,
    layout: &crate::layout::TierLayout,
    input: abi::RowDtype,
    target: Target,
) -> Result<(String, abi::AppendKernel), NotExact> {
    let rows = abi::DenseSource::of_layout(layout).ok_or_else(|| NotExact {
        tier: layout.name.clone(),
    })?;
    let suffix = match input {
        abi::RowDtype::F32 => String::new(),
        other => format!("_from_{}", other.name()),
    };
    let name = format!("kvcc_{}_append{suffix}", identifier(format_name));
    let (entry, kernel) = append::append(&rows, layout.index, input, &name);
    let ptx = builder::module(PTX_VERSION, target.name(), abi::SHARED_SYMBOL, &[entry]);
    Ok((ptx, kernel))
}

/// The `[cache.select]` kernels of `format_name` (summarize, score for query
/// groups of `group` heads, choose: `select::SelectKernels`) in one module,
/// summarizing pages of the exact tier laid out as `exact`.
pub fn write_select(
    format_name: &str,
    summary: &crate::layout::summary::SummaryLayout,
    exact: &crate::layout::TierLayout,
    group: u32,
    target: Target,
) -> Result<(String, select::SelectKernels), NotExact> {
    let source = abi::DenseSource::of_layout(exact).ok_or_else(|| NotExact {
        tier: exact.name.clone(),
    })?;
    let name = format!("kvcc_{}_select", identifier(format_name));
    let (entries, kernels) = select::kernels(&name, summary, &source, group);
    let ptx = builder::module(PTX_VERSION, target.name(), abi::SHARED_SYMBOL, &entries);
    Ok((ptx, kernels))
}

/// A spec name as a PTX identifier (`-` is not allowed there).
fn identifier(name: &str) -> String {
    name.replace('-', "_")
}

/// Snapshot file name of a tier's module inside `generated/<format>/`.
pub fn file_name(tier: &str, target: Target) -> String {
    format!("{tier}.{}.ptx", target.name())
}

/// Snapshot file name of the merge module inside `generated/<format>/`.
pub fn merge_file_name(target: Target) -> String {
    format!("merge.{}.ptx", target.name())
}
