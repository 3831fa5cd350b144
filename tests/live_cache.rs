//! The live cache against a reference built from what it should hold: exact
//! attention (f64) over [sinks, rounded][its pages as the reference decoder
//! reads them][tail, rounded], every output element and every row's
//! log-sum-exp, over random append schedules; each page byte-identical to the
//! encoder on the rounded rows it replaced, in the tier current when it was
//! compressed. Bad calls leave the whole state unchanged.

mod common;

use common::{assert_rows_close, bundled, data, fresh_seed, SplitMix64};
use half::{bf16, f16};
use kvcc::compiler::spec::ExactDtype;
use kvcc::compiler::Format;
use kvcc::runtime::cache;
use kvcc::runtime::encode::{decode_page, encode_page, TrainOptions};
use kvcc::runtime::exec::ExecutorKind;
use kvcc::runtime::live::{
    Append, CachePolicy, LiveCache, LiveError, LiveKv, LiveOptions, SequenceKv,
};
use kvcc::runtime::reference::dense_attention;

/// One sequence's source tokens (`[kv_head][token][head_dim]`), what the cache
/// has taken of them, and the tier of each of its pages.
struct Source {
    keys: Vec<f32>,
    values: Vec<f32>,
    tokens: usize,
    taken: usize,
    page_tiers: Vec<usize>,
}

impl Source {
    /// Tokens `from..to` of every kv head, as the cache takes them.
    fn chunk(&self, kv_heads: usize, d: usize, from: usize, to: usize) -> (Vec<f32>, Vec<f32>) {
        let pick = |data: &[f32]| -> Vec<f32> {
            (0..kv_heads)
                .flat_map(|h| {
                    data[(h * self.tokens + from) * d..(h * self.tokens + to) * d].to_vec()
                })
                .collect()
        };
        (pick(&self.keys), pick(&self.values))
    }
}

fn rounded(exact: ExactDtype, data: &[f32]) -> Vec<f32> {
    data.iter()
        .map(|&x| match exact {
            ExactDtype::F16 => f16::from_f32(x).to_f32(),
            ExactDtype::Bf16 => bf16::from_f32(x).to_f32(),
        })
        .collect()
}

struct Case<'a> {
    format: &'a Format,
    sinks: usize,
    window: usize,
    exact: ExactDtype,
    kv_heads: usize,
    group: usize,
    /// Tiers new pages go to, switched through during the schedule.
    tiers: Vec<usize>,
    executor: ExecutorKind,
    sequences: usize,
    steps: usize,
}

impl Case<'_> {
    fn what(&self) -> String {
        format!(
            "{} tiers {:?}, sinks {} window {} ({}), kv heads {} x group {}, {}",
            self.format.name(),
            self.tiers,
            self.sinks,
            self.window,
            self.exact.name(),
            self.kv_heads,
            self.group,
            self.executor.name()
        )
    }
}

