//! End-to-end tests of the `kvcc` binary: `check`, `eval` (safetensors and
//! npy inputs) and `demo`, text and `--json` output, and the error paths a
//! user hits first (bad spec, missing file, head_dim mismatch).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kvcc_compiler::Format;
use kvcc_runtime::builtin::SPECS;
use kvcc_runtime::synth::{synthesize, SynthOptions};
use kvcc_runtime::tensor_io::{save_qkv_safetensors, write_npy, Qkv, Tensor4};
use serde_json::Value;

const SPHERICAL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/spherical.toml");

fn kvcc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvcc"))
        .args(args)
        .output()
        .expect("run kvcc")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `kvcc args`, asserts success, returns stdout.
fn ok(args: &[&str]) -> String {
    let out = kvcc(args);
    assert!(
        out.status.success(),
        "kvcc {args:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

/// Runs `kvcc args`, asserts a non-zero exit without a panic, returns stderr.
fn fails(args: &[&str]) -> String {
    let out = kvcc(args);
    let stderr = text(&out.stderr);
    assert!(
        !out.status.success(),
        "kvcc {args:?} should fail, but exited 0; stdout:\n{}",
        text(&out.stdout)
    );
    assert!(
        out.status.code().is_some(),
        "kvcc {args:?} died of a signal: {}",
        out.status
    );
    assert!(
        !stderr.contains("panicked"),
        "kvcc {args:?} panicked instead of reporting an error:\n{stderr}"
    );
    assert!(
        stderr.starts_with("error: "),
        "kvcc {args:?}: expected an `error: ...` message, got:\n{stderr}"
    );
    stderr
}

fn json(stdout: &str) -> Value {
    serde_json::from_str(stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{stdout}"))
}

fn num(v: &Value, what: &str) -> f64 {
    v.as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"))
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

// ---------------------------------------------------------------------------
// check
// ---------------------------------------------------------------------------

#[test]
fn check_prints_spherical_key_bytes_per_tier() {
    let stdout = ok(&["check", SPHERICAL]);
    assert!(
        stdout.contains("format spherical (head_dim 128"),
        "{stdout}"
    );
    // The table's columns are separated by two or more spaces (descriptions hold single ones).
    let cells = |line: &str| -> Vec<String> {
        line.split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect()
    };
    let header = stdout
        .lines()
        .find(|l| l.starts_with("tier "))
        .map(cells)
        .unwrap_or_else(|| panic!("no table header:\n{stdout}"));
    let column = |name: &str| {
        header
            .iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("no column {name:?} in {header:?}"))
    };
    let (key_col, value_col) = (column("K B/item"), column("V B/item"));
    for (tier, key_bytes) in [("high", "14"), ("mid", "12"), ("low", "6")] {
        let row = stdout
            .lines()
            .find(|l| l.split_whitespace().next() == Some(tier))
            .map(cells)
            .unwrap_or_else(|| panic!("no row for tier {tier}:\n{stdout}"));
        assert_eq!(row.len(), header.len(), "row {row:?} vs header {header:?}");
        assert_eq!(row[key_col], key_bytes, "{tier}: key bytes in {row:?}");
        assert_eq!(row[value_col], "256", "{tier}: value bytes in {row:?}");
    }
}

#[test]
fn check_json_reports_key_and_value_bytes() {
    let report = json(&ok(&["check", SPHERICAL, "--json"]));
    assert_eq!(report["format"], "spherical");
    assert_eq!(report["head_dim"], 128);
    let tiers = report["tiers"].as_array().expect("tiers array");
    let names: Vec<&str> = tiers
        .iter()
        .map(|t| t["tier"].as_str().expect("tier name"))
        .collect();
    assert_eq!(names, ["high", "mid", "low"]);
    for (t, key_bytes) in tiers.iter().zip([14, 12, 6]) {
        assert_eq!(t["key_bytes"], key_bytes, "{t}");
        assert_eq!(t["value_bytes"], 256, "{t}");
        let compression = num(&t["compression"], "compression");
        assert!(compression.is_finite() && compression > 1.0, "{t}");
    }
}

#[test]
fn check_reports_bad_spec_with_file_line_column_and_field_path() {
    let dir = tempfile::tempdir().unwrap();
    // An unsupported value (semantic check) and a wrong type (parse error).
    let cases = [
        (
            "bits5.toml",
            "name = \"bad\"\nhead_dim = 64\n\n[[tier]]\nname = \"x\"\nkey.field = [{ kind = \"coeff\", bits = 5, scale = \"item\" }]\nvalue.field = [{ kind = \"dense\", dtype = \"f16\" }]\n",
            ":6:39:",
            "tier[0].key.field[0].bits",
        ),
        (
            "type.toml",
            "name = \"bad\"\nhead_dim = \"64\"\n\n[[tier]]\nname = \"x\"\nkey.field = [{ kind = \"dense\", dtype = \"f16\" }]\nvalue.field = [{ kind = \"dense\", dtype = \"f16\" }]\n",
            ":2:12:",
            "head_dim",
        ),
    ];
    for (file, source, line_col, field) in cases {
        let path = dir.path().join(file);
        std::fs::write(&path, source).unwrap();
        for extra in [None, Some("--json")] {
            let mut args = vec!["check", path_str(&path)];
            args.extend(extra);
            let stderr = fails(&args);
            let location = format!("{}{line_col}", path.display());
            assert!(
                stderr.contains(&location),
                "{file}: expected {location:?} in:\n{stderr}"
            );
            assert!(
                stderr.contains(&format!("{line_col} {field}: ")),
                "{file}: expected the field path {field:?} in:\n{stderr}"
            );
        }
    }
}

#[test]
fn check_missing_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no-such-spec.toml");
    let stderr = fails(&["check", path_str(&path)]);
    assert!(
        stderr.contains(&path.display().to_string()),
        "the message should name the file:\n{stderr}"
    );
    assert!(
        stderr.contains("No such file") || stderr.contains("not found"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "one line is enough:\n{stderr}");
}

#[test]
fn check_rejects_a_huge_head_dim_with_divisor_suggestions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.toml");
    std::fs::write(
        &path,
        "name = \"huge\"\nhead_dim = 2147483647\n\n[[tier]]\nname = \"x\"\nkey.field = [{ kind = \"coeff\", bits = 4, scale = \"item\" }]\nvalue.field = [{ kind = \"radius\", group_size = 16, bits = 8, scale = \"page\" }, { kind = \"codebook\", group_size = 16, bits = 4, codewords = \"direction\" }]\n",
    )
    .unwrap();
    let stderr = fails(&["check", path_str(&path)]);
    assert!(
        stderr.contains(
            "tier[0].value.field[0].group_size: group_size 16 does not divide the codec's 2147483647 dimensions (head_dim); use a divisor of 2147483647 such as 1 or 2147483647"
        ),
        "{stderr}"
    );
}

#[test]
fn check_reports_a_spec_that_is_not_utf8_at_the_byte() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("latin1.toml");
    std::fs::write(&path, b"name = \"x\"\nhead_dim = 64 # caf\xe9\n").unwrap();
    let stderr = fails(&["check", path_str(&path)]);
    assert!(
        stderr.contains(&format!(
            "{}:2:20: the spec is not UTF-8: byte 0xe9 at byte offset 30",
            path.display()
        )),
        "{stderr}"
    );
}

#[test]
fn check_says_which_context_it_amortizes_over() {
    let default = ok(&["check", SPHERICAL]);
    assert!(
        default.contains("headers and tables over 32768 tokens"),
        "{default}"
    );
    let short = ok(&["check", SPHERICAL, "--context", "256"]);
    assert!(
        short.contains("headers and tables over 256 tokens"),
        "{short}"
    );
    let bytes = |args: &[&str]| {
        let report = json(&ok(args));
        num(&report["tiers"][0]["effective_bytes_per_token"], "bytes")
    };
    let long = bytes(&["check", SPHERICAL, "--json"]);
    let short = bytes(&["check", SPHERICAL, "--json", "--context", "256"]);
    assert!(
        short > long,
        "tables weigh more over 256 tokens: {short} vs {long}"
    );
}

#[test]
fn check_json_carries_the_cache_policy_that_the_text_prints() {
    let shard = concat!(env!("CARGO_MANIFEST_DIR"), "/../specs/shard.toml");
    let args = ["check", shard, "--context", "32768"];
    let report = json(&ok(&[&args[..], &["--json"]].concat()));
    let cache = &report["cache"];
    assert_eq!(cache["sinks"], 4, "{cache}");
    assert_eq!(cache["window"], 64, "{cache}");
    assert_eq!(cache["exact"], "f16", "{cache}");
    assert_eq!(cache["tier"], "pca64_vq", "{cache}");
    assert_eq!(cache["keeps_exact"], true, "{cache}");
    assert_eq!(cache["context"], 32768, "{cache}");
    // 4 sinks, then whole 64-token pages while 64 tokens stay behind them:
    // (32768 - 4 - 64) / 64 = 510 pages, 32764 - 510 * 64 = 124 tail tokens.
    assert_eq!(cache["split"]["sinks"], 4, "{cache}");
    assert_eq!(cache["split"]["pages"], 510, "{cache}");
    assert_eq!(cache["split"]["tail"], 124, "{cache}");
    assert_eq!(cache["exact_tokens"], 128, "{cache}");
    assert_eq!(cache["exact_row_bytes"], 2 * 128 * 2, "{cache}");
    let tier = &cache["tiers"][0];
    assert_eq!(tier["tier"], "pca64_vq", "{tier}");
    assert_eq!(tier["policy_tier"], true, "{tier}");
    let with = num(&tier["bytes_per_token"], "bytes_per_token");
    let without = num(
        &tier["all_pages_bytes_per_token"],
        "all_pages_bytes_per_token",
    );
    // The 128 exact rows (512 B each) replace two pages' worth of 66 B tokens.
    let exact_share = 128.0 * 512.0 / 32768.0;
    assert!(
        with > without && with > exact_share && with < exact_share + without,
        "{tier}"
    );
    let compression = num(&tier["compression"], "compression");
    assert!((compression - 512.0 / with).abs() < 1e-9, "{tier}");
    // The text shows the same numbers.
    let text = ok(&args);
    for fact in [
        "cache policy: sinks 4 + window 64 exact (f16), whole pages in `pca64_vq`".to_string(),
        "at 32768 tokens: 4 sinks + 510 pages + 124 tail tokens".to_string(),
        format!("{with:.2}"),
        format!("{without:.2}"),
    ] {
        assert!(text.contains(&fact), "{fact:?} not in:\n{text}");
    }
    // A spec without a [cache] table keeps nothing exact.
    let report = json(&ok(&["check", SPHERICAL, "--json"]));
    let cache = &report["cache"];
    assert_eq!(
        (cache["sinks"].clone(), cache["window"].clone()),
        (0.into(), 0.into()),
        "{cache}"
    );
    assert_eq!(cache["keeps_exact"], false, "{cache}");
    assert_eq!(cache["tier"], "high", "{cache}");
    for tier in cache["tiers"].as_array().expect("tiers") {
        assert_eq!(
            tier["bytes_per_token"], tier["all_pages_bytes_per_token"],
            "{tier}"
        );
    }
}

// ---------------------------------------------------------------------------
// eval
// ---------------------------------------------------------------------------

const D: usize = 64;
const LAYERS: usize = 2;
const KV_HEADS: usize = 2;
const Q_HEADS: usize = 4;
const TOKENS: usize = 100;
const Q_TOKENS: usize = 16;

const DENSE_F32: &str = r#"
name = "dense_f32"
head_dim = 64

[page]
items = 64

[[tier]]
name = "f32"
key.field = [{ kind = "dense", dtype = "f32" }]
value.field = [{ kind = "dense", dtype = "f32" }]
"#;

const KIVI8_64: &str = r#"
name = "kivi8_64"
head_dim = 64

[page]
items = 64

[[tier]]
name = "int8"
key.field = [{ kind = "coeff", bits = 8, scale = "page_component" }]
value.field = [{ kind = "coeff", bits = 8, scale = "item" }]
"#;

/// Structured K/V/Q, `[layers, heads, tokens, head_dim]`: each layer is one
/// synthetic sequence (its own seed). Synth makes one decode query per query
/// head, so it is asked for `Q_TOKENS` times as many query heads; query token
/// `r` of head `h` is synth query head `g * group + (h % q_group) * Q_TOKENS + r`
/// for the kv head `g` that `h` reads, which keeps every query aimed at its
/// own kv head's keys.
fn synthetic_qkv() -> Qkv {
    let q_group = Q_HEADS / KV_HEADS;
    let group = q_group * Q_TOKENS;
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for layer in 0..LAYERS {
        let s = synthesize(&SynthOptions {
            seed: 40 + layer as u64,
            kv_heads: KV_HEADS,
            q_heads: KV_HEADS * group,
            tokens: TOKENS,
            head_dim: D,
        });
        k.extend_from_slice(&s.keys);
        v.extend_from_slice(&s.values);
        for h in 0..Q_HEADS {
            let g = h / q_group;
            for r in 0..Q_TOKENS {
                let synth_head = g * group + (h % q_group) * Q_TOKENS + r;
                assert_eq!(s.kv_head_of(synth_head), g);
                q.extend_from_slice(s.query(synth_head));
            }
        }
    }
    Qkv {
        q: Tensor4 {
            shape: [LAYERS, Q_HEADS, Q_TOKENS, D],
            data: q,
        },
        k: Tensor4 {
            shape: [LAYERS, KV_HEADS, TOKENS, D],
            data: k,
        },
        v: Tensor4 {
            shape: [LAYERS, KV_HEADS, TOKENS, D],
            data: v,
        },
    }
}

struct Fixture {
    dir: tempfile::TempDir,
    safetensors: PathBuf,
    /// `<stem>` of `<stem>.{q,k,v}.npy`.
    npy_stem: PathBuf,
}

impl Fixture {
    fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let qkv = synthetic_qkv();
        let safetensors = dir.path().join("dump.safetensors");
        save_qkv_safetensors(&safetensors, "model.layers", &qkv).unwrap();
        let npy_stem = dir.path().join("dump");
        for (role, t) in [("q", &qkv.q), ("k", &qkv.k), ("v", &qkv.v)] {
            write_npy(&dir.path().join(format!("dump.{role}.npy")), t).unwrap();
        }
        std::fs::write(dir.path().join("dense_f32.toml"), DENSE_F32).unwrap();
        std::fs::write(dir.path().join("kivi8_64.toml"), KIVI8_64).unwrap();
        Fixture {
            dir,
            safetensors,
            npy_stem,
        }
    }

    fn spec(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }

    fn eval(&self, spec: &str, qkv: &Path) -> Value {
        let report = json(&ok(&[
            "eval",
            path_str(&self.spec(spec)),
            "--qkv",
            path_str(qkv),
            "--json",
        ]));
        assert_eq!(report["layers"], LAYERS, "{report}");
        assert_eq!(report["q_heads"], Q_HEADS, "{report}");
        assert_eq!(report["kv_heads"], KV_HEADS, "{report}");
        assert_eq!(report["tokens"], TOKENS, "{report}");
        assert_eq!(report["query_rows"], Q_TOKENS, "{report}");
        report
    }
}

