//! The GPU targets the back end writes for, and what it knows of each: the
//! one place that holds their features, shared memory and multiprocessor
//! counts. The front end checks specs against them (`shared_memory`); the
//! PTX back end sizes and places kernels by them.

pub mod shared_memory;

/// GPU architecture the modules are written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Ampere (A100): `cp.async`, 163 KiB of shared memory per block.
    Sm80,
    /// Hopper (H100, H200): 227 KiB of shared memory per block, bulk copies.
    Sm90,
}

/// The resources of one target that size and place a decode kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetModel {
    /// Most dynamic shared memory one block may opt into (bytes).
    pub shared_bytes_per_block: u32,
    /// Shared memory of one multiprocessor, divided among its resident
    /// blocks (bytes).
    pub shared_bytes_per_sm: u32,
    /// Multiprocessors of the target's reference GPU (A100; H100 / H200 SXM).
    pub multiprocessors: u32,
}

impl Target {
    pub const ALL: [Target; 2] = [Target::Sm80, Target::Sm90];

    /// The `.target` name, also used in file names.
    pub fn name(self) -> &'static str {
        match self {
            Target::Sm80 => "sm_80",
            Target::Sm90 => "sm_90",
        }
    }

    /// Whether the tensor memory accelerator's bulk copies exist.
    pub fn bulk_copies(self) -> bool {
        self == Target::Sm90
    }

    /// Whether `cvt.rn.f16x2.{e4m3,e5m2}x2` exists (sm_89+): fp8 pairs widen
    /// to exact f16 pairs in one instruction.
    pub fn fp8_conversions(self) -> bool {
        self == Target::Sm90
    }

    /// Whether a kernel may launch before the one it follows has finished
    /// (programmatic dependent launch): the merge then waits for the decode
    /// kernels' partials in place of the launch gap.
    pub fn dependent_launches(self) -> bool {
        self == Target::Sm90
    }

    /// Most dynamic shared memory one block may opt into (bytes).
    pub fn max_shared_bytes(self) -> u32 {
        self.model().shared_bytes_per_block
    }

    /// Shared memory and multiprocessors of the target's reference GPU.
    pub const fn model(self) -> TargetModel {
        match self {
            Target::Sm80 => TargetModel {
                shared_bytes_per_block: 163 * 1024,
                shared_bytes_per_sm: 164 * 1024,
                multiprocessors: 108,
            },
            Target::Sm90 => TargetModel {
                shared_bytes_per_block: 227 * 1024,
                shared_bytes_per_sm: 228 * 1024,
                multiprocessors: 132,
            },
        }
    }

    /// The target whose blocks may use the most shared memory: a spec that
    /// does not fit it fits none.
    pub const fn roomiest() -> Target {
        let mut best = Target::ALL[0];
        let mut i = 1;
        while i < Target::ALL.len() {
            let t = Target::ALL[i];
            if t.model().shared_bytes_per_block > best.model().shared_bytes_per_block {
                best = t;
            }
            i += 1;
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_fit_their_multiprocessor() {
        for target in Target::ALL {
            let m = target.model();
            assert!(m.shared_bytes_per_block <= m.shared_bytes_per_sm);
            assert_eq!(target.max_shared_bytes(), m.shared_bytes_per_block);
        }
        assert_eq!(Target::roomiest(), Target::Sm90);
    }
}