/// Checks every page's bytes and tier, and `attend` against the reference.
fn check(case: &Case, live: &LiveCache, sources: &[Source], queries: &[f32], what: &str) {
    let format = case.format;
    let d = format.head_dim() as usize;
    let q_heads = case.kv_heads * case.group;
    let items = format.spec().page.items as usize;
    let policy = live.policy();
    let view = live.pages().view();
    assert_eq!(
        live.lengths(),
        sources.iter().map(|s| s.taken).collect::<Vec<_>>(),
        "{what}: lengths"
    );
    let mut want_outputs = Vec::new();
    let mut want_lse = Vec::new();
    let mut want_logits = Vec::new();
    for (s, source) in sources.iter().enumerate() {
        let split = policy.split(source.taken, items);
        let tail_start = split.sinks + split.pages * items;
        assert_eq!(
            source.page_tiers.len(),
            split.pages,
            "{what}: pages of sequence {s}"
        );
        let mut rows = Vec::with_capacity(case.kv_heads);
        for h in 0..case.kv_heads {
            let refs = &view.page_tables[s][h];
            assert_eq!(refs.len(), split.pages, "{what}: page table of {s}/{h}");
            let at = |t: usize| (h * source.tokens + t) * d;
            let exact =
                |data: &[f32], from: usize, to: usize| rounded(case.exact, &data[at(from)..at(to)]);
            let mut keys = exact(&source.keys, 0, split.sinks);
            let mut values = exact(&source.values, 0, split.sinks);
            for (p, r) in refs.iter().enumerate() {
                let tier = r.tier as usize;
                assert_eq!(
                    tier, source.page_tiers[p],
                    "{what}: tier of page {p} of {s}/{h}"
                );
                let layout = format.layout(tier);
                let size = layout.page_bytes as usize;
                let bytes = &view.tiers[tier].pool[r.page as usize * size..][..size];
                let tables = &live.tables()[tier][h];
                let from = split.sinks + p * items;
                let mut want = vec![0u8; size];
                encode_page(
                    layout,
                    tables,
                    &exact(&source.keys, from, from + items),
                    &exact(&source.values, from, from + items),
                    &mut want,
                )
                .unwrap();
                assert!(
                    bytes == want.as_slice(),
                    "{what}: bytes of page {p} of {s}/{h}"
                );
                let (k, v) = decode_page(layout, tables, bytes);
                keys.extend(k);
                values.extend(v);
            }
            keys.extend(exact(&source.keys, tail_start, source.taken));
            values.extend(exact(&source.values, tail_start, source.taken));
            rows.push((keys, values));
        }
        for q in 0..q_heads {
            let (keys, values) = &rows[q / case.group];
            let query = &queries[(s * q_heads + q) * d..][..d];
            let want = dense_attention(query, keys, values, d, 1.0 / (d as f32).sqrt());
            want_outputs.extend(want.output);
            want_logits.push(want.logits.clone());
            let max = want
                .logits
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            let sum: f64 = want.logits.iter().map(|&l| f64::from(l - max).exp()).sum();
            want_lse.push(if want.logits.is_empty() {
                f32::NEG_INFINITY
            } else {
                (f64::from(max) + sum.ln()) as f32
            });
        }
    }
    let got = live
        .attend(queries, q_heads)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_rows_close(what, &got.outputs, &want_outputs, d, 2e-4);
    for (row, (g, w)) in got.lse.iter().zip(&want_lse).enumerate() {
        let close = if w.is_finite() {
            (g - w).abs() <= 1e-4 * w.abs().max(1.0)
        } else {
            g == w
        };
        assert!(close, "{what}: lse of row {row}: got {g}, want {w}");
    }
}

