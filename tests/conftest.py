"""Shared fixtures: the real default model in fp32 (exactness) with itself in bf16 as an imperfect draft model."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def engine():
    import torch

    from specdec_core.engine import Engine, EngineConfig

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    return Engine(EngineConfig(model="smollm2-135m", dtype="float32", device="cpu", drafter="smollm2-135m",
                               drafter_dtype="bfloat16"))
