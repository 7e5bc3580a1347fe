"""Thin wrapper over a Hugging Face causal LM: prefill, forward over k new tokens with a KV cache, crop, hidden states.

Every decoder drives the target (and a draft model) through this one class, so KV handling lives in one place.
It also accepts a custom 4-D attention mask and explicit positions, which tree verification will need.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from .model_registry import resolve_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@lru_cache(maxsize=1)
def cpu_supports_bf16() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """auto = bf16 where the hardware runs it fast (avx512_bf16/AMX CPUs, bf16 GPUs), else fp32 (fp16 on old GPUs)."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
        return DTYPES[dtype]
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [num_logits, vocab] float32: next-token logits after each of the last num_logits inputs
    hidden: torch.Tensor | None = None  # [num_inputs, hidden] of the requested layer, if asked for


class ModelRunner:
    """One loaded model. Caches are separate objects, so one runner serves many sequences."""

    def __init__(self, model, tokenizer, name: str, device: str, dtype: torch.dtype):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.device = device
        self.dtype = dtype
        config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids = _eos_ids(model, tokenizer)

    @classmethod
    def load(cls, name: str, dtype: str = "auto", device: str = "auto") -> "ModelRunner":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, device)
        path = resolve_model_path(name)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
        model.eval()
        if device == "cpu":
            tune_for_cpu(model)
        return cls(model, tokenizer, name, device, torch_dtype)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(
        self,
        cache,
        input_ids: list[int],
        num_logits: int = 1,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        hidden_layer: int | None = None,
    ) -> ForwardOutput:
        """Run input_ids after what the cache holds; the cache grows by len(input_ids).

        Only the last num_logits positions go through the LM head: a 1000-token prefill with full logits would
        materialise 1000 x vocab floats for nothing.
        """
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)  # [1, T]
        past = cache.get_seq_length()
        kwargs = {}
        if attention_mask is not None:
            # 4-D float mask [1, 1, T, past + T]: 0 where a token may attend, dtype-min elsewhere (tree attention).
            kwargs["attention_mask"] = attention_mask.to(self.device, self.dtype)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(self.device).view(1, -1)
        out = self.model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(past, past + len(input_ids), device=self.device),
            logits_to_keep=num_logits,
            output_hidden_states=hidden_layer is not None,
            **kwargs,
        )
        logits = out.logits[0, -num_logits:].float()  # [num_logits, vocab]
        hidden = out.hidden_states[hidden_layer][0] if hidden_layer is not None else None  # [T, hidden]
        return ForwardOutput(logits=logits, hidden=hidden)

    @staticmethod
    def crop(cache, length: int) -> None:
        """Drop cached positions >= length (rejected draft tokens)."""
        excess = cache.get_seq_length() - length
        if excess > 0:
            cache.crop(-excess)  # transformers 5.x: a negative count drops that many tokens from the end


class OneDnnLinear(torch.nn.Module):
    """fp32 LM head through oneDNN: measured on this 2-core AVX2 CPU, [11, 576] x [576, 49152] takes 12 ms instead
    of MKL's 36 ms, and one row 6 ms instead of 11 ms. The head is the largest matmul of a small model's forward."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(hidden, self.weight, self.bias, "none", [], "")


def tune_for_cpu(model) -> None:
    """CPU-only speed-ups that leave the numbers identical in every decoder (AR included), so losslessness holds."""
    # Let SDPA handle grouped-query attention itself even with a mask (multi-token verify forwards): otherwise
    # transformers copies every cached K/V head n_rep times per layer per forward (~20% of an 11-token forward).
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    head = model.get_output_embeddings()
    usable = (
        isinstance(head, torch.nn.Linear)
        and head.weight.dtype == torch.float32
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and torch.backends.mkldnn.is_available()
    )
    if usable:
        model.set_output_embeddings(OneDnnLinear(head))


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