/// A random schedule: prefill, then appends of 0..2 pages of tokens per
/// sequence (single tokens most often), the tier switched now and then, a
/// sequence released once; `attend` checked after every step.
fn run(case: &Case, seed: u64) {
    let format = case.format;
    let d = format.head_dim() as usize;
    let items = format.spec().page.items as usize;
    let q_heads = case.kv_heads * case.group;
    let what = case.what();
    let mut rng = SplitMix64(seed);
    let mut sources: Vec<Source> = (0..case.sequences)
        .map(|i| {
            let tokens = case.sinks + case.window + 2 * items + rng.below(3 * items);
            let set = data(
                format,
                seed.wrapping_add(i as u64),
                case.kv_heads,
                q_heads,
                tokens,
            );
            Source {
                keys: set.keys,
                values: set.values,
                tokens,
                taken: 0,
                page_tiers: Vec::new(),
            }
        })
        .collect();
    let train = TrainOptions {
        seed,
        max_samples: 2048,
        iterations: 4,
    };
    let tables = cache::train(
        format,
        &sources[0].keys,
        &sources[0].values,
        case.kv_heads,
        &train,
    )
    .unwrap();
    let options = LiveOptions {
        policy: CachePolicy {
            sinks: case.sinks,
            window: case.window,
            exact: case.exact,
            tier: case.tiers[0],
            select: None,
            budget: None,
        },
        kv_heads: case.kv_heads,
        pages_per_tier: 100_000,
        executor: case.executor,
    };
    let mut live = LiveCache::new(format, &options, tables).unwrap();
    let queries = |rng: &mut SplitMix64, sequences: usize| -> Vec<f32> {
        (0..sequences * q_heads * d)
            .map(|_| (rng.below(2001) as f32 - 1000.0) / 400.0)
            .collect()
    };
    // Prefill: none, one token, or past a page boundary.
    let prompts: Vec<(Vec<f32>, Vec<f32>)> = sources
        .iter_mut()
        .map(|s| {
            let take = rng.pick(&[0, 1, items - 1, items + 1, case.sinks + case.window + items]);
            s.taken = take.min(s.tokens);
            s.chunk(case.kv_heads, d, 0, s.taken)
        })
        .collect();
    let kvs: Vec<SequenceKv> = prompts
        .iter()
        .map(|(k, v)| SequenceKv {
            keys: k,
            values: v,
            queries: Default::default(),
        })
        .collect();
    assert_eq!(
        live.prefill(&kvs).unwrap(),
        (0..case.sequences).collect::<Vec<_>>()
    );
    let mut tier = 0;
    let note_pages = |live: &LiveCache, sources: &mut [Source], tier: usize| {
        for s in sources.iter_mut() {
            let pages = live.policy().split(s.taken, items).pages;
            s.page_tiers.resize(pages, tier);
        }
    };
    note_pages(&live, &mut sources, case.tiers[tier]);
    check(
        case,
        &live,
        &sources,
        &queries(&mut rng, sources.len()),
        &format!("{what}, prefill"),
    );
    for step in 0..case.steps {
        if case.tiers.len() > 1 && rng.below(4) == 0 {
            tier = (tier + 1) % case.tiers.len();
            live.set_tier(case.tiers[tier]).unwrap();
        }
        if step == case.steps / 2 && sources.len() > 1 {
            let gone = rng.below(sources.len());
            live.release(gone).unwrap();
            sources.remove(gone);
        }
        let mut order: Vec<usize> = (0..sources.len()).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i + 1));
        }
        let mut chunks = Vec::new();
        let picked: Vec<usize> = order.into_iter().filter(|_| rng.below(5) != 0).collect();
        for s in picked {
            let source = &mut sources[s];
            let count = rng.pick(&[1, 1, 1, 2, 3, items - 1, items, items + 5, 2 * items]);
            let to = (source.taken + count).min(source.tokens);
            let (k, v) = source.chunk(case.kv_heads, d, source.taken, to);
            source.taken = to;
            chunks.push((s, k, v));
        }
        let batch = common::appends(&chunks);
        live.append(&batch)
            .unwrap_or_else(|e| panic!("{what}, step {step}: {e}"));
        note_pages(&live, &mut sources, case.tiers[tier]);
        let q = queries(&mut rng, sources.len());
        check(case, &live, &sources, &q, &format!("{what}, step {step}"));
    }
}

fn format(name: &str) -> Format {
    bundled()
        .into_iter()
        .find(|f| f.name() == name)
        .expect("bundled format")
}

#[test]
fn every_bundled_format_with_sinks_and_a_window_over_its_tiers() {
    let seed = fresh_seed("every_bundled_format_with_sinks_and_a_window_over_its_tiers");
    for (i, format) in bundled().iter().enumerate() {
        let case = Case {
            format,
            sinks: 4,
            window: 64,
            exact: ExactDtype::F16,
            kv_heads: 2,
            group: 4,
            tiers: (0..format.tiers().len()).collect(),
            executor: ExecutorKind::Jit,
            sequences: 3,
            steps: 12,
        };
        run(&case, seed.wrapping_add(i as u64 * 1000));
    }
}

#[test]
fn sinks_windows_groups_and_exact_dtypes() {
    let seed = fresh_seed("sinks_windows_groups_and_exact_dtypes");
    let kivi = format("kivi");
    let spherical = format("spherical");
    let shard = format("shard");
    let cases = [
        (&kivi, 0, 0, ExactDtype::F16, 2, 1, vec![1]),
        (&kivi, 4, 100, ExactDtype::Bf16, 1, 8, vec![0, 1]),
        (&spherical, 0, 64, ExactDtype::F16, 2, 4, vec![2, 0, 1]),
        (&spherical, 4, 0, ExactDtype::Bf16, 1, 1, vec![1]),
        (&shard, 4, 100, ExactDtype::F16, 2, 8, vec![0]),
        (&shard, 0, 0, ExactDtype::F16, 1, 4, vec![0]),
    ];
    for (i, (format, sinks, window, exact, kv_heads, group, tiers)) in cases.into_iter().enumerate()
    {
        let case = Case {
            format,
            sinks,
            window,
            exact,
            kv_heads,
            group,
            tiers,
            executor: ExecutorKind::Jit,
            sequences: 3,
            steps: 10,
        };
        run(&case, seed.wrapping_add(i as u64 * 1000));
    }
}

