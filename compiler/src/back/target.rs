//! What the back end knows about each GPU target: the one place that holds
//! their shared memory and multiprocessor counts. The kernels' shared-memory
//! model (`shared_memory`) and the PTX plan read them from here.

use super::ptx::Target;

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
