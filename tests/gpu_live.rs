//! The live cache on the GPU against the CPU live cache (itself tested
//! against exact attention over what it holds, `tests/live_cache.rs`): the
//! same random append schedules on both, with the same tables; after every
//! step every output element and every row's log-sum-exp agree, and every
//! page the GPU compressed is byte-identical to the CPU encoder's page of the
//! same tokens. Bad calls leave the GPU cache unchanged. Without a GPU these
//! tests print why and pass, unless `KVCC_REQUIRE_GPU=1`.

mod common;

use std::sync::Arc;

use common::{assert_rows_close, bundled, data, fresh_seed, SplitMix64};
use kvcc::compiler::back::ptx::abi::RowDtype;
use kvcc::compiler::layout::summary::SummaryLayout;
use kvcc::compiler::page::PageRef;
use kvcc::compiler::spec::ExactDtype;
use kvcc::compiler::Format;
use kvcc::runtime::builtin::SPECS;
use kvcc::runtime::cache::{self, Tables};
use kvcc::runtime::cuda::cudarc::driver as cudarc_slice;
use kvcc::runtime::cuda::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use kvcc::runtime::cuda::cudarc::driver::DevicePtr;
use kvcc::runtime::cuda::{DeviceAppend, DeviceLiveCache, DeviceLiveOptions, Gpu, StepIo};
use kvcc::runtime::encode::TrainOptions;
use kvcc::runtime::exec::ExecutorKind;
use kvcc::runtime::live::{
    Append, CachePolicy, LiveCache, LiveError, LiveKv, LiveOptions, SequenceKv,
};
use kvcc::runtime::synth::SynthKv;

fn gpu(test: &str) -> Option<Arc<Gpu>> {
    common::gpu_or_skip(test, Gpu::open).map(Arc::new)
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
    sequences: usize,
    steps: usize,
    /// `[cache.select]`: both caches read only the chosen pages.
    select: Option<SummaryLayout>,
}

impl Case<'_> {
    fn what(&self) -> String {
        format!(
            "{} tiers {:?}, sinks {} window {} ({}), kv heads {} x group {}",
            self.format.name(),
            self.tiers,
            self.sinks,
            self.window,
            self.exact.name(),
            self.kv_heads,
            self.group,
        )
    }

    fn policy(&self) -> CachePolicy {
        CachePolicy {
            sinks: self.sinks,
            window: self.window,
            exact: self.exact,
            tier: self.tiers[0],
            select: self.select,
            budget: None,
        }
    }
}

/// Both caches hold the same tokens: lengths, pages and one decode step agree.
fn compare(case: &Case, cpu: &LiveCache, device: &DeviceLiveCache, queries: &[f32], what: &str) {
    let d = case.format.head_dim() as usize;
    let q_heads = case.kv_heads * case.group;
    assert_eq!(device.lengths(), cpu.lengths(), "{what}: lengths");
    let view = cpu.pages().view();
    let exact_tier = device.serving().exact_tier as u32;
    for (s, cpu_heads) in view.page_tables.iter().enumerate() {
        let device_heads = device.page_table(s).expect("same sequences");
        for (h, (cpu_refs, device_refs)) in cpu_heads.iter().zip(&device_heads).enumerate() {
            let compressed: Vec<_> = device_refs
                .iter()
                .filter(|r| r.tier != exact_tier)
                .collect();
            assert_eq!(compressed.len(), cpu_refs.len(), "{what}: pages of {s}/{h}");
            for (p, (c, g)) in cpu_refs.iter().zip(compressed).enumerate() {
                assert_eq!(c.tier, g.tier, "{what}: tier of page {p} of {s}/{h}");
                let size = case.format.layout(c.tier as usize).page_bytes as usize;
                let want = &view.tiers[c.tier as usize].pool[c.page as usize * size..][..size];
                let got = device.page_bytes(g.tier as usize, g.page).unwrap();
                if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
                    panic!(
                        "{what}: page {p} of {s}/{h} (tier {}) differs from the CPU encoder's at byte {at}: {:#04x} vs {:#04x}",
                        c.tier, got[at], want[at]
                    );
                }
            }
        }
    }
    let want = cpu.attend(queries, q_heads).unwrap();
    let got = device
        .attend(queries, q_heads)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    if case.select.is_some() {
        compare_selection(cpu, device, queries, q_heads, what);
    }
    assert_rows_close(what, &got.outputs, &want.outputs, d, 2e-4);
    for (row, (g, w)) in got.lse.iter().zip(&want.lse).enumerate() {
        let close = if w.is_finite() {
            (g - w).abs() <= 1e-4 * w.abs().max(1.0)
        } else {
            g == w
        };
        assert!(close, "{what}: lse of row {row}: got {g}, want {w}");
    }
}