#[test]
fn the_interpreter_attends_the_pages_alike() {
    let seed = fresh_seed("the_interpreter_attends_the_pages_alike");
    let kivi = format("kivi");
    let case = Case {
        format: &kivi,
        sinks: 4,
        window: 64,
        exact: ExactDtype::F16,
        kv_heads: 1,
        group: 4,
        tiers: vec![0, 1],
        executor: ExecutorKind::Interp,
        sequences: 2,
        steps: 4,
    };
    run(&case, seed);
}

/// A small cache and what a bad call must not change.
fn small_cache(seed: u64, pages_per_tier: usize) -> (LiveCache, Vec<f32>, Vec<f32>) {
    let format = format("kivi");
    let set = data(&format, seed, 2, 4, 300);
    let options = LiveOptions {
        policy: CachePolicy {
            sinks: 4,
            window: 64,
            exact: ExactDtype::F16,
            tier: 1,
            select: None,
            budget: None,
        },
        kv_heads: 2,
        pages_per_tier,
        executor: ExecutorKind::Jit,
    };
    let prompt = SequenceKv {
        keys: &set.keys,
        values: &set.values,
        queries: Default::default(),
    };
    let (live, indices) = LiveCache::train(
        &format,
        &options,
        &[prompt, prompt],
        &TrainOptions::default(),
    )
    .unwrap();
    assert_eq!(indices, vec![0, 1]);
    // (300 - 4 - 64) / 64 = 3 pages per kv head and sequence, 4 sinks and
    // 104 tail tokens exact.
    assert_eq!(live.pool().used(1), 2 * 2 * 3);
    let tables: usize = (0..2)
        .map(|t| format.layout(t).table_bytes() as usize)
        .sum();
    let exact = 2 * 2 * (4 + 104) * 128 * 2 * 2;
    let pages = 2 * 2 * 3 * format.layout(1).page_bytes as usize;
    assert_eq!(live.bytes(), exact + pages + 2 * tables);
    (live, set.keys, set.values)
}

#[test]
fn bad_calls_leave_the_cache_unchanged() {
    let seed = fresh_seed("bad_calls_leave_the_cache_unchanged");
    let (mut live, keys, values) = small_cache(seed, 64);
    let d = 128;
    let good = |n: usize| (keys[..2 * n * d].to_vec(), values[..2 * n * d].to_vec());
    let (k3, v3) = good(3);
    let mut nan = k3.clone();
    nan[d + 5] = f32::NAN;
    let mut inf = v3.clone();
    inf[7] = f32::INFINITY;
    let mut huge = k3.clone();
    huge[3] = 1e6;
    let ragged = k3[..k3.len() - 1].to_vec();
    let (k2, _) = good(2);
    let ok = Append {
        sequence: 0,
        keys: &k3,
        values: &v3,
    };
    let bad_batches: Vec<(&str, Vec<Append>)> = vec![
        (
            "ragged keys",
            vec![
                ok,
                Append {
                    sequence: 1,
                    keys: &ragged,
                    values: &v3,
                },
            ],
        ),
        (
            "keys and values of other lengths",
            vec![
                ok,
                Append {
                    sequence: 1,
                    keys: &k2,
                    values: &v3,
                },
            ],
        ),
        (
            "NaN",
            vec![
                ok,
                Append {
                    sequence: 1,
                    keys: &nan,
                    values: &v3,
                },
            ],
        ),
        (
            "infinity",
            vec![Append {
                sequence: 1,
                keys: &k3,
                values: &inf,
            }],
        ),
        (
            "beyond f16",
            vec![
                ok,
                Append {
                    sequence: 1,
                    keys: &huge,
                    values: &v3,
                },
            ],
        ),
        (
            "unknown sequence",
            vec![
                ok,
                Append {
                    sequence: 2,
                    keys: &k3,
                    values: &v3,
                },
            ],
        ),
        ("a sequence twice", vec![ok, ok]),
    ];
    let before = live.state();
    for (what, batch) in &bad_batches {
        assert!(live.append(batch).is_err(), "{what}: accepted");
        assert!(live.state() == before, "{what}: the state changed");
    }
    let bad_prompt = SequenceKv {
        keys: &k3,
        values: &nan,
        queries: Default::default(),
    };
    let good_prompt = SequenceKv {
        keys: &k3,
        values: &v3,
        queries: Default::default(),
    };
    assert!(live.prefill(&[good_prompt, bad_prompt]).is_err());
    assert!(live.state() == before, "prefill: the state changed");
    assert!(live.set_tier(2).is_err());
    assert!(live.release(2).is_err());
    assert!(
        live.state() == before,
        "set_tier/release: the state changed"
    );
    let q_heads = 4;
    let queries = vec![0.5f32; 2 * q_heads * d];
    assert!(live.attend(&queries[1..], q_heads).is_err());
    assert!(live.attend(&queries, 3).is_err());
    let mut bad_query = queries.clone();
    bad_query[9] = f32::NAN;
    assert!(live.attend(&bad_query, q_heads).is_err());
    assert!(live.state() == before);
    let empty = SequenceKv::default();
    let kivi = format("kivi");
    let options = LiveOptions {
        policy: CachePolicy::of(&kivi),
        kv_heads: 2,
        pages_per_tier: 8,
        executor: ExecutorKind::Jit,
    };
    let untrained = LiveCache::train(&kivi, &options, &[empty], &TrainOptions::default());
    assert!(matches!(untrained, Err(LiveError::NoTrainingData)));
}

