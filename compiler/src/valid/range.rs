//! Interval arithmetic over u32 expressions, for the validator's bounds proofs.
//! Ranges are held in u64 so an operation that could wrap is seen and widened.

use crate::ir::BinaryOp;

/// Inclusive `lo..=hi` range of a u32 value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Range {
    pub lo: u64,
    pub hi: u64,
}

const MAX: u64 = u32::MAX as u64;

impl Range {
    pub fn new(lo: u64, hi: u64) -> Range {
        Range { lo, hi }
    }
    pub fn exact(v: u64) -> Range {
        Range { lo: v, hi: v }
    }
    pub fn full() -> Range {
        Range { lo: 0, hi: MAX }
    }
    pub fn union(self, other: Range) -> Range {
        Range::new(self.lo.min(other.lo), self.hi.max(other.hi))
    }
    /// The range, or the full range if the true result could wrap.
    fn or_wrap(lo: u64, hi: u64) -> Range {
        if hi > MAX {
            Range::full()
        } else {
            Range::new(lo, hi)
        }
    }
}

/// Result range of a u32 operation (divisors and shift amounts already checked).
pub fn binary(op: BinaryOp, a: Range, b: Range) -> Option<Range> {
    let all_ones = |v: u64| {
        if v == 0 {
            0
        } else {
            u64::MAX >> v.leading_zeros()
        }
    };
    Some(match op {
        BinaryOp::Add => Range::or_wrap(a.lo + b.lo, a.hi + b.hi),
        BinaryOp::Subtract if a.lo >= b.hi => Range::new(a.lo - b.hi, a.hi - b.lo),
        BinaryOp::Subtract => Range::full(),
        BinaryOp::Multiply => Range::or_wrap(a.lo * b.lo, a.hi.saturating_mul(b.hi)),
        BinaryOp::Divide => Range::new(a.lo / b.hi, a.hi / b.lo),
        BinaryOp::Modulo => Range::new(0, a.hi.min(b.hi - 1)),
        BinaryOp::Min => Range::new(a.lo.min(b.lo), a.hi.min(b.hi)),
        BinaryOp::And => Range::new(0, a.hi.min(b.hi)),
        BinaryOp::Or => Range::new(a.lo.max(b.lo), all_ones(a.hi.max(b.hi))),
        BinaryOp::ShiftLeft => Range::or_wrap(a.lo << b.lo, a.hi << b.hi),
        BinaryOp::ShiftRight => Range::new(a.lo >> b.hi, a.hi >> b.lo),
        BinaryOp::Less | BinaryOp::Equal | BinaryOp::NotEqual => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapping_operations_widen_to_the_full_range() {
        let big = Range::new(0, MAX);
        assert_eq!(
            binary(BinaryOp::Add, big, Range::exact(1)),
            Some(Range::full())
        );
        assert_eq!(
            binary(BinaryOp::Subtract, Range::new(0, 4), Range::exact(1)),
            Some(Range::full())
        );
    }

    #[test]
    fn index_arithmetic_stays_tight() {
        let channel = Range::new(0, 127);
        let group = binary(BinaryOp::Divide, channel, Range::exact(16)).unwrap();
        assert_eq!(group, Range::new(0, 7));
        let bits = binary(BinaryOp::Multiply, group, Range::exact(6)).unwrap();
        assert_eq!(bits, Range::new(0, 42));
        assert_eq!(
            binary(BinaryOp::Modulo, channel, Range::exact(16)),
            Some(Range::new(0, 15))
        );
    }
}
