"""Shared fixtures: the real default model in fp32 (exactness), and as an imperfect draft model a copy of it whose
decoder layers carry seeded noise. Hooks: the `slow` marker is enforced (tests/slow_marker.py)."""

import os

import pytest

from tests.slow_marker import RuntimeGuard, check_collected

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def engine():
    import torch

    from specdec_core.engine import Engine, EngineConfig

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    # Methods share prompt prefixes and step costs: the tests compare tokens, not speed (a method's own prefill of
    # every prompt made the suite ~3x slower).
    engine = Engine(EngineConfig(model="smollm2-135m", dtype="float32", device="cpu", drafter="smollm2-135m",
                                 share_across_methods=True))
    # Why noise and not the bf16 copy used before: that copy agreed with the target on 463 of 467 drafted tokens of
    # the lossless cases (1 row of 8 ever saw a rejection), so the draft models' rollback paths went almost
    # untested; and bf16 prefill is ~6.7x slower than fp32 on an AVX2-only CPU. With each decoder-layer weight
    # scaled by 1 + 0.05 x N(0, 1) (seed 0), measured (draft, adaptive, batch 3): 411 of 573 drafted tokens
    # accepted, 6 rows of 8 see rejections.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in engine.draft_model.base_model.layers.parameters():
            parameter.mul_(1.0 + 0.05 * torch.randn(parameter.shape, generator=generator))
    return engine


@pytest.fixture(scope="session")
def lossless_reference(engine):
    """Single-request ar greedy results of every lossless case (batch size 1, one request at a time)."""
    from tests.prompts import lossless_items

    return {item.key: engine.generate_ids(item.prompt_ids, "ar", item.params) for item in lossless_items(engine)}


@pytest.fixture(scope="session")
def ray_cluster():
    """One embedded Ray cluster for every job the session runs in-process (tests/job_runs.py)."""
    import ray

    from pipelines.generate import init_ray

    init_ray(None)
    yield
    ray.shutdown()


_guard: RuntimeGuard | None = None


def pytest_configure(config):
    global _guard
    _guard = RuntimeGuard()


def pytest_collection_modifyitems(config, items):
    check_collected(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _guard.watching(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _guard.watching(item):
        return (yield)
