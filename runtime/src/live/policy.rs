//! A live cache's policy: how many first tokens (sinks) and most recent tokens
//! (window) stay exact, how exact rows are stored, and the tier whole pages are
//! compressed into, which compressed pages a step reads — and what that
//! costs in bytes.

use kvcc_compiler::front::cache::cache_tier;
use kvcc_compiler::layout::summary::SummaryLayout;
use kvcc_compiler::layout::TierLayout;
use kvcc_compiler::spec::ExactDtype;
use kvcc_compiler::Format;

use super::budget::BudgetPolicy;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CachePolicy {
    pub sinks: usize,
    pub window: usize,
    pub exact: ExactDtype,
    /// Index of the tier new pages are compressed into.
    pub tier: usize,
    /// `[cache.select]`: the summary every compressed page keeps and the
    /// pages a step reads; `None`: every page.
    pub select: Option<SummaryLayout>,
    /// `[cache.budget]`: a tier per compressed state (or none: dropped)
    /// chosen under a byte budget; `None`: every page in `tier`.
    pub budget: Option<BudgetPolicy>,
}

/// Where a sequence's tokens are under a policy: the first `sinks` exact, then
/// `pages` whole compressed pages, then an exact `tail`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Split {
    pub sinks: usize,
    pub pages: usize,
    pub tail: usize,
}

impl CachePolicy {
    /// The policy of `format`'s `[cache]` table (a checked spec names a real tier).
    pub fn of(format: &Format) -> CachePolicy {
        let cache = &format.spec().cache;
        CachePolicy {
            sinks: cache.sinks as usize,
            window: cache.window as usize,
            exact: cache.exact,
            tier: cache_tier(format.spec()).unwrap_or(0),
            select: SummaryLayout::of(format.spec()),
            budget: cache.budget.as_ref().map(BudgetPolicy::of),
        }
    }

    /// Everything compressed, in `tier`: no sinks, no window.
    pub fn compress_all(tier: usize) -> CachePolicy {
        CachePolicy {
            sinks: 0,
            window: 0,
            exact: ExactDtype::F16,
            tier,
            select: None,
            budget: None,
        }
    }

    /// This policy with `sinks` and `window` replaced where given (`--sinks`, `--window`).
    pub fn with_overrides(self, sinks: Option<usize>, window: Option<usize>) -> CachePolicy {
        CachePolicy {
            sinks: sinks.unwrap_or(self.sinks),
            window: window.unwrap_or(self.window),
            ..self
        }
    }

    /// This policy reading at most `pages` compressed pages per (sequence,
    /// kv head) where it selects (`--select-pages`); unchanged otherwise.
    pub fn with_select_budget(self, pages: Option<u32>) -> CachePolicy {
        let select = self.select.map(|s| SummaryLayout {
            budget_pages: pages.unwrap_or(s.budget_pages),
            ..s
        });
        CachePolicy { select, ..self }
    }

    /// Whether any token is kept exact.
    pub fn keeps_exact(&self) -> bool {
        self.sinks > 0 || self.window > 0
    }

    /// Where `tokens` tokens of one sequence are. Pages are compressed only
    /// when whole, so the tail holds `window..window + items` tokens once the
    /// sequence is long enough (fewer before).
    pub fn split(&self, tokens: usize, items: usize) -> Split {
        let sinks = tokens.min(self.sinks);
        let rest = tokens - sinks;
        let pages = rest.saturating_sub(self.window) / items;
        Split {
            sinks,
            pages,
            tail: rest - pages * items,
        }
    }

    /// Bytes per token per kv head of one sequence of `context` tokens whose
    /// pages are in `layout`'s tier: exact rows (K and V), whole pages, and the
    /// tier's tables, all over `context`.
    pub fn bytes_per_token(&self, layout: &TierLayout, context: usize) -> f64 {
        let items = layout.items_per_page as usize;
        let split = self.split(context, items);
        let exact_row = 2 * layout.head_dim as usize * self.exact.bytes() as usize;
        let exact = ((split.sinks + split.tail) * exact_row) as f64;
        let compressed = split.pages * items;
        let pages = match (compressed, self.budget) {
            (0, _) => f64::from(layout.table_bytes()),
            (_, Some(b)) => b.bytes_per_token * compressed as f64,
            _ => layout.effective_bytes_per_token(compressed as u32) * compressed as f64,
        };
        let summaries = self
            .select
            .map_or(0.0, |s| s.bytes_per_token() * compressed as f64);
        let pages = pages + summaries;
        (exact + pages) / context.max(1) as f64
    }

    /// "sinks 4 + window 64 exact (f16), whole pages in `pca64_vq`", and
    /// "; reads 16 pages by quest" where it selects.
    pub fn describe(&self, format: &Format) -> String {
        let pages = match self.budget {
            Some(b) => format!("pages of one tier each, a tier per state: {}", b.describe()),
            None => format!("whole pages in `{}`", format.layout(self.tier).name),
        };
        let kept = match self.keeps_exact() {
            false => format!("no exact tokens, {pages}"),
            true => format!(
                "sinks {} + window {} exact ({}), {pages}",
                self.sinks,
                self.window,
                self.exact.name()
            ),
        };
        match self.select {
            None => kept,
            Some(s) => format!(
                "{kept}; reads {} pages by {}",
                s.budget_pages,
                s.method.name()
            ),
        }
    }
}