#[test]
fn running_out_of_pages_is_an_error_and_released_pages_are_reused() {
    let seed = fresh_seed("running_out_of_pages_is_an_error_and_released_pages_are_reused");
    // 12 of 16 pages of tier 1 are used: 2 more pages per kv head for both
    // sequences need 8.
    let (mut live, keys, values) = small_cache(seed, 16);
    let d = 128;
    let (k, v): (Vec<f32>, Vec<f32>) = (0..2)
        .map(|h| {
            let rows = h * 300 * d..(h * 300 + 128) * d;
            (keys[rows.clone()].to_vec(), values[rows].to_vec())
        })
        .fold((Vec::new(), Vec::new()), |(mut k, mut v), (a, b)| {
            k.extend(a);
            v.extend(b);
            (k, v)
        });
    let batch = [
        Append {
            sequence: 0,
            keys: &k,
            values: &v,
        },
        Append {
            sequence: 1,
            keys: &k,
            values: &v,
        },
    ];
    let before = live.state();
    match live.append(&batch) {
        Err(LiveError::Capacity {
            needed: 8,
            available: 4,
            ..
        }) => {}
        other => panic!("expected a capacity error, got {other:?}"),
    }
    assert!(live.state() == before, "a failed append changed the state");
    live.append(&batch[..1]).unwrap();
    assert_eq!(live.pool().available(1), 0);
    live.release(0).unwrap();
    assert_eq!(live.pool().available(1), 10);
    live.append(&[Append {
        sequence: 0,
        keys: &k,
        values: &v,
    }])
    .unwrap();
    assert_eq!(live.lengths(), vec![428]);
    assert_eq!(live.pool().used(1), 10);
}

#[test]
fn the_policy_splits_and_counts_exact_rows() {
    let shard = format("shard");
    let policy = CachePolicy::of(&shard);
    assert_eq!((policy.sinks, policy.window, policy.tier), (4, 64, 0));
    let kivi = CachePolicy::of(&format("kivi"));
    assert_eq!((kivi.sinks, kivi.window, kivi.tier), (0, 128, 0));
    let layout = shard.layout(0);
    let split = policy.split(8192, 64);
    assert_eq!((split.sinks, split.pages, split.tail), (4, 126, 124));
    for tokens in [0, 3, 4, 67, 131, 132, 200, 8192] {
        let s = policy.split(tokens, 64);
        assert_eq!(s.sinks + s.pages * 64 + s.tail, tokens);
        if tokens >= 4 + 64 {
            assert!((64..128).contains(&s.tail), "{tokens}: tail {}", s.tail);
        }
    }
    let exact = (4 + 124) * 2 * 128 * 2;
    let pages = 126 * layout.page_bytes as usize + layout.table_bytes() as usize;
    let want = (exact + pages) as f64 / 8192.0;
    assert!((policy.bytes_per_token(layout, 8192) - want).abs() < 1e-9);
}