/// The single tier's fidelity of a one-tier report.
fn only_row(report: &Value, tier: &str) -> Value {
    let rows = report["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 1, "one tier, no mixed row: {report}");
    assert_eq!(rows[0]["tier"], tier);
    assert_eq!(
        rows[0]["fidelity"]["rows"],
        LAYERS * Q_HEADS * Q_TOKENS,
        "{report}"
    );
    rows[0]["fidelity"].clone()
}

#[test]
fn eval_dense_f32_is_exact_on_safetensors_and_npy() {
    let fx = Fixture::new();
    let inputs = [
        fx.safetensors.clone(),
        fx.npy_stem.clone(),
        fx.dir.path().join("dump.k.npy"),
    ];
    let mut seen = Vec::new();
    for input in &inputs {
        let f = only_row(&fx.eval("dense_f32.toml", input), "f32");
        let err = num(&f["output_rel_error"], "output_rel_error");
        let drift = num(&f["max_logit_drift"], "max_logit_drift");
        assert!(err <= 1e-5, "{}: output_rel_error {err}", input.display());
        assert!(
            drift <= 1e-4,
            "{}: max_logit_drift {drift}",
            input.display()
        );
        assert_eq!(
            num(&f["top8_overlap"], "top8_overlap"),
            1.0,
            "{}",
            input.display()
        );
        seen.push(f);
    }
    // The same tensors through either container give the same numbers.
    assert!(
        seen.windows(2).all(|w| w[0] == w[1]),
        "safetensors and npy disagree: {seen:?}"
    );
}

#[test]
fn eval_kivi_int8_is_lossy_but_close() {
    let fx = Fixture::new();
    let mut seen = Vec::new();
    for input in [&fx.safetensors, &fx.npy_stem] {
        let f = only_row(&fx.eval("kivi8_64.toml", input), "int8");
        let err = num(&f["output_rel_error"], "output_rel_error");
        assert!(
            err > 0.0 && err < 0.02,
            "{}: output_rel_error {err}",
            input.display()
        );
        assert!(num(&f["max_logit_drift"], "max_logit_drift") > 0.0);
        seen.push(f);
    }
    assert_eq!(seen[0], seen[1], "safetensors and npy disagree");
}

#[test]
fn eval_text_output_names_the_tier() {
    let fx = Fixture::new();
    let stdout = ok(&[
        "eval",
        path_str(&fx.spec("kivi8_64.toml")),
        "--qkv",
        path_str(&fx.safetensors),
    ]);
    assert!(stdout.starts_with("kvcc eval kivi8_64: 2 layers, 4 query heads over 2 kv heads, 100 tokens, 16 query rows per head"), "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("int8 ")), "{stdout}");
}

#[test]
fn eval_rejects_head_dim_mismatch() {
    let fx = Fixture::new();
    for input in [&fx.safetensors, &fx.npy_stem] {
        let stderr = fails(&["eval", SPHERICAL, "--qkv", path_str(input)]);
        assert!(
            stderr.contains("head_dim is 128 but the tensors' is 64"),
            "{stderr}"
        );
    }
}

#[test]
fn eval_missing_input_is_a_clear_error() {
    let fx = Fixture::new();
    let missing = fx.dir.path().join("missing.safetensors");
    let stderr = fails(&[
        "eval",
        path_str(&fx.spec("dense_f32.toml")),
        "--qkv",
        path_str(&missing),
    ]);
    assert!(stderr.contains(&missing.display().to_string()), "{stderr}");
}

/// q's tokens are the query rows scored against every key of their layer, so
/// q may hold fewer tokens than k and v (here 16 against 100).
#[test]
fn eval_scores_q_rows_against_all_keys_when_token_counts_differ() {
    let fx = Fixture::new();
    let report = fx.eval("dense_f32.toml", &fx.safetensors);
    assert_ne!(Q_TOKENS, TOKENS);
    assert_eq!(report["query_rows"], Q_TOKENS, "{report}");
    let f = only_row(&report, "f32");
    assert!(
        num(&f["output_rel_error"], "output_rel_error") <= 1e-5,
        "{f}"
    );
}

#[test]
fn eval_amortizes_over_the_dump_tokens_and_says_so() {
    let fx = Fixture::new();
    let spec = fx.spec("kivi8_64.toml");
    let input = path_str(&fx.safetensors);
    let stdout = ok(&["eval", path_str(&spec), "--qkv", input]);
    assert!(
        stdout.contains(
            "B/token per kv head over 100 tokens, headers, partial pages and tables included"
        ),
        "{stdout}"
    );
    let own = fx.eval("kivi8_64.toml", &fx.safetensors);
    assert_eq!(own["context"], TOKENS, "{own}");
    let long = json(&ok(&[
        "eval",
        path_str(&spec),
        "--qkv",
        input,
        "--json",
        "--context",
        "32768",
    ]));
    assert_eq!(long["context"], 32768, "{long}");
    let bytes = |r: &Value| num(&r["rows"][0]["bytes_per_token"], "bytes_per_token");
    // 100 tokens fill one whole page of 64 and 36 of the next.
    assert!(bytes(&own) > bytes(&long), "{own}\n{long}");
}

#[test]
fn eval_reports_progress_per_layer_step() {
    let format = Format::parse(KIVI8_64, "kivi8_64.toml").unwrap();
    let qkv = synthetic_qkv();
    let mut seen = Vec::new();
    kvcc_runtime::cli::eval::run(
        &format,
        &qkv,
        4,
        None,
        kvcc_runtime::exec::ExecutorKind::Interp,
        None,
        |done, total| seen.push((done, total)),
    )
    .unwrap();
    // Per layer: training, then the one tier.
    let total = LAYERS * 2;
    let expected: Vec<(usize, usize)> = (0..=total).map(|done| (done, total)).collect();
    assert_eq!(seen, expected);
}

// ---------------------------------------------------------------------------
// demo
// ---------------------------------------------------------------------------

#[test]
fn demo_json_has_a_row_per_bundled_tier_plus_mixed() {
    let rows = json(&ok(&["demo", "--json", "--tokens", "200"]));
    let rows = rows.as_array().expect("array of rows");
    let mut expected = Vec::new();
    for (file, source) in SPECS {
        let format = Format::parse(source, file).unwrap_or_else(|e| panic!("{file}: {e}"));
        let tiers = format.tiers().len();
        expected
            .extend((0..tiers).map(|t| (format.name().to_string(), format.layout(t).name.clone())));
        if tiers > 1 {
            expected.push((format.name().to_string(), "mixed".to_string()));
        }
    }
    let got: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["format"].as_str().expect("format").to_string(),
                r["tier"].as_str().expect("tier").to_string(),
            )
        })
        .collect();
    assert_eq!(got, expected);
    for r in rows {
        for key in ["bytes_per_token", "compression", "interpreter_ms"] {
            let x = num(&r[key], key);
            assert!(x.is_finite() && x >= 0.0, "{key} in {r}");
        }
        let f = &r["fidelity"];
        for key in [
            "output_rel_error",
            "max_logit_drift",
            "mean_logit_drift",
            "top8_overlap",
        ] {
            let x = num(&f[key], key);
            assert!(x.is_finite() && x >= 0.0, "{key} in {r}");
        }
        assert!(num(&f["top8_overlap"], "top8_overlap") <= 1.0, "{r}");
        assert!(num(&f["rows"], "rows") > 0.0, "{r}");
    }
    let dense = rows
        .iter()
        .find(|r| r["format"] == "dense_f16")
        .expect("dense_f16 row");
    let err = num(&dense["fidelity"]["output_rel_error"], "output_rel_error");
    assert!(err < 1e-3, "dense_f16 output_rel_error {err}");
}

