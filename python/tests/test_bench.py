"""The model-level benches run end to end at a small size."""

from kvcc.bench import decode, embeddings


def test_embedding_bench_runs_offline():
    rows = embeddings.main(["--sentences", "24", "--calibration", "8", "--specs", "dense_f16,kivi"])
    assert [(r["spec"], r["tier"]) for r in rows] == [("dense_f16", "f16"), ("kivi", "int8"), ("kivi", "int4")]
    assert rows[0]["cos_min"] > 0.9999
    assert all(0.9 < r["cos_mean"] <= 1.0 + 1e-6 for r in rows)


def test_decode_bench_runs_tiny_on_the_cpu():
    rows = decode.main(["--device", "cpu", "--tiny", "--spec", "dense_f16", "--contexts", "200"])
    (row,) = rows
    assert row["same_tokens"] == 1.0
    assert row["kvcc_tokens_per_s"] > 0 and row["sdpa_tokens_per_s"] > 0
