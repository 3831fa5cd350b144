//! A paged KV cache of one layer: per-tier page pools, per-(kv head) tables and
//! per-(sequence, kv head) page tables — what executors read through a `CacheView`.

use kvcc_compiler::layout::{TableRole, TierLayout};
use kvcc_compiler::page::{CacheView, PageHeader, PageRef, TierView};
use kvcc_compiler::Format;

use crate::encode::{
    check_finite, decode_page, encode_page, train_tables, EncodeError, TrainOptions,
};

/// `[tier][kv_head][table]` f32 tables.
pub type Tables = Vec<Vec<Vec<Vec<f32>>>>;

#[derive(Debug, Clone)]
pub struct PagedCache {
    format: Format,
    kv_heads: usize,
    tables: Tables,
    pools: Vec<Vec<u8>>,
    page_tables: Vec<Vec<Vec<PageRef>>>,
}

/// Fits every tier's tables to `[kv_head][token][head_dim]` keys and values.
pub fn train(
    format: &Format,
    keys: &[f32],
    values: &[f32],
    kv_heads: usize,
    options: &TrainOptions,
) -> Result<Tables, EncodeError> {
    let tokens = check_block(format, "keys", keys, kv_heads)?;
    check_block(format, "values", values, kv_heads)?;
    let per_head = tokens * format.head_dim() as usize;
    Ok((0..format.tiers().len())
        .map(|t| {
            let layout = format.layout(t);
            let mut heads: Vec<Vec<Vec<f32>>> = (0..kv_heads)
                .map(|h| {
                    let range = h * per_head..(h + 1) * per_head;
                    train_tables(layout, &keys[range.clone()], &values[range], options)
                })
                .collect();
            // A tensor-wide fp8 scale is the largest over the heads (each
            // head's is its largest magnitude over the format's maximum).
            for (i, table) in layout.tables.iter().enumerate() {
                if table.role == (TableRole::Fp8Scale { shared: true }) {
                    let shared = heads.iter().map(|h| h[i][0]).fold(0.0f32, f32::max);
                    for head in &mut heads {
                        head[i][0] = shared;
                    }
                }
            }
            heads
        })
        .collect())
}

/// Checks a `[kv_head][token][head_dim]` block; returns the token count.
pub(crate) fn check_block(
    format: &Format,
    what: &'static str,
    data: &[f32],
    kv_heads: usize,
) -> Result<usize, EncodeError> {
    let head_dim = format.head_dim() as usize;
    if kv_heads == 0 || !data.len().is_multiple_of(kv_heads * head_dim) {
        return Err(EncodeError::Block {
            what,
            found: data.len(),
            kv_heads,
            head_dim,
        });
    }
    let tokens = data.len() / (kv_heads * head_dim);
    check_finite(what, data, &[kv_heads, tokens, head_dim])?;
    Ok(tokens)
}

impl PagedCache {
    /// An empty cache with trained `tables` (`[tier][kv_head][table]`).
    pub fn new(
        format: &Format,
        kv_heads: usize,
        tables: Tables,
    ) -> Result<PagedCache, EncodeError> {
        let tiers = format.tiers().len();
        if tables.len() != tiers {
            return Err(EncodeError::TierTables {
                found: tables.len(),
                tiers,
            });
        }
        for (tier, per_head) in tables.iter().enumerate() {
            if per_head.len() != kv_heads {
                return Err(EncodeError::TableHeads {
                    found: per_head.len(),
                    expected: kv_heads,
                });
            }
            let layout = format.layout(tier);
            let expected: Vec<usize> = layout.tables.iter().map(|t| t.len as usize).collect();
            for (kv_head, head_tables) in per_head.iter().enumerate() {
                let found: Vec<usize> = head_tables.iter().map(Vec::len).collect();
                if found != expected {
                    return Err(EncodeError::TableShape {
                        tier: layout.name.clone(),
                        kv_head,
                        found,
                        expected,
                    });
                }
            }
        }
        Ok(PagedCache {
            format: format.clone(),
            kv_heads,
            tables,
            pools: vec![Vec::new(); tiers],
            page_tables: Vec::new(),
        })
    }

