"""One model's quality run: the texts and prompts every cache is measured on,
the reference cache's results, and one row per measured cache."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .._kvcc import KvccError
from ..core import Format
from ..hf import sliding_layers
from .caches import CacheChoice, train_tables
from .measure import NeedleAnswer, Perplexity, agreement, generation, needle, perplexity, prefill
from .models import QualityModel
from .texts import essays, needle_prompt


@dataclass(frozen=True)
class Settings:
    """Sizes of one run. Perplexity: `prefill` tokens of the text, then
    `steps` teacher-forced decode steps. Needles: every `lengths` x `depths`
    cell (lengths count the answer's tokens too). Generation: `generate`
    greedy tokens after the text's first `generate_prompt` tokens. Tables:
    trained on the text's last `calibration` tokens, which no perplexity step
    reads. `question`: `"decode"` decodes a needle's question through the
    cache one token per step; `"prefill"` prefills it with the haystack
    (Quest's protocol), so only the answer is decoded."""

    prefill: int = 2048
    steps: int = 256
    lengths: Tuple[int, ...] = (1024, 2048, 4096, 8192)
    depths: Tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    answer_tokens: int = 7
    generate_prompt: int = 1024
    generate: int = 128
    calibration: int = 2048
    seed: int = 0
    question: str = "decode"


@dataclass
class Reference:
    """The reference cache's results every measured cache is compared with."""

    perplexity: Perplexity
    needles: List[NeedleAnswer]
    generated: List[int]


class Harness:
    """Measures caches on `qm` against `reference` (default: transformers'
    dense cache), all on the same tokens."""

    def __init__(
        self,
        qm: QualityModel,
        settings: Settings = Settings(),
        reference: Optional[CacheChoice] = None,
        progress: Optional[Callable[[str, int], None]] = None,
    ):
        self.qm, self.settings = qm, settings
        self.progress = progress or (lambda what, n: None)
        s = settings
        self.text = qm.encode(essays())
        tokens = self.text.shape[1]
        if s.prefill + s.steps + 1 + s.calibration > tokens:
            raise KvccError(
                f"the text holds {tokens} tokens: a prefill of {s.prefill}, {s.steps} steps and "
                f"{s.calibration} calibration tokens do not fit it apart"
            )
        for length in s.lengths:
            qm.check_context(length)
        qm.check_context(s.prefill + s.steps)
        qm.check_context(s.generate_prompt + s.generate)
        # A cell's needle depends on its length and depth alone, so runs over
        # other grids share the cells they have in common.
        self.prompts = [
            needle_prompt(
                qm.tokenizer, length - s.answer_tokens, depth,
                seed=(s.seed * 100_003 + length) * 1_009 + round(depth * 1000),
            )
            for length in s.lengths
            for depth in s.depths
        ]
        # Every prompt's forward pass, once: the same for every cache.
        self.text_prefill = prefill(qm, self.text[:, : s.prefill])
        self.generate_prefill = prefill(qm, self.text[:, : s.generate_prompt])
        if s.question not in ("decode", "prefill"):
            raise KvccError(f'question = {s.question!r}: "decode" or "prefill"')
        prefilled = (lambda p: p.ids + p.question) if s.question == "prefill" else (lambda p: p.ids)
        self.haystacks = [
            prefill(qm, torch.tensor([prefilled(p)], device=qm.device)) for p in self.prompts
        ]
        self._kv = None
        self._tables: Dict[str, list] = {}
        self.reference_choice = reference or CacheChoice.dense()
        self.reference = Reference(*self._measure(self.reference_choice))

    @property
    def steps_per_cache(self) -> int:
        """Decode steps one cache's measurements take (the progress total)."""
        s = self.settings
        question = len(self.prompts[0].question) if self.prompts and s.question == "decode" else 0
        per_needle = question + s.answer_tokens if self.prompts else 0
        return s.steps + len(self.prompts) * per_needle + s.generate

    def tables(self, fmt: Format) -> list:
        """`fmt`'s tables per layer, trained once on the calibration tokens."""
        if fmt.name not in self._tables:
            if self._kv is None:
                self._kv = prefill(self.qm, self.text[:, -self.settings.calibration :]).kv
            self._tables[fmt.name] = train_tables(self.qm, fmt, self._kv, seed=self.settings.seed)
        return self._tables[fmt.name]

    def choice(self, fmt: Format, tier: str, policy: str, **kwargs) -> CacheChoice:
        self.qm.check_format(fmt)
        return CacheChoice.kvcc(fmt, tier, policy, self.tables(fmt), **kwargs)

    def _measure(self, choice: CacheChoice):
        s, qm = self.settings, self.qm
        ppl = perplexity(qm, choice, self.text, self.text_prefill, s.steps)
        self.progress(choice.label, s.steps)
        answers, cache = [], None
        for prompt, haystack in zip(self.prompts, self.haystacks):
            if not choice.is_dense:
                cache = choice.open(qm, max(s.lengths), previous=cache)
            answers.append(
                needle(qm, choice, prompt, haystack, s.answer_tokens, cache, s.question == "decode")
            )
            question = len(prompt.question) if s.question == "decode" else 0
            self.progress(choice.label, question + s.answer_tokens)
        tokens = generation(qm, choice, self.generate_prefill, s.generate)
        self.progress(choice.label, s.generate)
        return ppl, answers, tokens

    def row(self, choice: CacheChoice, measured=None) -> dict:
        """Measures `choice` (or takes its measurements) and compares it with the reference."""
        start = time.perf_counter()
        ppl, answers, tokens = measured or self._measure(choice)
        s, ref = self.settings, self.reference
        top1 = sum(a == b for a, b in zip(ppl.top1, ref.perplexity.top1)) / len(ppl.top1)
        greedy = agreement(ref.generated, tokens)
        context = s.prefill + s.steps
        dense_f16 = 2 * self.qm.head_dim * 2
        bytes_per_token = choice.bytes_per_token(self.qm, context)
        return {
            "cache": choice.label,
            "spec": choice.format.name if choice.format else "default",
            "tier": choice.tier_label or str(self.qm.model.dtype).removeprefix("torch."),
            "policy": choice.policy if choice.format else "-",
            "sinks": choice.sinks,
            "window": choice.window,
            "bytes_per_token": bytes_per_token,
            "compression": dense_f16 / bytes_per_token,
            "ppl": ppl.value,
            "delta_ppl": ppl.value - ref.perplexity.value,
            "delta_ppl_rel": ppl.value / ref.perplexity.value - 1.0,
            "top1_agreement": top1,
            "needle_accuracy": sum(a.found for a in answers) / max(1, len(answers)),
            "needle_same_as_reference": sum(
                a.generated == b.generated for a, b in zip(answers, ref.needles)
            ) / max(1, len(answers)),
            "needles": [asdict(a) for a in answers],
            "greedy_agreement": greedy.rate,
            "greedy_first_difference": greedy.first_difference,
            "greedy_tokens": greedy.tokens,
            "seconds": time.perf_counter() - start,
        }

    def reference_row(self) -> dict:
        r = self.reference
        return self.row(self.reference_choice, (r.perplexity, r.needles, r.generated))

    def describe(self) -> dict:
        """What every row was measured on."""
        qm, s = self.qm, self.settings
        return {
            "model": qm.name,
            "device": torch.cuda.get_device_name(qm.device) if qm.device.type == "cuda" else "cpu",
            "dtype": str(qm.model.dtype).removeprefix("torch."),
            "layers": qm.layers,
            "kvcc_layers": sum(not s for s in sliding_layers(qm.config)),
            "q_heads": qm.config.num_attention_heads,
            "kv_heads": qm.kv_heads,
            "head_dim": qm.head_dim,
            "max_context": qm.max_context,
            "reference_ppl": self.reference.perplexity.value,
            "reference_needle_accuracy": sum(a.found for a in self.reference.needles)
            / max(1, len(self.reference.needles)),
            "settings": asdict(s),
        }


def measure(
    qm: QualityModel, choices: List[CacheChoice], settings: Settings = Settings()
) -> List[dict]:
    """Rows for the reference and every cache in `choices` (whose tables the
    caller trained)."""
    harness = Harness(qm, settings)
    return [harness.reference_row()] + [harness.row(c) for c in choices]
