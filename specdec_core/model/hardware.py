"""Which device and dtype a model runs in: `auto` resolved from what the machine runs fast."""

from __future__ import annotations

from functools import lru_cache

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A drafter-only choice: int8 weights in every linear layer (quantize_int8). A drafter's numbers decide only what is
# proposed, never what is accepted, so every method stays lossless; a target in int8 would be another model, so
# targets are refused it.
INT8 = "int8"


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
