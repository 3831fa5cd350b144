//! Semantic checks of a spec that deserialized: does it describe a format the
//! kernels can run?
//!
//! Every problem names the offending value by its path in the document
//! (`tier[1].key.field[0].group_size`) and says what is wrong and what would be
//! valid, with the numbers. `front::toml` turns paths into line:column.

use super::problem::{PathSegment, Problem};
use super::suggest::{divisor_suggestions, or_list};
use crate::layout::schema;
use crate::spec::{CodecSpec, CodewordKind, CoeffScale, FieldSpec, FormatSpec, TransformSpec};
use crate::target::shared_memory::{TierModel, TILE_RESERVE};
use crate::target::Target;

/// The kernels' shared-memory model is the back end's: its targets' budgets.
pub use crate::target::shared_memory::{shared_memory_estimate, SHARED_MEMORY_BUDGET};

/// Most tiers a format may have.
pub const MAX_TIERS: usize = 16;
/// Most payload bits of one key item or one value item.
pub const MAX_ITEM_BITS: u64 = 65536;
/// Valid `head_dim` range (and it must be a multiple of 8).
pub const HEAD_DIM_RANGE: (u32, u32) = (8, 1024);
/// Valid `page.items` range.
pub const PAGE_ITEMS_RANGE: (u32, u32) = (1, 4096);
/// Valid `page.max_query_group` range.
pub const MAX_QUERY_GROUP_RANGE: (u32, u32) = (1, 64);
/// Valid radius `bits`.
pub const RADIUS_BITS_RANGE: (u32, u32) = (1, 16);
/// Valid codebook `bits`.
pub const CODEBOOK_BITS_RANGE: (u32, u32) = (1, 12);
/// Valid coeff `bits`.
pub const COEFF_BITS: [u32; 4] = [2, 3, 4, 8];
/// Valid bitmap `group_size`s.
pub const BITMAP_GROUP_SIZES: [u32; 3] = [1, 2, 4];
pub use crate::layout::schema::MASK_WORD_BITS;

/// Checks everything `FormatSpec`'s types cannot express. Returns every problem
/// found (empty: the spec is valid), grouped by tier and codec.
pub fn check_spec(spec: &FormatSpec) -> Vec<Problem> {
    let mut checker = Checker {
        problems: Vec::new(),
    };
    checker.spec(spec);
    checker.problems.extend(super::cache::check_cache(spec));
    checker.problems
}

/// The one check that depends on the page size: a format re-paged by
/// [`crate::Format::with_page_items`] passes every other check unchanged.
pub fn check_page_items(items: u32) -> Option<Problem> {
    let (lo, hi) = PAGE_ITEMS_RANGE;
    (!(lo..=hi).contains(&items)).then(|| Problem {
        path: vec![PathSegment::Key("page"), PathSegment::Key("items")],
        message: format!(
            "page.items {items} is out of range; use {lo}..={hi} items per page (64 is typical)"
        ),
    })
}

struct Checker {
    problems: Vec<Problem>,
}

/// A codec's coordinate count and where it comes from, for messages.
#[derive(Clone, Copy)]
struct Dims {
    n: u32,
    source: &'static str,
}

impl Dims {
    fn describe(self) -> String {
        format!("the codec's {} dimensions ({})", self.n, self.source)
    }
}

impl Checker {
    fn report(&mut self, path: Vec<PathSegment>, message: String) {
        self.problems.push(Problem { path, message });
    }