    pub fn format(&self) -> &Format {
        &self.format
    }
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    pub fn sequences(&self) -> usize {
        self.page_tables.len()
    }
    pub fn tables(&self) -> &Tables {
        &self.tables
    }

    /// Encodes a sequence (`[kv_head][token][head_dim]` keys and values) into
    /// new pages; page `p` of every kv head goes to tier `tier_of_page(p)`.
    /// Returns the sequence index. Nothing is added if any input is rejected.
    pub fn append_sequence(
        &mut self,
        keys: &[f32],
        values: &[f32],
        tier_of_page: impl Fn(usize) -> usize,
    ) -> Result<usize, EncodeError> {
        self.append_sequence_with(keys, values, tier_of_page, encode_page)
    }

    /// [`append_sequence`](Self::append_sequence) with another page encoder of
    /// the same signature as [`encode_page`]: the `encode_page` of a
    /// `kv_format!` module of this cache's format writes the same bytes,
    /// specialized for its tiers.
    pub fn append_sequence_with(
        &mut self,
        keys: &[f32],
        values: &[f32],
        tier_of_page: impl Fn(usize) -> usize,
        encode: impl Fn(&TierLayout, &[Vec<f32>], &[f32], &[f32], &mut [u8]) -> Result<(), EncodeError>,
    ) -> Result<usize, EncodeError> {
        let tokens = check_block(&self.format, "keys", keys, self.kv_heads)?;
        let value_tokens = check_block(&self.format, "values", values, self.kv_heads)?;
        if tokens != value_tokens {
            return Err(EncodeError::KeysValues {
                keys: tokens,
                values: value_tokens,
            });
        }
        let items = self.format.spec().page.items as usize;
        let pages = tokens.div_ceil(items);
        let tiers = self.format.tiers().len();
        let plan: Vec<usize> = (0..pages).map(&tier_of_page).collect();
        if let Some(&tier) = plan.iter().find(|&&t| t >= tiers) {
            return Err(EncodeError::UnknownTier { tier, tiers });
        }
        let head_dim = self.format.head_dim() as usize;
        // All or nothing without copying the pools: new pages go at their ends,
        // and a failed page cuts every pool back to where it was.
        let lengths: Vec<usize> = self.pools.iter().map(Vec::len).collect();
        let mut heads = Vec::with_capacity(self.kv_heads);
        for h in 0..self.kv_heads {
            let mut refs = Vec::with_capacity(pages);
            for (p, &tier) in plan.iter().enumerate() {
                let layout = self.format.layout(tier);
                let rows = h * tokens * head_dim + p * items * head_dim
                    ..h * tokens * head_dim + ((p + 1) * items).min(tokens) * head_dim;
                let pool = &mut self.pools[tier];
                let start = pool.len();
                pool.resize(start + layout.page_bytes as usize, 0);
                let written = encode(
                    layout,
                    &self.tables[tier][h],
                    &keys[rows.clone()],
                    &values[rows],
                    &mut pool[start..],
                );
                if let Err(error) = written {
                    for (pool, &len) in self.pools.iter_mut().zip(&lengths) {
                        pool.truncate(len);
                    }
                    return Err(error);
                }
                refs.push(PageRef {
                    tier: tier as u32,
                    page: (start / layout.page_bytes as usize) as u32,
                });
            }
            heads.push(refs);
        }
        self.page_tables.push(heads);
        Ok(self.page_tables.len() - 1)
    }

    /// Writes one page of `tier` (`page_bytes` bytes) into page slot `slot` of
    /// its pool, growing the pool to hold it.
    pub(crate) fn write_page(&mut self, tier: usize, slot: u32, bytes: &[u8]) {
        let size = bytes.len();
        let start = slot as usize * size;
        let pool = &mut self.pools[tier];
        if pool.len() < start + size {
            pool.resize(start + size, 0);
        }
        pool[start..start + size].copy_from_slice(bytes);
    }

    /// The `[sequence][kv_head]` page tables, to edit in place.
    pub(crate) fn page_tables_mut(&mut self) -> &mut Vec<Vec<Vec<PageRef>>> {
        &mut self.page_tables
    }