/// The GPU's summaries of every compressed page equal the CPU's, bit for
/// bit, and its last step chose the same pages (by position in each row's
/// list: pool slots may differ).
fn compare_selection(
    cpu: &LiveCache,
    device: &DeviceLiveCache,
    queries: &[f32],
    q_heads: usize,
    what: &str,
) {
    let view = cpu.pages().view();
    let exact_tier = device.serving().exact_tier as u32;
    let want = cpu
        .select_pages(queries, q_heads)
        .expect("the CPU cache selects");
    let got = device
        .chosen_pages()
        .unwrap()
        .expect("the GPU cache selects");
    for (s, cpu_heads) in view.page_tables.iter().enumerate() {
        let device_heads = device.page_table(s).unwrap();
        for (h, (cpu_refs, device_refs)) in cpu_heads.iter().zip(&device_heads).enumerate() {
            let device_refs: Vec<_> = (device_refs.iter())
                .filter(|r| r.tier != exact_tier)
                .collect();
            for (c, g) in cpu_refs.iter().zip(&device_refs) {
                let cpu_summary = cpu.page_summary(c.tier as usize, c.page).unwrap();
                let device_summary = device.page_summary(g.page).unwrap().unwrap();
                if let Some(at) = (device_summary.iter().zip(cpu_summary)).position(|(a, b)| a != b)
                {
                    panic!(
                        "{what}: summary of page {c:?} of {s}/{h} differs at value {at}: {:#06x} vs {:#06x}",
                        device_summary[at], cpu_summary[at]
                    );
                }
            }
            let position = |list: &[&PageRef], page: &PageRef| list.iter().position(|r| *r == page);
            let cpu_list: Vec<_> = cpu_refs.iter().collect();
            let chosen_cpu: Vec<_> = (want[s][h].iter())
                .map(|r| position(&cpu_list, r).expect("a listed page"))
                .collect();
            let chosen_device: Vec<_> = (got[s][h].iter())
                .map(|&page| {
                    (device_refs.iter())
                        .position(|r| r.page == page)
                        .unwrap_or_else(|| panic!("{what}: {s}/{h} chose unlisted page {page}"))
                })
                .collect();
            assert_eq!(
                chosen_device, chosen_cpu,
                "{what}: pages chosen for {s}/{h}"
            );
        }
    }
}

/// A random schedule on both caches: prefill, appends of 0..2 pages of
/// tokens per sequence (single tokens most often), the tier switched now and
/// then, a sequence released once; compared after every step.
fn run(gpu: &Arc<Gpu>, case: &Case, seed: u64) {
    let format = case.format;
    let d = format.head_dim() as usize;
    let items = format.spec().page.items as usize;
    let q_heads = case.kv_heads * case.group;
    let what = case.what();
    let mut rng = SplitMix64(seed);
    let lengths: Vec<usize> = (0..case.sequences)
        .map(|_| case.sinks + case.window + 3 * items + rng.below(3 * items))
        .collect();
    let sets: Vec<_> = (lengths.iter().enumerate())
        .map(|(i, &tokens)| {
            data(
                format,
                seed.wrapping_add(i as u64),
                case.kv_heads,
                q_heads,
                tokens,
            )
        })
        .collect();
    let train = TrainOptions {
        seed,
        max_samples: 2048,
        iterations: 4,
    };
    let tables = cache::train(
        format,
        &sets[0].keys,
        &sets[0].values,
        case.kv_heads,
        &train,
    )
    .unwrap();
    let cpu_options = LiveOptions {
        policy: case.policy(),
        kv_heads: case.kv_heads,
        pages_per_tier: 100_000,
        executor: ExecutorKind::Jit,
    };
    let device_options = DeviceLiveOptions {
        policy: case.policy(),
        kv_heads: case.kv_heads,
        max_sequences: case.sequences,
        pages_per_tier: 4096,
        context: 4096,
        q_heads,
        fixed_plan: false,
    };
    let mut cpu = LiveCache::new(format, &cpu_options, tables.clone()).unwrap();
    let mut device = DeviceLiveCache::new(gpu.clone(), format, &device_options, tables)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    // Tokens `from..to` of sequence `i`, `[kv_head][token][head_dim]`.
    let chunk = |i: usize, from: usize, to: usize| -> (Vec<f32>, Vec<f32>) {
        let pick = |data: &[f32]| -> Vec<f32> {
            (0..case.kv_heads)
                .flat_map(|h| data[(h * lengths[i] + from) * d..(h * lengths[i] + to) * d].to_vec())
                .collect()
        };
        (pick(&sets[i].keys), pick(&sets[i].values))
    };
    let queries = |rng: &mut SplitMix64, sequences: usize| -> Vec<f32> {
        (0..sequences * q_heads * d)
            .map(|_| (rng.below(2001) as f32 - 1000.0) / 400.0)
            .collect()
    };
    // Sequence ids in the caches, and how much of its source each has taken.
    let mut alive: Vec<(usize, usize)> = Vec::new();
    let mut prompts = Vec::new();
    for i in 0..case.sequences {
        let take = rng.pick(&[
            0,
            1,
            items - 1,
            items + 1,
            case.sinks + case.window + 2 * items,
        ]);
        prompts.push(chunk(i, 0, take));
        alive.push((i, take));
    }
    let kvs: Vec<SequenceKv> = (prompts.iter())
        .map(|(k, v)| SequenceKv {
            keys: k,
            values: v,
            queries: Default::default(),
        })
        .collect();
    cpu.prefill(&kvs).unwrap();
    device
        .prefill(&kvs)
        .unwrap_or_else(|e| panic!("{what}, prefill: {e}"));
    let q = queries(&mut rng, alive.len());
    compare(case, &cpu, &device, &q, &format!("{what}, prefill"));
    let mut tier = 0;
    for step in 0..case.steps {
        if case.tiers.len() > 1 && rng.below(4) == 0 {
            tier = (tier + 1) % case.tiers.len();
            cpu.set_tier(case.tiers[tier]).unwrap();
            device.set_tier(case.tiers[tier]).unwrap();
        }
        if step == case.steps / 2 && alive.len() > 1 {
            let gone = rng.below(alive.len());
            cpu.release(gone).unwrap();
            device.release(gone).unwrap();
            alive.remove(gone);
        }
        let mut chunks = Vec::new();
        for (s, (source, taken)) in alive.iter_mut().enumerate() {
            if rng.below(5) == 0 {
                continue;
            }
            let count = rng.pick(&[1, 1, 1, 2, 3, items - 1, items, items + 5, 2 * items]);
            let to = (*taken + count).min(lengths[*source]);
            chunks.push((s, chunk(*source, *taken, to)));
            *taken = to;
        }
        let batch: Vec<Append> = (chunks.iter())
            .map(|(s, (k, v))| Append {
                sequence: *s,
                keys: k,
                values: v,
            })
            .collect();
        cpu.append(&batch).unwrap();
        device
            .append(&batch)
            .unwrap_or_else(|e| panic!("{what}, step {step}: {e}"));
        let q = queries(&mut rng, alive.len());
        compare(case, &cpu, &device, &q, &format!("{what}, step {step}"));
    }
}

