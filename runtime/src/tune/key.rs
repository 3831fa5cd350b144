//! What a tuning result is valid for. Timings only transfer between runs of
//! the same generated code on the same GPU and driver at a similar shape, so
//! the key holds all of those; a codegen change yields another hash and the
//! old entries are reported stale instead of being used.

use kvcc_compiler::back::ptx;
use kvcc_compiler::back::ptx::defaults::Workload;
use kvcc_compiler::target::Target;
use kvcc_compiler::Format;
use serde::{Deserialize, Serialize};

use super::config::{with_page_items, KernelConfig};

/// The GPU and driver a timing was taken on.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuId {
    pub name: String,
    pub compute_capability: (i32, i32),
    /// As cuDriverGetVersion reports it, e.g. 13000.
    pub driver_version: i32,
}

impl GpuId {
    pub fn target(&self) -> Target {
        if self.compute_capability.0 >= 9 {
            Target::Sm90
        } else {
            Target::Sm80
        }
    }
}

/// A range of serving shapes one tuning covers: batch and context in
/// power-of-two buckets `[lo, 2·lo)`, heads exact (they change the kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShapeBucket {
    pub batch: (u32, u32),
    pub q_heads: u32,
    pub kv_heads: u32,
    /// Tokens of the longest sequence.
    pub context: (u32, u32),
}

impl ShapeBucket {
    pub fn of(batch: usize, q_heads: usize, kv_heads: usize, context: usize) -> ShapeBucket {
        ShapeBucket {
            batch: power_of_two_bucket(batch),
            q_heads: q_heads as u32,
            kv_heads: kv_heads as u32,
            context: power_of_two_bucket(context),
        }
    }

    /// Query heads per kv head.
    pub fn query_group(&self) -> u32 {
        self.q_heads / self.kv_heads.max(1)
    }

    /// The bucket's smallest step, which the cost model chooses for.
    pub fn workload(&self) -> Workload {
        Workload {
            batch: self.batch.0,
            q_heads: self.q_heads,
            kv_heads: self.kv_heads,
            context: self.context.0,
        }
    }
}

impl std::fmt::Display for ShapeBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "batch {}..{}, {} q / {} kv heads, context {}..{}",
            self.batch.0,
            self.batch.1 - 1,
            self.q_heads,
            self.kv_heads,
            self.context.0,
            self.context.1 - 1
        )
    }
}

/// `[2^k, 2^(k+1))` holding `n` (`[0, 1)` for 0).
fn power_of_two_bucket(n: usize) -> (u32, u32) {
    if n == 0 {
        return (0, 1);
    }
    let lo = 1u64 << (usize::BITS - 1 - n.leading_zeros());
    (
        lo.min(u32::MAX as u64) as u32,
        (2 * lo).min(u32::MAX as u64) as u32,
    )
}

/// Everything a tuning result is valid for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TuneKey {
    pub gpu: GpuId,
    pub format: String,
    pub tier: String,
    /// [`codegen_hash`] of the tier.
    pub codegen: String,
    pub shape: ShapeBucket,
}

impl TuneKey {
    pub fn new(gpu: &GpuId, format: &Format, tier: usize, shape: ShapeBucket) -> TuneKey {
        TuneKey {
            gpu: gpu.clone(),
            format: format.name().to_string(),
            tier: format.layout(tier).name.clone(),
            codegen: codegen_hash(format, tier, gpu.target(), shape.query_group()),
            shape,
        }
    }

    /// Same entry apart from the generated code: a result that went stale.
    pub fn same_but_codegen(&self, other: &TuneKey) -> bool {
        self.gpu == other.gpu
            && self.format == other.format
            && self.tier == other.tier
            && self.shape == other.shape
            && self.codegen != other.codegen
    }
}

/// Page sizes whose default kernels the codegen hash covers: the key must not
/// depend on the page size the spec happens to name (it is a tuned knob, and
/// re-encoding at the tuned size must still find the entry).
pub const HASHED_PAGE_SIZES: [u32; 5] = [16, 32, 64, 128, 256];

