"""kvcc as a vLLM attention backend (`AttentionBackendEnum.CUSTOM`), the
skeleton docs/vllm.md describes. Importing it needs vLLM; running it needs
the CUDA live cache, which is not in this build: the impl's constructor says
so. The translation it relies on is `kvcc.vllm` (tested on the CPU).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionImpl

from .vllm import BlockLayout, backend_options


class KvccAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    # Encoding a full block happens in do_kv_cache_update, outside the
    # captured decode step.
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list] = [torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return KvccAttentionImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        from vllm.config import get_current_vllm_config

        options = backend_options(get_current_vllm_config().additional_config)
        layout = BlockLayout.of(
            options["spec"], block_size, num_kv_heads,
            options.get("tier"), options.get("sinks"), options.get("window"),
        )
        return layout.kv_cache_shape(num_blocks)


class KvccAttentionImpl(AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, *args, **kwargs):
        raise NotImplementedError(
            "kvcc's vLLM backend needs the CUDA live cache, which is not in this "
            "build of the kvcc package"
        )