/// A bundled spec with `select` as its `[cache.select]` table.
fn selecting(name: &str, select: &str) -> Format {
    let file = format!("specs/{name}.toml");
    let (_, source) = (SPECS.iter().find(|(path, _)| *path == file)).expect("a bundled spec");
    let text = format!("{source}\n[cache.select]\n{select}\n");
    Format::parse(&text, &file).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn gpu_live_cache_selects_the_pages_the_cpu_live_cache_selects() {
    let test = "gpu_live_cache_selects_the_pages_the_cpu_live_cache_selects";
    let Some(gpu) = gpu(test) else { return };
    let seed = fresh_seed(test);
    let cases = [
        (
            "dense_f16",
            "method = \"quest\"\npages = 2",
            ExactDtype::F16,
            2,
            4,
            0,
        ),
        (
            "dense_f16",
            "method = \"quest\"\npages = 3",
            ExactDtype::Bf16,
            1,
            8,
            0,
        ),
        (
            "kivi",
            "method = \"quest\"\ngroup = \"sum\"\npages = 2",
            ExactDtype::F16,
            2,
            4,
            1,
        ),
        (
            "kivi",
            "method = \"block_mean\"\npages = 2",
            ExactDtype::F16,
            2,
            1,
            0,
        ),
        (
            "kivi",
            "method = \"block_mean\"\nblock = 16\ngroup = \"sum\"\npages = 3",
            ExactDtype::Bf16,
            1,
            4,
            1,
        ),
    ];
    for (i, (name, select, exact, kv_heads, group, tier)) in cases.into_iter().enumerate() {
        let format = selecting(name, select);
        let case = Case {
            format: &format,
            sinks: 4,
            window: 64,
            exact,
            kv_heads,
            group,
            tiers: vec![tier],
            sequences: 3,
            steps: 10,
            select: SummaryLayout::of(format.spec()),
        };
        run(&gpu, &case, seed.wrapping_add(i as u64 * 1000));
    }
}

/// Pages whose keys repeat score alike: both caches keep the earliest of the
/// tied pages (and the highest-scoring ones before them).
#[test]
fn gpu_live_cache_breaks_selection_ties_toward_earlier_pages() {
    let test = "gpu_live_cache_breaks_selection_ties_toward_earlier_pages";
    let Some(gpu) = gpu(test) else { return };
    let seed = fresh_seed(test);
    for (method, exact) in [("quest", ExactDtype::F16), ("block_mean", ExactDtype::Bf16)] {
        let format = selecting("dense_f16", &format!("method = \"{method}\"\npages = 3"));
        let (kv_heads, q_heads) = (2, 8);
        let d = format.head_dim() as usize;
        let items = format.spec().page.items as usize;
        let tokens = 12 * items + 70;
        let mut set = data(&format, seed, kv_heads, q_heads, tokens);
        // Every page of kv head 0 holds the same keys; kv head 1 repeats
        // two distinct pages.
        let keys = set.keys.clone();
        for t in 0..tokens {
            let (h0, h1) = (t % items, (t % (2 * items)) + tokens);
            set.keys[t * d..(t + 1) * d].copy_from_slice(&keys[h0 * d..(h0 + 1) * d]);
            set.keys[(tokens + t) * d..(tokens + t + 1) * d]
                .copy_from_slice(&keys[h1 * d..(h1 + 1) * d]);
        }
        let policy = CachePolicy {
            exact,
            ..CachePolicy::of(&format)
        };
        let tables = cache::train(
            &format,
            &set.keys,
            &set.values,
            kv_heads,
            &TrainOptions::default(),
        )
        .unwrap();
        let cpu_options = LiveOptions {
            policy,
            kv_heads,
            pages_per_tier: 1024,
            executor: ExecutorKind::Jit,
        };
        let device_options = DeviceLiveOptions {
            policy,
            kv_heads,
            max_sequences: 1,
            pages_per_tier: 1024,
            context: 4096,
            q_heads,
            fixed_plan: true,
        };
        let mut cpu = LiveCache::new(&format, &cpu_options, tables.clone()).unwrap();
        let mut device =
            DeviceLiveCache::new(gpu.clone(), &format, &device_options, tables).unwrap();
        let prompt = [SequenceKv {
            keys: &set.keys,
            values: &set.values,
            queries: Default::default(),
        }];
        cpu.prefill(&prompt).unwrap();
        device.prefill(&prompt).unwrap();
        let what = format!("{method}, {} exact rows", exact.name());
        let want = cpu.attend(&set.queries, q_heads).unwrap();
        let got = device.attend(&set.queries, q_heads).unwrap();
        assert_rows_close(&what, &got.outputs, &want.outputs, d, 2e-4);
        compare_selection(&cpu, &device, &set.queries, q_heads, &what);
        let chosen = cpu.select_pages(&set.queries, q_heads).unwrap();
        let listed = &cpu.pages().view().page_tables[0][0];
        assert_eq!(
            chosen[0][0],
            listed[..3].to_vec(),
            "{what}: ties go to the earliest pages"
        );
    }
}

/// A selecting step captured once as a CUDA graph (a fixed plan) and
/// replayed after appends that fill and compress pages writes what the
/// same step run eagerly writes, bit for bit.
#[test]
fn gpu_live_cache_selecting_graph_replays_as_eager_steps_over_appends() {
    let test = "gpu_live_cache_selecting_graph_replays_as_eager_steps_over_appends";
    let Some(gpu) = gpu(test) else { return };
    let seed = fresh_seed(test);
    let format = selecting("kivi", "method = \"quest\"\npages = 2");
    let (kv_heads, q_heads, sequences) = (2, 8, 2);
    let d = format.head_dim() as usize;
    let tokens = 700;
    let twins = Twins::new(&format, seed, [kv_heads, q_heads, sequences], tokens, 64);
    let (_, mut device) = twins.caches(&gpu, &format, true);
    let sets = &twins.sets;
    let queries: Vec<f32> = sets
        .iter()
        .flat_map(|s| s.queries[..q_heads * d].to_vec())
        .collect();
    let q = gpu.upload(&queries).unwrap();
    let stream = q.stream().clone();
    let buffers = |n: usize| {
        (
            gpu.upload(&vec![0.0; n]).unwrap(),
            gpu.upload(&vec![0.0; n / d]).unwrap(),
        )
    };
    let (eager_out, eager_lse) = buffers(queries.len());
    let (graph_out, graph_lse) = buffers(queries.len());
    let io = |out: &cudarc_slice::CudaSlice<f32>, lse: &cudarc_slice::CudaSlice<f32>| StepIo {
        queries: q.device_ptr(&stream).0,
        output: out.device_ptr(&stream).0,
        lse: lse.device_ptr(&stream).0,
    };
    let (eager_io, graph_io) = (io(&eager_out, &eager_lse), io(&graph_out, &graph_lse));
    let mut graph = None;
    let mut taken = 0;
    for (step, count) in [150, 1, 63, 64, 1, 130, 2, 200].into_iter().enumerate() {
        let what = format!("step {step}");
        let (keys, values): (Vec<Vec<f32>>, Vec<Vec<f32>>) = sets
            .iter()
            .map(|set| {
                let pick = |data: &[f32]| -> Vec<f32> {
                    (0..kv_heads)
                        .flat_map(|h| {
                            data[(h * tokens + taken) * d..(h * tokens + taken + count) * d]
                                .to_vec()
                        })
                        .collect()
                };
                (pick(&set.keys), pick(&set.values))
            })
            .unzip();
        let batch: Vec<Append> = (0..sequences)
            .map(|s| Append {
                sequence: s,
                keys: &keys[s],
                values: &values[s],
            })
            .collect();
        device.append(&batch).unwrap();
        taken += count;
        // SAFETY: the buffers hold the step's queries and results and
        // outlive it (the downloads below wait).
        unsafe {
            device
                .on_stream(stream.cu_stream(), |live| {
                    live.attend_into(eager_io, q_heads)
                })
                .unwrap_or_else(|e| panic!("{what}: {e}"));
        }
        if graph.is_none() {
            let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            stream.begin_capture(mode).unwrap();
            // SAFETY: as above.
            let captured = unsafe {
                device.on_stream(stream.cu_stream(), |live| {
                    live.attend_into(graph_io, q_heads)
                })
            };
            let ended = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap();
            captured.unwrap_or_else(|e| panic!("{what}, capture: {e}"));
            graph = ended;
        }
        graph.as_ref().expect("a captured step").launch().unwrap();
        let eager = (
            stream.clone_dtoh(&eager_out).unwrap(),
            stream.clone_dtoh(&eager_lse).unwrap(),
        );
        let replayed = (
            stream.clone_dtoh(&graph_out).unwrap(),
            stream.clone_dtoh(&graph_lse).unwrap(),
        );
        stream.synchronize().unwrap();
        assert!(
            eager.0.iter().all(|x| x.is_finite()),
            "{what}: eager output"
        );
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same(&eager.0, &replayed.0),
            "{what}: the replayed output differs from the eager one"
        );
        assert!(
            same(&eager.1, &replayed.1),
            "{what}: the replayed log-sum-exp differs"
        );
        assert!(
            device
                .chosen_pages()
                .unwrap()
                .unwrap()
                .iter()
                .flatten()
                .all(|row| row.len() <= 2),
            "{what}: budget"
        );
    }
}

