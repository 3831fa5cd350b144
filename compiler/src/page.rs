//! Pages as bytes: the header every tier's page starts with, page references,
//! and the borrowed view of a paged cache that executors read.
//!
//! Header (little-endian): u32 tier, u32 item count, u32 flags, u32 reserved,
//! then `header_slots` f32 scales, zero-padded to `TierLayout::header_bytes`.

use crate::layout::TierLayout;

#[derive(Debug, Clone, PartialEq)]
pub struct PageHeader {
    pub tier: u32,
    pub count: u32,
    pub flags: u32,
    pub scales: Vec<f32>,
}

impl PageHeader {
    /// Writes the header into the first `layout.header_bytes` of `page`.
    pub fn write(&self, layout: &TierLayout, page: &mut [u8]) {
        let words = [self.tier, self.count, self.flags, 0];
        for (i, w) in words.iter().enumerate() {
            page[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
        }
        for (i, s) in self.scales.iter().enumerate() {
            let at = 16 + 4 * i;
            page[at..at + 4].copy_from_slice(&s.to_le_bytes());
        }
        page[16 + 4 * self.scales.len()..layout.header_bytes as usize].fill(0);
    }

    /// Reads a header; `None` if `page` is shorter than the layout's header.
    pub fn read(layout: &TierLayout, page: &[u8]) -> Option<PageHeader> {
        let header = page.get(..layout.header_bytes as usize)?;
        let word = |i: usize| u32::from_le_bytes(header[4 * i..4 * i + 4].try_into().unwrap());
        let scales = (0..layout.header_slots as usize)
            .map(|i| f32::from_bits(word(4 + i)))
            .collect();
        Some(PageHeader {
            tier: word(0),
            count: word(1),
            flags: word(2),
            scales,
        })
    }
}

/// A page in a tier's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageRef {
    pub tier: u32,
    pub page: u32,
}

/// One tier's pages and tables, borrowed.
#[derive(Debug, Clone, Copy)]
pub struct TierView<'a> {
    /// `pages * layout.page_bytes` bytes.
    pub pool: &'a [u8],
    /// `[kv_head][table]`, each table as f32 values (the layout's `len`).
    pub tables: &'a [Vec<Vec<f32>>],
}

/// A paged cache of one layer, borrowed: what executors run attention over.
#[derive(Debug, Clone)]
pub struct CacheView<'a> {
    /// Indexed by tier.
    pub tiers: Vec<TierView<'a>>,
    /// `[sequence][kv_head]`: the pages holding that sequence's tokens, in order.
    pub page_tables: &'a [Vec<Vec<PageRef>>],
    pub kv_heads: usize,
}