    fn spec(&mut self, spec: &FormatSpec) {
        use PathSegment::Key;

        self.name(vec![Key("name")], "name", &spec.name);

        let (lo, hi) = HEAD_DIM_RANGE;
        if !(lo..=hi).contains(&spec.head_dim) || !spec.head_dim.is_multiple_of(8) {
            let below = (spec.head_dim / 8 * 8).clamp(lo, hi);
            let above = spec.head_dim.div_ceil(8).saturating_mul(8).clamp(lo, hi);
            let nearest = if below == above {
                format!("{below}")
            } else {
                format!("{below} or {above}")
            };
            let what = if (lo..=hi).contains(&spec.head_dim) {
                "is not a multiple of 8"
            } else {
                "is out of range"
            };
            self.report(
                vec![Key("head_dim")],
                format!(
                    "head_dim {} {what}; use a multiple of 8 in {lo}..={hi}, e.g. {nearest}",
                    spec.head_dim
                ),
            );
        }

        self.problems.extend(check_page_items(spec.page.items));
        let (lo, hi) = MAX_QUERY_GROUP_RANGE;
        if !(lo..=hi).contains(&spec.page.max_query_group) {
            self.report(
                vec![Key("page"), Key("max_query_group")],
                format!(
                    "page.max_query_group {} is out of range; use {lo}..={hi} (the most query heads \
                     sharing one kv head)",
                    spec.page.max_query_group
                ),
            );
        }

        if spec.tiers.is_empty() {
            self.report(
                vec![Key("tier")],
                format!("a format needs 1 to {MAX_TIERS} [[tier]] tables; this one has none"),
            );
        } else if spec.tiers.len() > MAX_TIERS {
            self.report(
                vec![Key("tier"), PathSegment::Index(MAX_TIERS)],
                format!(
                    "{} tiers is too many; a format has 1 to {MAX_TIERS} tiers, so remove {}",
                    spec.tiers.len(),
                    spec.tiers.len() - MAX_TIERS
                ),
            );
        }

        for (i, tier) in spec.tiers.iter().enumerate() {
            let at = |rest: &[PathSegment]| {
                let mut path = vec![Key("tier"), PathSegment::Index(i)];
                path.extend_from_slice(rest);
                path
            };
            self.name(at(&[Key("name")]), "tier name", &tier.name);
            if let Some(first) = spec.tiers[..i].iter().position(|t| t.name == tier.name) {
                self.report(
                    at(&[Key("name")]),
                    format!(
                        "tier name {:?} is already used by tier[{first}]; tier names must be unique, \
                         so rename one of them",
                        tier.name
                    ),
                );
            }
            self.shared_memory(spec, i, at(&[]));
            self.codec(spec, &tier.key, at(&[Key("key")]), "key");
            self.codec(spec, &tier.value, at(&[Key("value")]), "value");
        }
    }

    /// Format and tier names: non-empty, letters, digits, `_` and `-`.
    fn name(&mut self, path: Vec<PathSegment>, what: &str, name: &str) {
        let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
        if name.is_empty() {
            self.report(
                path,
                format!("{what} is empty; use a non-empty name of letters, digits, '_' and '-'"),
            );
        } else if let Some(bad) = name.chars().find(|&c| !ok(c)) {
            let fixed: String = name.chars().map(|c| if ok(c) { c } else { '_' }).collect();
            self.report(
                path,
                format!(
                    "{what} {name:?} contains {bad:?}; use only letters, digits, '_' and '-' \
                     (e.g. {fixed:?})"
                ),
            );
        }
    }