fn format(name: &str) -> Format {
    bundled()
        .into_iter()
        .find(|f| f.name() == name)
        .expect("bundled format")
}

#[test]
fn gpu_live_cache_matches_the_cpu_live_cache_on_every_bundled_format() {
    let test = "gpu_live_cache_matches_the_cpu_live_cache_on_every_bundled_format";
    let Some(gpu) = gpu(test) else { return };
    let seed = fresh_seed(test);
    for (i, format) in bundled().iter().enumerate() {
        let case = Case {
            format,
            sinks: 4,
            window: 64,
            exact: ExactDtype::F16,
            kv_heads: 2,
            group: 4,
            tiers: (0..format.tiers().len()).collect(),
            sequences: 3,
            steps: 10,
            select: None,
        };
        run(&gpu, &case, seed.wrapping_add(i as u64 * 1000));
    }
}

#[test]
fn gpu_live_cache_sinks_windows_groups_and_exact_dtypes() {
    let test = "gpu_live_cache_sinks_windows_groups_and_exact_dtypes";
    let Some(gpu) = gpu(test) else { return };
    let seed = fresh_seed(test);
    let kivi = format("kivi");
    let spherical = format("spherical");
    let shard = format("shard");
    let mosaic = format("mosaic");
    let cases = [
        (&kivi, 0, 0, ExactDtype::F16, 2, 1, vec![1]),
        (&kivi, 4, 100, ExactDtype::Bf16, 1, 8, vec![0, 1]),
        (&spherical, 0, 64, ExactDtype::F16, 2, 4, vec![2, 0, 1]),
        (&spherical, 4, 0, ExactDtype::Bf16, 1, 1, vec![1]),
        (&shard, 4, 100, ExactDtype::F16, 2, 8, vec![0]),
        (&shard, 0, 0, ExactDtype::F16, 1, 4, vec![0]),
        (&mosaic, 70, 0, ExactDtype::F16, 1, 4, vec![0]),
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
            sequences: 3,
            steps: 8,
            select: None,
        };
        run(&gpu, &case, seed.wrapping_add(i as u64 * 1000));
    }
}