#[test]
fn demo_amortizes_over_its_own_tokens_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(SPHERICAL, dir.path().join("spherical.toml")).unwrap();
    let specs = path_str(dir.path());
    let stdout = ok(&["demo", "--specs", specs, "--tokens", "256"]);
    assert!(
        stdout.contains(
            "(B/token per kv head over 256 tokens, headers, partial pages and tables included)"
        ),
        "{stdout}"
    );
    let bytes = |args: &[&str]| {
        let rows = json(&ok(args));
        num(&rows[0]["bytes_per_token"], "bytes_per_token")
    };
    let own = bytes(&["demo", "--specs", specs, "--tokens", "256", "--json"]);
    let long = bytes(&[
        "demo",
        "--specs",
        specs,
        "--tokens",
        "256",
        "--json",
        "--context",
        "32768",
    ]);
    assert!(
        own > long,
        "spherical's codebooks over 256 tokens: {own} vs {long}"
    );
}

#[test]
fn eval_with_a_cache_policy_scores_each_tier_held_exactly_at_the_ends() {
    let fx = Fixture::new();
    let report = json(&ok(&[
        "eval",
        path_str(&fx.spec("kivi8_64.toml")),
        "--qkv",
        path_str(&fx.safetensors),
        "--sinks",
        "4",
        "--window",
        "16",
        "--json",
    ]));
    let row = &report["rows"][0];
    let policy = &row["policy"];
    assert_eq!(
        (policy["sinks"].clone(), policy["window"].clone()),
        (4.into(), 16.into()),
        "{row}"
    );
    assert_eq!(
        policy["fidelity"]["rows"],
        LAYERS * Q_HEADS * Q_TOKENS,
        "{row}"
    );
    // Exact rows cost more bytes than the pages they replace, and keep
    // attention closer to dense.
    assert!(num(&policy["bytes_per_token"], "bytes") > num(&row["bytes_per_token"], "bytes"));
    let err = |r: &Value| num(&r["fidelity"]["output_rel_error"], "output_rel_error");
    assert!(err(policy) < err(row), "{row}");
    // Without a policy in the spec or on the command line, rows carry none.
    let plain = fx.eval("kivi8_64.toml", &fx.safetensors);
    assert!(plain["rows"][0].get("policy").is_none(), "{plain}");
}

