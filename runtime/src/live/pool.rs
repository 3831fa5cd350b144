//! Page slots of a live cache: per tier, a fixed capacity of page slots and a
//! free list of released ones. Slots are handed out only after a whole call
//! has been checked to fit, so running out never leaves a call half done.

use kvcc_compiler::page::PageRef;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagePool {
    /// Per tier: slots it may hold.
    capacity: Vec<usize>,
    /// Per tier: slots handed out so far (the pool's extent).
    extent: Vec<usize>,
    /// Per tier: released slots below the extent, reused last-in first-out.
    free: Vec<Vec<u32>>,
}

impl PagePool {
    /// `capacity` slots for each of `tiers` tiers.
    pub fn new(tiers: usize, capacity: usize) -> PagePool {
        PagePool::with_capacities(vec![capacity; tiers])
    }

    /// `capacities[t]` slots for tier `t`.
    pub fn with_capacities(capacities: Vec<usize>) -> PagePool {
        let tiers = capacities.len();
        PagePool {
            capacity: capacities,
            extent: vec![0; tiers],
            free: vec![Vec::new(); tiers],
        }
    }

    pub fn capacity(&self, tier: usize) -> usize {
        self.capacity[tier]
    }

    /// Slots of `tier` that can still be handed out.
    pub fn available(&self, tier: usize) -> usize {
        self.free[tier].len() + self.capacity[tier] - self.extent[tier]
    }

    /// Pages of `tier` in use.
    pub fn used(&self, tier: usize) -> usize {
        self.extent[tier] - self.free[tier].len()
    }

    /// A slot of `tier`; the caller has checked [`available`](Self::available).
    pub fn allocate(&mut self, tier: usize) -> PageRef {
        let page = self.free[tier].pop().unwrap_or_else(|| {
            assert!(
                self.extent[tier] < self.capacity[tier],
                "page pool overcommitted"
            );
            self.extent[tier] += 1;
            (self.extent[tier] - 1) as u32
        });
        PageRef {
            tier: tier as u32,
            page,
        }
    }

    pub fn release(&mut self, page: PageRef) {
        self.free[page.tier as usize].push(page.page);
    }
}