    fn shared_memory(&mut self, spec: &FormatSpec, tier_index: usize, path: Vec<PathSegment>) {
        // Out-of-range codebook bits, head_dim or max_query_group are reported on
        // their own; an estimate built on them would only add noise.
        let tier = &spec.tiers[tier_index];
        let codebook_bits_ok = [&tier.key, &tier.value].iter().all(|codec| {
            codec.fields.iter().all(|field| match *field {
                FieldSpec::Codebook { bits, .. } => {
                    (CODEBOOK_BITS_RANGE.0..=CODEBOOK_BITS_RANGE.1).contains(&bits)
                }
                _ => true,
            })
        });
        let head_dim_ok = (HEAD_DIM_RANGE.0..=HEAD_DIM_RANGE.1).contains(&spec.head_dim);
        let group_ok = (MAX_QUERY_GROUP_RANGE.0..=MAX_QUERY_GROUP_RANGE.1)
            .contains(&spec.page.max_query_group);
        if !(codebook_bits_ok && head_dim_ok && group_ok) {
            return;
        }
        // The least the back end can build: key codebooks read directly.
        let parts = TierModel::of_spec(spec, tier_index).least();
        let total = parts.total();
        let budget = u64::from(SHARED_MEMORY_BUDGET);
        if total <= budget {
            return;
        }

        // What would fit, with everything else unchanged.
        let mut fixes = Vec::new();
        let codebooks: Vec<(bool, usize)> = [(true, &tier.key), (false, &tier.value)]
            .iter()
            .flat_map(|&(is_key, codec)| {
                codec
                    .fields
                    .iter()
                    .enumerate()
                    .filter(|(_, f)| matches!(f, FieldSpec::Codebook { .. }))
                    .map(move |(j, _)| (is_key, j))
            })
            .collect();
        if let [(is_key, j)] = codebooks[..] {
            let current = match tier_codebook(spec, tier_index, is_key, j) {
                Some(FieldSpec::Codebook { bits, .. }) => bits,
                _ => 0,
            };
            let fitting_bits = (1..current).rev().find(|&b| {
                let mut trial = spec.clone();
                set_codebook(&mut trial, tier_index, is_key, j, |bits, _| *bits = b);
                TierModel::of_spec(&trial, tier_index).least().total() <= budget
            });
            if let Some(b) = fitting_bits {
                fixes.push(format!("lower the codebook bits to at most {b}"));
            }
            if let Some(FieldSpec::Codebook {
                per_group: true, ..
            }) = tier_codebook(spec, tier_index, is_key, j)
            {
                let mut trial = spec.clone();
                set_codebook(&mut trial, tier_index, is_key, j, |_, per_group| {
                    *per_group = false
                });
                if TierModel::of_spec(&trial, tier_index).least().total() <= budget {
                    fixes.push("use per_group = false".to_string());
                }
            }
        }
        let fixed_floats = budget / 4;
        if parts.codebooks < fixed_floats {
            let group = (fixed_floats - parts.codebooks) / parts.query;
            if group >= 1 {
                fixes.push(format!("lower page.max_query_group to at most {group}"));
            }
        }
        let roomiest = Target::roomiest();
        let key_codebook =
            (tier.key.fields.iter()).any(|f| matches!(f, FieldSpec::Codebook { .. }));
        let direct = match key_codebook {
            true => " even reading its key codebook directly",
            false => "",
        };
        let advice = match fixes.len() {
            0 => "lower the codebook bits or group count, or use per_group = false".to_string(),
            1 => fixes[0].clone(),
            k => format!("{} or {}", fixes[..k - 1].join(", "), fixes[k - 1]),
        };
        self.report(
            path,
            format!(
                "tier {:?} needs an estimated {total} bytes of shared memory{direct} (4 bytes x \
                 (max_query_group {} x {} query floats + {} codebook floats)), over the budget of \
                 {SHARED_MEMORY_BUDGET} bytes ({} blocks take {} bytes, less {TILE_RESERVE} for \
                 the tiles); {advice}",
                tier.name,
                parts.max_query_group,
                parts.query,
                parts.codebooks,
                roomiest.name(),
                roomiest.model().shared_bytes_per_block,
            ),
        );
    }

    fn codec(
        &mut self,
        spec: &FormatSpec,
        codec: &CodecSpec,
        path: Vec<PathSegment>,
        side: &'static str,
    ) {
        use PathSegment::Key;
        let at = |rest: &[PathSegment]| {
            let mut p = path.clone();
            p.extend_from_slice(rest);
            p
        };
        let head_dim = spec.head_dim;

        let dims = match codec.transform {
            TransformSpec::Pca { rank, .. } => Dims {
                n: rank,
                source: "pca rank",
            },
            _ => Dims {
                n: head_dim,
                source: "head_dim",
            },
        };

        match codec.transform {
            TransformSpec::Identity => {}
            TransformSpec::Hadamard | TransformSpec::Srht { .. } => {
                let (article, kind) = if matches!(codec.transform, TransformSpec::Hadamard) {
                    ("a", "hadamard")
                } else {
                    ("an", "srht")
                };
                if !head_dim.is_power_of_two() {
                    let below = prev_power_of_two(head_dim);
                    self.report(
                        at(&[Key("transform"), Key("kind")]),
                        format!(
                            "{article} {kind} transform needs a power-of-two dimension, but head_dim is \
                             {head_dim}; use a power-of-two head_dim, transform kind = \"identity\", \
                             or kind = \"pca\" with a power-of-two rank (e.g. {below})"
                        ),
                    );
                }
            }
            TransformSpec::Pca { rank, .. } => {
                if rank == 0 || rank > head_dim {
                    self.report(
                        at(&[Key("transform"), Key("rank")]),
                        format!(
                            "pca rank {rank} is out of range; use a rank in 1..={head_dim} \
                             (at most head_dim), e.g. {}",
                            (head_dim / 4).max(1)
                        ),
                    );
                }
            }
        }

        let field_at = |j: usize, key: Option<&'static str>| {
            let mut p = at(&[Key("field"), PathSegment::Index(j)]);
            if let Some(key) = key {
                p.push(Key(key));
            }
            p
        };