#[test]
fn eval_with_budgets_holds_each_cache_within_them() {
    let fx = Fixture::new();
    let spec = fx.spec("kivi8_64.toml");
    let report = json(&ok(&[
        "eval",
        path_str(&spec),
        "--qkv",
        path_str(&fx.safetensors),
        "--sinks",
        "4",
        "--window",
        "8",
        "--budget",
        "60,200",
        "--json",
    ]));
    let rows = report["rows"].as_array().expect("rows");
    // Per budget: the controller, the spec's one tier alone, KIVI int8 and int4 alone.
    assert_eq!(rows.len(), 2 * 4, "{report}");
    assert_eq!(report["observed_rows"], Q_TOKENS / 2, "{report}");
    assert_eq!(report["scored_rows"], Q_TOKENS / 2, "{report}");
    for row in rows {
        let budget = num(&row["budget"], "budget");
        let bytes = num(&row["bytes_per_token"], "bytes_per_token");
        let dropped = num(&row["dropped"], "dropped");
        assert!(bytes <= budget + 1e-9, "{row}");
        assert!((0.0..=1.0).contains(&dropped), "{row}");
        assert_eq!(
            row["fidelity"]["rows"],
            LAYERS * Q_HEADS * Q_TOKENS / 2,
            "{row}"
        );
    }
    let dropped = |i: usize| num(&rows[i]["dropped"], "dropped");
    assert!(
        dropped(0) > dropped(4),
        "a smaller budget drops more: {report}"
    );
    let error = fails(&[
        "eval",
        path_str(&spec),
        "--qkv",
        path_str(&fx.safetensors),
        "--budget",
        "0",
    ]);
    assert!(error.contains("--budget 0"), "{error}");
}