#[test]
fn gpu_live_cache_bad_calls_change_nothing() {
    let test = "gpu_live_cache_bad_calls_change_nothing";
    let Some(gpu) = gpu(test) else { return };
    let seed = fresh_seed(test);
    let format = format("kivi");
    let (kv_heads, q_heads) = (2, 4);
    let d = format.head_dim() as usize;
    let set = data(&format, seed, kv_heads, q_heads, 300);
    let options = DeviceLiveOptions {
        policy: CachePolicy {
            sinks: 4,
            window: 64,
            exact: ExactDtype::F16,
            tier: 1,
            select: None,
            budget: None,
        },
        kv_heads,
        max_sequences: 2,
        // (300 - 4 - 64) / 64 = 3 pages per kv head and sequence: 12 in all.
        pages_per_tier: 13,
        context: 1024,
        q_heads,
        fixed_plan: false,
    };
    let prompt = SequenceKv {
        keys: &set.keys,
        values: &set.values,
        queries: Default::default(),
    };
    let (mut live, _) = DeviceLiveCache::train(
        gpu,
        &format,
        &options,
        &[prompt, prompt],
        &TrainOptions::default(),
    )
    .unwrap();
    let queries: Vec<f32> = (0..2 * q_heads * d)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
        .collect();
    let before = (
        live.lengths(),
        live.pages_in_use(),
        live.attend(&queries, q_heads).unwrap(),
    );
    let unchanged = |live: &DeviceLiveCache, what: &str| {
        let now = (
            live.lengths(),
            live.pages_in_use(),
            live.attend(&queries, q_heads).unwrap(),
        );
        assert_eq!(now, before, "{what} changed the cache");
    };
    // A page of tokens to both sequences: 4 pages needed, 1 free.
    let (k, v): (Vec<f32>, Vec<f32>) = (
        set.keys[..kv_heads * 64 * d].to_vec(),
        set.values[..kv_heads * 64 * d].to_vec(),
    );
    let batch = [0, 1].map(|sequence| Append {
        sequence,
        keys: &k,
        values: &v,
    });
    assert!(matches!(
        live.append(&batch),
        Err(LiveError::Capacity { .. })
    ));
    unchanged(&live, "appending past capacity");
    let mut nan = k.clone();
    nan[5] = f32::NAN;
    let bad = [Append {
        sequence: 0,
        keys: &nan,
        values: &v,
    }];
    assert!(live.append(&bad).is_err());
    unchanged(&live, "a NaN key");
    let huge = vec![1e6f32; k.len()];
    let bad = [Append {
        sequence: 1,
        keys: &k,
        values: &huge,
    }];
    assert!(matches!(
        live.append(&bad),
        Err(LiveError::ExactRange { .. })
    ));
    unchanged(&live, "a value f16 cannot hold");
    let bad = [Append {
        sequence: 2,
        keys: &k,
        values: &v,
    }];
    assert!(matches!(
        live.append(&bad),
        Err(LiveError::UnknownSequence { .. })
    ));
    unchanged(&live, "an unknown sequence");
    let bad = [Append {
        sequence: 0,
        keys: &k[..d],
        values: &v[..d],
    }];
    assert!(live.append(&bad).is_err());
    unchanged(&live, "a block of the wrong shape");
    assert!(live.attend(&queries[..d], q_heads).is_err());
    unchanged(&live, "queries of the wrong shape");
    // The kernels serve groups of 2; attend cannot load others.
    let other = live.attend(&queries[..2 * kv_heads * d], kv_heads);
    assert!(
        matches!(&other, Err(LiveError::Device(e)) if e.contains("attend_into")),
        "{other:?}"
    );
    unchanged(&live, "another number of query heads");
}