        if codec.fields.is_empty() {
            self.report(
                at(&[Key("field")]),
                format!(
                    "the {side} codec has no fields; give it exactly one body field (codebook, coeff, \
                     bitmap or dense), e.g. [{{ kind = \"dense\", dtype = \"f16\" }}]"
                ),
            );
            return;
        }

        // Field structure: one body, at most one radius, radius <-> direction codebook.
        let mut body: Option<usize> = None;
        let mut radius: Option<usize> = None;
        for (j, field) in codec.fields.iter().enumerate() {
            match field {
                FieldSpec::Radius { .. } => {
                    if let Some(first) = radius {
                        self.report(
                            field_at(j, None),
                            format!(
                                "a second radius field (the first is field[{first}]); a codec has \
                                 at most one radius, so remove one"
                            ),
                        );
                    } else {
                        radius = Some(j);
                    }
                }
                _ => {
                    if let Some(first) = body {
                        self.report(
                            field_at(j, None),
                            format!(
                                "a second body field ({}) after the {} at field[{first}]; a codec \
                                 stores its coordinates in exactly one of codebook, coeff, bitmap \
                                 or dense, so remove one",
                                field.kind_name(),
                                codec.fields[first].kind_name()
                            ),
                        );
                    } else {
                        body = Some(j);
                    }
                }
            }
        }
        if body.is_none() {
            self.report(
                at(&[Key("field")]),
                format!(
                    "the {side} codec has no body field; add exactly one codebook, coeff, bitmap or \
                     dense field"
                ),
            );
        }
        let body_field = body.map(|j| (j, codec.fields[j]));
        if let Some(r) = radius {
            let FieldSpec::Radius {
                group_size: radius_group,
                ..
            } = codec.fields[r]
            else {
                unreachable!("radius index points at a radius field")
            };
            match body_field {
                Some((
                    j,
                    FieldSpec::Codebook {
                        codewords,
                        group_size,
                        ..
                    },
                )) => {
                    if codewords == CodewordKind::Vector {
                        self.report(
                            field_at(j, Some("codewords")),
                            format!(
                                "codewords = \"vector\" cannot follow a radius (field[{r}]): a radius \
                                 scales unit directions; use codewords = \"direction\", or remove \
                                 the radius"
                            ),
                        );
                    } else if group_size != radius_group && group_size > 0 && radius_group > 0 {
                        self.report(
                            field_at(j, Some("group_size")),
                            format!(
                                "the direction codebook's group_size {group_size} differs from the \
                                 radius's group_size {radius_group} (field[{r}]); use the same \
                                 group_size for both"
                            ),
                        );
                    }
                }
                Some((j, other)) => self.report(
                    field_at(r, None),
                    format!(
                        "a radius needs a codebook with codewords = \"direction\" to scale, but the \
                         body is a {} (field[{j}]); remove the radius or use a direction codebook",
                        other.kind_name()
                    ),
                ),
                None => {}
            }
        }