    /// The borrowed view executors run over.
    pub fn view(&self) -> CacheView<'_> {
        CacheView {
            tiers: self
                .pools
                .iter()
                .zip(&self.tables)
                .map(|(pool, tables)| TierView { pool, tables })
                .collect(),
            page_tables: &self.page_tables,
            kv_heads: self.kv_heads,
        }
    }

    /// Reference decode of one (sequence, kv head) to dense keys and values.
    pub fn decode_dense(&self, sequence: usize, kv_head: usize) -> (Vec<f32>, Vec<f32>) {
        let mut keys = Vec::new();
        let mut values = Vec::new();
        for r in &self.page_tables[sequence][kv_head] {
            let layout = self.format.layout(r.tier as usize);
            let size = layout.page_bytes as usize;
            let page =
                &self.pools[r.tier as usize][r.page as usize * size..(r.page as usize + 1) * size];
            let (k, v) = decode_page(layout, &self.tables[r.tier as usize][kv_head], page);
            keys.extend(k);
            values.extend(v);
        }
        (keys, values)
    }

    /// A cache of `sequences` sequences of `tokens` tokens each whose pages are
    /// byte copies of this cache's full pages (each kv head cycling through its
    /// own pages of sequence 0), every copy at its own address: large benchmark
    /// caches without encoding millions of tokens. The last page of a sequence
    /// keeps a prefix of its items. Pages keep their tier.
    pub fn replicate(&self, sequences: usize, tokens: usize) -> Result<PagedCache, EncodeError> {
        let items = self.format.spec().page.items as usize;
        let sources = self.page_tables.first().ok_or(EncodeError::Empty)?;
        let mut out = PagedCache {
            pools: vec![Vec::new(); self.pools.len()],
            page_tables: Vec::new(),
            ..self.clone_empty()
        };
        let pages = tokens.div_ceil(items);
        for _ in 0..sequences {
            let mut heads = Vec::with_capacity(self.kv_heads);
            for source in sources {
                let full: Vec<&PageRef> = source
                    .iter()
                    .filter(|r| self.page_count(r) as usize == items)
                    .collect();
                if full.is_empty() {
                    return Err(EncodeError::Empty);
                }
                let refs = (0..pages)
                    .map(|p| {
                        let r = full[p % full.len()];
                        let layout = self.format.layout(r.tier as usize);
                        let size = layout.page_bytes as usize;
                        let pool = &mut out.pools[r.tier as usize];
                        let start = pool.len();
                        pool.extend_from_slice(
                            &self.pools[r.tier as usize]
                                [r.page as usize * size..(r.page as usize + 1) * size],
                        );
                        let count = (tokens - p * items).min(items) as u32;
                        let mut header =
                            PageHeader::read(layout, &pool[start..]).expect("whole page");
                        header.count = count;
                        header.write(layout, &mut pool[start..]);
                        PageRef {
                            tier: r.tier,
                            page: (start / size) as u32,
                        }
                    })
                    .collect();
                heads.push(refs);
            }
            out.page_tables.push(heads);
        }
        Ok(out)
    }

    fn clone_empty(&self) -> PagedCache {
        PagedCache {
            format: self.format.clone(),
            kv_heads: self.kv_heads,
            tables: self.tables.clone(),
            pools: Vec::new(),
            page_tables: Vec::new(),
        }
    }

    fn page_count(&self, r: &PageRef) -> u32 {
        let layout = self.format.layout(r.tier as usize);
        let size = layout.page_bytes as usize;
        PageHeader::read(
            layout,
            &self.pools[r.tier as usize][r.page as usize * size..],
        )
        .map_or(0, |h| h.count)
    }

    /// Tokens of the longest sequence (0 without sequences).
    pub fn longest_sequence(&self) -> usize {
        self.page_tables
            .iter()
            .flat_map(|heads| heads.first())
            .map(|refs| {
                refs.iter()
                    .map(|r| self.page_count(r) as usize)
                    .sum::<usize>()
            })
            .max()
            .unwrap_or(0)
    }

    /// Bytes of all pages in all pools.
    pub fn page_bytes(&self) -> usize {
        self.pools.iter().map(Vec::len).sum()
    }
}