#[test]
fn gpu_live_cache_matches_the_cpu_live_cache_on_random_specs() {
    let test = "gpu_live_cache_matches_the_cpu_live_cache_on_random_specs";
    let Some(gpu) = gpu(test) else { return };
    let seed = fresh_seed(test);
    let mut rng = SplitMix64(seed ^ 0x11fe);
    for (i, source) in common::random_specs(seed, 8).iter().enumerate() {
        let format = Format::parse(source, "random.toml")
            .unwrap_or_else(|e| panic!("generated spec rejected: {e}\n{source}"));
        let items = format.spec().page.items as usize;
        let case = Case {
            format: &format,
            sinks: rng.pick(&[0, 4, items + 3]),
            window: rng.pick(&[0, 64, 100]),
            exact: rng.pick(&[ExactDtype::F16, ExactDtype::Bf16]),
            kv_heads: 2,
            group: [1, 2, 4][i % 3],
            tiers: (0..format.tiers().len()).collect(),
            sequences: 2,
            steps: 6,
            select: None,
        };
        run(&gpu, &case, seed.wrapping_add(i as u64 * 1000));
    }
}

/// What the tests of device-side appends set up: per sequence `tokens`
/// tokens of K/V (and queries), tables trained on the first sequence's, and
/// the options of caches that hold every sequence.
struct Twins {
    sets: Vec<SynthKv>,
    tables: Tables,
    options: DeviceLiveOptions,
}