        // Per-field values.
        for (j, field) in codec.fields.iter().enumerate() {
            match *field {
                FieldSpec::Radius {
                    group_size, bits, ..
                } => {
                    self.bits_range(field_at(j, Some("bits")), "radius", bits, RADIUS_BITS_RANGE);
                    self.group_size(field_at(j, Some("group_size")), group_size, dims, None);
                }
                FieldSpec::Codebook {
                    group_size,
                    bits,
                    codewords,
                    ..
                } => {
                    self.bits_range(
                        field_at(j, Some("bits")),
                        "codebook",
                        bits,
                        CODEBOOK_BITS_RANGE,
                    );
                    self.group_size(field_at(j, Some("group_size")), group_size, dims, None);
                    if codewords == CodewordKind::Direction && radius.is_none() {
                        self.report(
                            field_at(j, Some("codewords")),
                            format!(
                                "codewords = \"direction\" are unit vectors and need a radius field \
                                 before the codebook, e.g. {{ kind = \"radius\", group_size = \
                                 {group_size}, bits = 8 }}; or use codewords = \"vector\""
                            ),
                        );
                    }
                }
                FieldSpec::Coeff {
                    bits, scale, group, ..
                } => {
                    if !COEFF_BITS.contains(&bits) {
                        self.report(
                            field_at(j, Some("bits")),
                            format!("coeff bits {bits} is not supported; use 2, 3, 4 or 8"),
                        );
                    }
                    match (scale, group) {
                        (CoeffScale::Group, None) => self.report(
                            field_at(j, Some("scale")),
                            "scale = \"group\" needs group = G, the channels sharing one \
                             scale (e.g. group = 32)"
                                .to_string(),
                        ),
                        (CoeffScale::Group, Some(g)) => {
                            if dims.n > 0 && (g == 0 || !dims.n.is_multiple_of(g)) {
                                let suggestions = divisor_suggestions(dims.n, g, None);
                                self.report(
                                    field_at(j, Some("group")),
                                    format!(
                                        "group {g} does not divide {}; use a divisor of {} \
                                         such as {suggestions}",
                                        dims.describe(),
                                        dims.n
                                    ),
                                );
                            }
                        }
                        (_, Some(_)) => self.report(
                            field_at(j, Some("group")),
                            "group applies only to scale = \"group\"; remove it or set \
                             scale = \"group\""
                                .to_string(),
                        ),
                        (_, None) => {}
                    }
                }
                FieldSpec::Bitmap {
                    group_size, keep, ..
                } => self.bitmap(j, &field_at, group_size, keep, dims),
                FieldSpec::Dense { dtype, scale } => {
                    if scale.is_some() && dtype.fp8().is_none() {
                        self.report(
                            field_at(j, Some("scale")),
                            "a scale applies only to fp8 dtypes (\"fp8e4m3\", \"fp8e5m2\"); \
                             remove it"
                                .to_string(),
                        );
                    }
                }
            }
        }

