//! Where a page's selection summary sits: the rows of f16 keys that
//! `[cache.select]` keeps beside every compressed page, which a decode step
//! scores to choose the pages it reads.

use crate::spec::{FormatSpec, GroupScore, SelectMethod, SelectSpec};

/// The summary of one (page, kv head): `rows` rows of `head_dim` f16 values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SummaryLayout {
    pub method: SelectMethod,
    pub group: GroupScore,
    pub head_dim: u32,
    pub items_per_page: u32,
    /// Tokens a row summarizes: the page (Quest) or a block (block mean).
    pub block: u32,
    /// Quest: 2 (each channel's minimum, then maximum); block mean: one mean
    /// key per block.
    pub rows: u32,
    /// Compressed pages a step reads per (sequence, kv head), at most.
    pub budget_pages: u32,
}

impl SummaryLayout {
    /// The summary of a checked spec's pages; `None` without `[cache.select]`.
    pub fn of(spec: &FormatSpec) -> Option<SummaryLayout> {
        let select = spec.cache.select.as_ref()?;
        let items = spec.page.items;
        let (block, rows) = match select.method {
            SelectMethod::Quest => (items, 2),
            SelectMethod::BlockMean => {
                let block = select.block.unwrap_or(SelectSpec::DEFAULT_BLOCK);
                (block, items / block)
            }
        };
        let budget_pages = match (select.tokens, select.pages) {
            (Some(tokens), _) => tokens.div_ceil(items),
            (None, pages) => pages.unwrap_or(0),
        };
        Some(SummaryLayout {
            method: select.method,
            group: select.group,
            head_dim: spec.head_dim,
            items_per_page: items,
            block,
            rows,
            budget_pages,
        })
    }

    /// f16 values of one (page, kv head) summary.
    pub fn values(&self) -> usize {
        (self.rows * self.head_dim) as usize
    }

    /// Bytes of one (page, kv head) summary.
    pub fn bytes(&self) -> u32 {
        2 * self.rows * self.head_dim
    }

    /// Summary bytes per token per kv head (the page's bytes over its items).
    pub fn bytes_per_token(&self) -> f64 {
        f64::from(self.bytes()) / f64::from(self.items_per_page)
    }

    /// `[cache.select]` in one line, as `kvcc check` prints it.
    pub fn describe(&self) -> String {
        let what = match self.method {
            SelectMethod::Quest => "per-channel key min/max per page".to_string(),
            SelectMethod::BlockMean => format!("mean key per {}-token block", self.block),
        };
        format!(
            "select {}: {what} ({} B per page and kv head, {:.2} B/token); reads {} compressed \
             pages ({} tokens) per sequence and kv head, plus sinks and window; a GQA group \
             scores a page by the {} of its heads' scores",
            self.method.name(),
            self.bytes(),
            self.bytes_per_token(),
            self.budget_pages,
            self.budget_pages * self.items_per_page,
            self.group.name()
        )
    }
}