/// FNV-1a (64-bit) over the PTX of the tier's reference kernel at each of
/// [`HASHED_PAGE_SIZES`] the spec accepts, for `target` and `query_group`: any
/// change in the format's layout or IR, or in the backend's code generation,
/// changes it. Page sizes the spec refuses and kernels that fail to generate
/// are hashed by their error text. The version string changes with the
/// tuning space, whose new axes a default kernel does not show: v2 added
/// bulk copies, so a result chosen without them is stale.
pub fn codegen_hash(format: &Format, tier: usize, target: Target, query_group: u32) -> String {
    let mut hash = Fnv1a::new();
    hash.write(b"kvcc tune key v2\0");
    hash.write(target.name().as_bytes());
    hash.write(&query_group.to_le_bytes());
    for items in HASHED_PAGE_SIZES {
        hash.write(&items.to_le_bytes());
        let ptx = with_page_items(format, items)
            .map_err(|e| e.to_string())
            .and_then(|paged| {
                let config = KernelConfig::reference(&paged);
                let options = config.options(target, query_group);
                ptx::write_tier(&paged.tiers()[tier], query_group, &options)
                    .map(|k| k.ptx)
                    .map_err(|e| e.to_string())
            });
        match ptx {
            Ok(text) | Err(text) => hash.write(text.as_bytes()),
        }
        hash.write(b"\0");
    }
    format!("{:016x}", hash.finish())
}

/// Stable across Rust versions and platforms, unlike `DefaultHasher`.
pub(crate) struct Fnv1a(u64);

impl Fnv1a {
    pub(crate) fn new() -> Fnv1a {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
    pub(crate) fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    pub(crate) fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(key_bits: u32, items: u32) -> Format {
        Format::parse(
            &format!(
                "name = \"q\"\nhead_dim = 64\n[page]\nitems = {items}\n[[tier]]\nname = \"int\"\n\
                 key.field = [{{ kind = \"coeff\", bits = {key_bits}, scale = \"page_component\" }}]\n\
                 value.field = [{{ kind = \"dense\", dtype = \"f16\" }}]\n"
            ),
            "q.toml",
        )
        .unwrap()
    }

    fn gpu() -> GpuId {
        GpuId {
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            driver_version: 13000,
        }
    }

    #[test]
    fn buckets_are_powers_of_two() {
        assert_eq!(power_of_two_bucket(8192), (8192, 16384));
        assert_eq!(power_of_two_bucket(8193), (8192, 16384));
        assert_eq!(power_of_two_bucket(16383), (8192, 16384));
        assert_eq!(power_of_two_bucket(32768), (32768, 65536));
        assert_eq!(power_of_two_bucket(1), (1, 2));
        assert_eq!(power_of_two_bucket(0), (0, 1));
        // A new sequence length in the same bucket finds the same key.
        let bucket = |batch, q_heads, ctx| ShapeBucket::of(batch, q_heads, 8, ctx);
        assert_eq!(bucket(8, 32, 9000), bucket(8, 32, 12000));
        assert_ne!(bucket(8, 32, 9000), bucket(8, 32, 17000));
        assert_eq!(bucket(5, 32, 9000), bucket(7, 32, 9000));
        assert_ne!(bucket(8, 32, 9000), bucket(8, 16, 9000));
    }

    #[test]
    fn the_key_changes_with_the_spec_gpu_driver_and_shape() {
        let shape = ShapeBucket::of(8, 32, 8, 32768);
        let base = TuneKey::new(&gpu(), &spec(8, 64), 0, shape);
        assert_eq!(base, TuneKey::new(&gpu(), &spec(8, 64), 0, shape));
        // Another layout: other generated code.
        let edited = TuneKey::new(&gpu(), &spec(4, 64), 0, shape);
        assert_ne!(base.codegen, edited.codegen);
        assert!(edited.same_but_codegen(&base));
        let mut other_driver = gpu();
        other_driver.driver_version = 12080;
        assert_ne!(base, TuneKey::new(&other_driver, &spec(8, 64), 0, shape));
        let mut ampere = gpu();
        ampere.compute_capability = (8, 0);
        let on_ampere = TuneKey::new(&ampere, &spec(8, 64), 0, shape);
        assert_ne!(base.codegen, on_ampere.codegen, "sm_80 code differs");
        assert_ne!(
            base,
            TuneKey::new(&gpu(), &spec(8, 64), 0, ShapeBucket::of(8, 32, 4, 32768))
        );
    }

    #[test]
    fn the_key_does_not_depend_on_the_spec_page_size() {
        let shape = ShapeBucket::of(8, 32, 8, 32768);
        assert_eq!(
            TuneKey::new(&gpu(), &spec(8, 64), 0, shape),
            TuneKey::new(&gpu(), &spec(8, 128), 0, shape)
        );
    }
}