impl Twins {
    fn new(
        format: &Format,
        seed: u64,
        [kv_heads, q_heads, sequences]: [usize; 3],
        tokens: usize,
        pages_per_tier: usize,
    ) -> Twins {
        let sets: Vec<_> = (0..sequences)
            .map(|i| {
                data(
                    format,
                    seed.wrapping_add(i as u64),
                    kv_heads,
                    q_heads,
                    tokens,
                )
            })
            .collect();
        let tables = cache::train(
            format,
            &sets[0].keys,
            &sets[0].values,
            kv_heads,
            &TrainOptions::default(),
        )
        .unwrap();
        let options = DeviceLiveOptions {
            policy: CachePolicy::of(format),
            kv_heads,
            max_sequences: sequences,
            pages_per_tier,
            context: 1024,
            q_heads,
            fixed_plan: false,
        };
        Twins {
            sets,
            tables,
            options,
        }
    }

    /// Two caches with the tables, each holding every sequence empty: one
    /// to append to from the host, one from the device (its steps planned
    /// for capacity when `fixed`), so their pages can be compared.
    fn caches(
        &self,
        gpu: &Arc<Gpu>,
        format: &Format,
        fixed: bool,
    ) -> (DeviceLiveCache, DeviceLiveCache) {
        let device_options = DeviceLiveOptions {
            fixed_plan: fixed,
            ..self.options
        };
        let new = |options| {
            let mut live =
                DeviceLiveCache::new(gpu.clone(), format, options, self.tables.clone()).unwrap();
            live.prefill(&vec![SequenceKv::default(); self.sets.len()])
                .unwrap();
            live
        };
        (new(&self.options), new(&device_options))
    }
}

/// Asserts that two caches list the same pages per sequence and that every
/// such page holds the same bytes.
fn assert_same_pages(what: &str, host: &DeviceLiveCache, device: &DeviceLiveCache) {
    for s in 0..host.lengths().len() {
        let (a, b) = (host.page_table(s).unwrap(), device.page_table(s).unwrap());
        assert_eq!(a, b, "{what}: page tables of {s}");
        for page in a.iter().flatten() {
            assert_eq!(
                host.page_bytes(page.tier as usize, page.page).unwrap(),
                device.page_bytes(page.tier as usize, page.page).unwrap(),
                "{what}: page {page:?} of {s}"
            );
        }
    }
}

#[test]
fn gpu_live_cache_appends_from_the_device_as_from_the_host() {
    let test = "gpu_live_cache_appends_from_the_device_as_from_the_host";
    let Some(gpu) = gpu(test) else { return };
    let seed = fresh_seed(test);
    let format = format("shard");
    let (kv_heads, q_heads, sequences) = (2, 8, 3);
    let d = format.head_dim() as usize;
    let tokens = 400;
    let twins = Twins::new(&format, seed, [kv_heads, q_heads, sequences], tokens, 256);
    let sets = &twins.sets;
    let (mut host, mut device) = twins.caches(&gpu, &format, false);
    let mut rng = SplitMix64(seed);
    let mut taken = vec![0usize; sequences];
    let queries: Vec<f32> = (0..sequences * q_heads * d)
        .map(|_| (rng.below(2001) as f32 - 1000.0) / 400.0)
        .collect();
    for step in 0..12 {
        let mut chunks = Vec::new();
        for (s, t) in taken.iter_mut().enumerate() {
            let count = rng.pick(&[1, 1, 2, 63, 64, 65, 130]).min(tokens - *t);
            let pick = |data: &[f32]| -> Vec<f32> {
                (0..kv_heads)
                    .flat_map(|h| {
                        data[(h * tokens + *t) * d..(h * tokens + *t + count) * d].to_vec()
                    })
                    .collect()
            };
            chunks.push((s, count, pick(&sets[s].keys), pick(&sets[s].values)));
            *t += count;
        }
        let batch: Vec<Append> = (chunks.iter())
            .map(|(s, _, k, v)| Append {
                sequence: *s,
                keys: k,
                values: v,
            })
            .collect();
        host.append(&batch).unwrap();
        let keys: Vec<f32> = chunks.iter().flat_map(|c| c.2.iter().copied()).collect();
        let values: Vec<f32> = chunks.iter().flat_map(|c| c.3.iter().copied()).collect();
        let len = keys.len();
        let keys = device.gpu().upload(&keys).unwrap();
        let values = device.gpu().upload(&values).unwrap();
        let entries: Vec<DeviceAppend> = (chunks.iter())
            .map(|(s, n, _, _)| DeviceAppend {
                sequence: *s,
                tokens: *n,
            })
            .collect();
        device
            .append_device(&keys.slice(0..len), &values.slice(0..len), &entries)
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        let what = format!("step {step}");
        assert_eq!(device.lengths(), host.lengths(), "{what}: lengths");
        assert_same_pages(&what, &host, &device);
        let (a, b) = (
            host.attend(&queries, q_heads).unwrap(),
            device.attend(&queries, q_heads).unwrap(),
        );
        assert_eq!(a, b, "{what}: the same pages attend alike, bit for bit");
    }
}