        if let Some(bits) = item_bits(codec, spec.head_dim) {
            if bits > MAX_ITEM_BITS {
                self.report(
                    path.clone(),
                    format!(
                        "a {side} item takes {bits} bits, over the limit of {MAX_ITEM_BITS} bits per \
                         item; use fewer bits, larger groups or a pca transform"
                    ),
                );
            }
        }
    }

    fn bits_range(&mut self, path: Vec<PathSegment>, kind: &str, bits: u32, range: (u32, u32)) {
        let (lo, hi) = range;
        if !(lo..=hi).contains(&bits) {
            self.report(
                path,
                format!(
                    "{kind} bits {bits} is out of range; use {lo}..={hi}{}",
                    if kind == "codebook" {
                        format!(" (2^bits codewords, at most {})", 1u32 << hi)
                    } else {
                        String::new()
                    }
                ),
            );
        }
    }

    /// `group_size >= 1` and divides the codec's dimensions; returns whether it does.
    /// `allowed` restricts the suggestions (bitmap group sizes).
    fn group_size(
        &mut self,
        path: Vec<PathSegment>,
        group_size: u32,
        dims: Dims,
        allowed: Option<&[u32]>,
    ) -> bool {
        if dims.n == 0 {
            // A zero rank / head_dim is reported on its own.
            return false;
        }
        if group_size >= 1 && dims.n.is_multiple_of(group_size) {
            return true;
        }
        let suggestions = divisor_suggestions(dims.n, group_size, allowed);
        let what = if group_size == 0 {
            "group_size 0 is not allowed".to_string()
        } else {
            format!(
                "group_size {group_size} does not divide {}",
                dims.describe()
            )
        };
        self.report(
            path,
            format!("{what}; use a divisor of {} such as {suggestions}", dims.n),
        );
        false
    }

    fn bitmap(
        &mut self,
        j: usize,
        field_at: &dyn Fn(usize, Option<&'static str>) -> Vec<PathSegment>,
        group_size: u32,
        keep: u32,
        dims: Dims,
    ) {
        if !BITMAP_GROUP_SIZES.contains(&group_size) {
            let valid: Vec<u32> = BITMAP_GROUP_SIZES
                .iter()
                .copied()
                .filter(|&g| dims.n.is_multiple_of(g))
                .collect();
            self.report(
                field_at(j, Some("group_size")),
                format!(
                    "bitmap group_size {group_size} is not supported; use {}",
                    or_list(&valid)
                ),
            );
            return;
        }
        if !self.group_size(
            field_at(j, Some("group_size")),
            group_size,
            dims,
            Some(&BITMAP_GROUP_SIZES),
        ) {
            return;
        }
        let groups = dims.n / group_size;
        if groups > MASK_WORD_BITS && !groups.is_multiple_of(MASK_WORD_BITS) {
            let fits: Vec<String> = BITMAP_GROUP_SIZES
                .iter()
                .copied()
                .filter(|&g| {
                    dims.n.is_multiple_of(g) && {
                        let k = dims.n / g;
                        k <= MASK_WORD_BITS || k.is_multiple_of(MASK_WORD_BITS)
                    }
                })
                .map(|g| format!("group_size {g} ({} groups)", dims.n / g))
                .collect();
            let fix = if fits.is_empty() {
                format!(
                    "use dimensions whose group count is at most {MASK_WORD_BITS} or a multiple of \
                     {MASK_WORD_BITS}"
                )
            } else {
                format!("use {}", fits.join(" or "))
            };
            self.report(
                field_at(j, Some("group_size")),
                format!(
                    "group_size {group_size} makes {groups} element groups of {}, which do not \
                     fill whole {MASK_WORD_BITS}-bit mask words; the group count must be at most \
                     {MASK_WORD_BITS} or a multiple of {MASK_WORD_BITS}: {fix}",
                    dims.describe()
                ),
            );
        }
        if keep == 0 || keep > groups {
            self.report(
                field_at(j, Some("keep")),
                format!(
                    "keep {keep} is out of range: {} in groups of {group_size} make {groups} groups; \
                     use keep in 1..={groups}",
                    dims.describe()
                ),
            );
        }
    }
}

/// Field `j` of the key (or value) codec of tier `tier_index`.
fn tier_codebook(
    spec: &FormatSpec,
    tier_index: usize,
    is_key: bool,
    j: usize,
) -> Option<FieldSpec> {
    let tier = &spec.tiers[tier_index];
    let codec = if is_key { &tier.key } else { &tier.value };
    codec.fields.get(j).copied()
}

/// Edits the bits / per_group of codebook field `j` of a tier's key (or value) codec.
fn set_codebook(
    spec: &mut FormatSpec,
    tier_index: usize,
    is_key: bool,
    j: usize,
    edit: impl FnOnce(&mut u32, &mut bool),
) {
    let tier = &mut spec.tiers[tier_index];
    let codec = if is_key {
        &mut tier.key
    } else {
        &mut tier.value
    };
    if let Some(FieldSpec::Codebook {
        bits, per_group, ..
    }) = codec.fields.get_mut(j)
    {
        edit(bits, per_group);
    }
}

/// Payload bits of one item of `codec`, or `None` when a field's sizes are invalid
/// (reported elsewhere): the layout's item schema, summed.
fn item_bits(codec: &CodecSpec, head_dim: u32) -> Option<u64> {
    schema::item_bits(&codec.fields, codec.transform.dims(head_dim).into())
}

/// Largest power of two <= `n` (1 for 0).
fn prev_power_of_two(n: u32) -> u32 {
    if n <= 1 {
        1
    } else {
        1 << (31 - n.leading_zeros())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions() {
        assert_eq!(divisor_suggestions(128, 24, None), "16 or 32");
        assert_eq!(divisor_suggestions(128, 0, None), "1 or 2");
        assert_eq!(divisor_suggestions(128, 256, None), "64 or 128");
        assert_eq!(
            divisor_suggestions(80, 3, Some(&BITMAP_GROUP_SIZES)),
            "2 or 4"
        );
        assert_eq!(or_list(&[1, 2, 4]), "1, 2 or 4");
        assert_eq!(prev_power_of_two(96), 64);
    }
}
