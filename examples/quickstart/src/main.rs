//! kvcc quickstart: a spec, one `kv_format!` call, a few vectors encoded,
//! decode attention on the CPU and, when there is one, on the GPU.

use kvcc_runtime::cache::{self, PagedCache};
use kvcc_runtime::encode::TrainOptions;
use kvcc_runtime::exec::{CudaExecutor, Executor, JitExecutor};
use kvcc_runtime::kv_format;
use kvcc_runtime::reference::dense_attention;

// The module `quickstart`: layout constants, specialized encoders, PTX.
kv_format!("specs/quickstart.toml");

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let format = quickstart::format();
    let (kv_heads, q_heads, tokens, d) = (2, 8, 100, quickstart::HEAD_DIM);
    let wave = |i: usize, f: f32| (i as f32 * f).sin() + 0.3 * (i as f32 * f * 0.07).cos();
    // Keys and values are [kv_head][token][head_dim]; queries [q_head][head_dim].
    let keys: Vec<f32> = (0..kv_heads * tokens * d).map(|i| wave(i, 0.37)).collect();
    let values: Vec<f32> = (0..kv_heads * tokens * d).map(|i| wave(i, 0.11)).collect();
    // Each query looks for token 42 of its kv head.
    let group = q_heads / kv_heads;
    let queries: Vec<f32> = (0..q_heads * d)
        .map(|i| 3.0 * keys[((i / d / group) * tokens + 42) * d + i % d])
        .collect();

    // Fit the codebooks and scales, then encode with the generated encoders:
    // the last two pages in tier `high`, older ones in `low`.
    let tables = cache::train(format, &keys, &values, kv_heads, &TrainOptions::default())?;
    let mut cache = PagedCache::new(format, kv_heads, tables)?;
    let pages = tokens.div_ceil(quickstart::ITEMS_PER_PAGE);
    let tier_of_page = |p: usize| {
        if p + 2 < pages {
            quickstart::low::INDEX
        } else {
            quickstart::high::INDEX
        }
    };
    cache.append_sequence_with(&keys, &values, tier_of_page, quickstart::encode_page)?;
    println!(
        "{tokens} tokens x {kv_heads} kv heads in {} bytes of pages (a key item: {} B high, {} B low)",
        cache.page_bytes(),
        quickstart::high::key::BYTES,
        quickstart::low::key::BYTES,
    );

    // Decode attention on the CPU ...
    let cpu = JitExecutor::default().decode(&cache, &queries, q_heads)?;
    // Query head 0 against exact attention over kv head 0's original vectors.
    let (k0, v0) = (&keys[..tokens * d], &values[..tokens * d]);
    let exact = dense_attention(&queries[..d], k0, v0, d, 1.0 / (d as f32).sqrt()).output;
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let diff: Vec<f32> = cpu[..d].iter().zip(&exact).map(|(a, b)| a - b).collect();
    println!(
        "cpu (jit): relative error {:.4} against exact attention",
        norm(&diff) / norm(&exact)
    );

    // ... and on the GPU when there is one.
    match CudaExecutor::open() {
        Ok(gpu) => {
            let out = gpu.decode(&cache, &queries, q_heads)?;
            let diff = out
                .iter()
                .zip(&cpu)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            println!("gpu: largest difference from the cpu {diff:.2e}");
        }
        Err(e) => println!("gpu: none ({e})"),
    }

    // build.rs wrote the same PTX with kvcc_compiler::build::generate.
    let built = include_str!(concat!(env!("OUT_DIR"), "/quickstart/high.sm_90.ptx"));
    assert_eq!(built, quickstart::high::PTX_SM_90);
    println!("tier high: {} B of sm_90 PTX", built.len());
    Ok(())
}