/// `x` rounded through `dtype` and, for f16/bf16, its 16-bit patterns
/// packed two per f32 (what a framework's half tensor holds, uploaded as f32).
fn rows_of(dtype: RowDtype, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let bits: Vec<u16> = match dtype {
        RowDtype::F32 => return (x.to_vec(), x.to_vec()),
        RowDtype::F16 => x
            .iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect(),
        RowDtype::Bf16 => x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect(),
    };
    let rounded = (bits.iter())
        .map(|&b| match dtype {
            RowDtype::F16 => half::f16::from_bits(b).to_f32(),
            _ => half::bf16::from_bits(b).to_f32(),
        })
        .collect();
    let packed = (bits.chunks(2))
        .map(|p| f32::from_bits(u32::from(p[0]) | u32::from(*p.get(1).unwrap_or(&0)) << 16))
        .collect();
    (rounded, packed)
}

#[test]
fn gpu_live_cache_takes_half_rows_and_fixed_steps_on_the_callers_stream() {
    let test = "gpu_live_cache_takes_half_rows_and_fixed_steps_on_the_callers_stream";
    let Some(gpu) = gpu(test) else { return };
    let seed = fresh_seed(test);
    let format = format("kivi");
    let (kv_heads, q_heads, sequences) = (2, 8, 2);
    let d = format.head_dim() as usize;
    let tokens = 300;
    let twins = Twins::new(&format, seed, [kv_heads, q_heads, sequences], tokens, 64);
    let sets = &twins.sets;
    let queries: Vec<f32> = sets
        .iter()
        .flat_map(|s| s.queries[..q_heads * d].to_vec())
        .collect();
    for input in RowDtype::ALL {
        let what = format!("{} rows", input.name());
        let (mut host, mut device) = twins.caches(&gpu, &format, true);
        let q = gpu.upload(&queries).unwrap();
        let out = gpu.upload(&vec![0.0; queries.len()]).unwrap();
        let lse = gpu.upload(&vec![0.0; sequences * q_heads]).unwrap();
        let stream = &q.stream().clone();
        let io = StepIo {
            queries: q.device_ptr(stream).0,
            output: out.device_ptr(stream).0,
            lse: lse.device_ptr(stream).0,
        };
        let mut taken = 0;
        for (step, count) in [70, 1, 1, 63, 1, 64, 2, 1].into_iter().enumerate() {
            let what = format!("{what}, step {step}");
            let mut host_rows = [Vec::new(), Vec::new()];
            let mut device_rows = [Vec::new(), Vec::new()];
            for set in sets {
                for (side, data) in [&set.keys, &set.values].into_iter().enumerate() {
                    for h in 0..kv_heads {
                        let at = (h * tokens + taken) * d;
                        let (rounded, packed) = rows_of(input, &data[at..at + count * d]);
                        host_rows[side].push(rounded);
                        device_rows[side].extend(packed);
                    }
                }
            }
            let per_sequence = |rows: &[Vec<f32>], s: usize| -> Vec<f32> {
                rows[s * kv_heads..(s + 1) * kv_heads].concat()
            };
            let (keys, values): (Vec<_>, Vec<_>) = (0..sequences)
                .map(|s| {
                    (
                        per_sequence(&host_rows[0], s),
                        per_sequence(&host_rows[1], s),
                    )
                })
                .unzip();
            let batch: Vec<Append> = (0..sequences)
                .map(|s| Append {
                    sequence: s,
                    keys: &keys[s],
                    values: &values[s],
                })
                .collect();
            host.append(&batch).unwrap();
            let len = sequences * kv_heads * count * d;
            let (k, v) = (
                gpu.upload(&device_rows[0]).unwrap(),
                gpu.upload(&device_rows[1]).unwrap(),
            );
            let entries: Vec<DeviceAppend> = (0..sequences)
                .map(|sequence| DeviceAppend {
                    sequence,
                    tokens: count,
                })
                .collect();
            let (kp, vp) = (k.device_ptr(stream).0, v.device_ptr(stream).0);
            // The legacy default stream stands for a framework's stream.
            // SAFETY: the buffers hold `len` elements of `input` (packed) and
            // outlive the calls, which the final download waits for.
            unsafe {
                device
                    .on_stream(std::ptr::null_mut(), |live| {
                        live.append_rows(kp, vp, len, input, &entries)?;
                        live.attend_into(io, q_heads)
                    })
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
            }
            taken += count;
            assert_same_pages(&what, &host, &device);
            let want = host.attend(&queries, q_heads).unwrap();
            let got_out = stream.clone_dtoh(&out).unwrap();
            let got_lse = stream.clone_dtoh(&lse).unwrap();
            stream.synchronize().unwrap();
            assert_rows_close(&what, &got_out, &want.outputs, d, 1e-4);
            assert_rows_close(&format!("{what} lse"), &got_lse, &want.lse, 1, 1e-4);
        }
    }
}
