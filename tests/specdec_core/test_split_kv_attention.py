"""kernels/split_kv_attention.py in Triton's interpreter (its timing is a GPU's: benchmarks/gpu_attention_bench.py):
the split ranges and their merge give SDPA's attention over the same additive mask, for decode and verify widths,
rows of different lengths, any number of ranges (some with no key to read) and the cache's strided views. In fp32
only: the interpreter's products of bf16 blocks are wrong (it multiplies their bits), so the bf16 kernels are
checked on a GPU (gpu_attention_bench.py's relative error against SDPA).

Triton reads TRITON_INTERPRET when it defines its own functions, at its first import, which another test's
torch.compile may have done already: so the checks run in a process of their own (this file as a script)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specdec_core.model.graph_step import key_mask

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_split_kv_attention_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{len(CHECKS)} checks passed" in done.stdout


def test_a_cpu_outside_the_interpreter_declines_to_sdpa(monkeypatch):
    """The graph-ready step on a CPU under SPECBATCH_GPU_ATTENTION=split (no GPU, no interpreter) runs SDPA."""
    from specdec_core.kernels import split_kv_attention

    monkeypatch.setattr(split_kv_attention, "INTERPRETED", False)
    query, keys, values, mask, ends = _step(2, 1, 2, 1, [10, 20], 40, 16, torch.float32, seed=2)
    assert split_kv_attention.attend(query, keys, values, mask, ends, 0.25) is None


def test_kernels_that_fail_leave_sdpa_to_the_process(monkeypatch, caplog):
    """A compile or launch error (a GPU's Triton that cannot build them, say) is logged once and declines from then on,
    so the step runs SDPA instead of failing the job."""
    from specdec_core.kernels import split_kv_attention

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no kernel for you")
            return launch

    monkeypatch.setattr(split_kv_attention, "INTERPRETED", True)
    monkeypatch.setattr(split_kv_attention, "_ranges", Broken())
    monkeypatch.setattr(split_kv_attention, "_failed", False)
    query, keys, values, mask, ends = _step(2, 1, 2, 1, [10, 20], 40, 16, torch.float32, seed=2)
    with caplog.at_level("WARNING"):
        assert split_kv_attention.attend(query, keys, values, mask, ends, 0.25) is None
        assert split_kv_attention.attend(query, keys, values, mask, ends, 0.25) is None
    assert not split_kv_attention.usable()
    assert sum("split attention failed" in r.getMessage() for r in caplog.records) == 1


def _step(rows: int, kv_heads: int, group: int, width: int, lengths: list[int], capacity: int, head_dim: int,
          dtype: torch.dtype, seed: int):
    """A step as graph_step.py hands it over: folded queries, the cache's strided views, the additive mask (cached
    keys, the new nodes a chain shows, each node itself) and each row's end."""
    generator = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(rows + 1, kv_heads, capacity, head_dim, generator=generator).to(dtype)  # a spare slot
    cache_v = torch.randn(rows + 1, kv_heads, capacity, head_dim, generator=generator).to(dtype)
    keys_count = max(lengths) + width + 5  # the bucket's keys: more than any row uses
    keys, values = cache_k[:rows, :, :keys_count], cache_v[:rows, :, :keys_count]  # strided views
    query = torch.randn(rows, kv_heads, group * width, head_dim, generator=generator).to(dtype)
    lengths_t = torch.tensor(lengths)
    visible = torch.ones(width, width, dtype=torch.bool).tril().expand(rows, width, width)  # [b, T, T]: a chain
    allowed = key_mask(lengths_t, visible, keys_count)  # [b, 1, T, L], as the step builds it
    allowed = allowed[:, :, None].expand(rows, 1, group, width, keys_count).reshape(rows, 1, group * width, keys_count)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    ends = (lengths_t + width).clamp(max=keys_count)
    return query, keys, values, mask, ends


def check_split_ranges_give_sdpa_attention_fp32(split_kv):
    for width, splits in [(1, 1), (1, 4), (3, 2), (4, 8)]:
        _sdpa_equal(split_kv, width, splits)


def _sdpa_equal(split_kv, width: int, splits: int) -> None:
    lengths = [70, 3, 129, 40]  # a row shorter than a block, one past two, and ranges with no key of theirs
    query, keys, values, mask, ends = _step(4, 2, 3, width, lengths, 200, 32, torch.float32, seed=width)
    got = split_kv.attend(query, keys, values, mask, ends, 32 ** -0.5, splits=splits)
    expected = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=32 ** -0.5)
    assert got is not None and got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def check_keys_past_a_rows_end_are_never_read(split_kv):
    """NaN keys past each row's end (another row's length, a rejected draft's keys) leave the output finite and equal
    to the attention over the real keys: the kernel does not read them, where a mask alone would give NaN."""
    query, keys, values, mask, ends = _step(2, 1, 2, 1, [30, 100], 160, 16, torch.float32, seed=3)
    expected = split_kv.attend(query, keys, values, mask, ends, 0.25, splits=2)
    for row, end in enumerate(ends.tolist()):
        keys[row, :, end:] = float("nan")
        values[row, :, end:] = float("nan")
    got = split_kv.attend(query, keys, values, mask, ends, 0.25, splits=2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def check_declines_what_it_does_not_hold(split_kv):
    query, keys, values, mask, ends = _step(1, 1, 2, 1, [10], 32, 24, torch.float32, seed=1)  # head size 24
    assert split_kv.attend(query, keys, values, mask, ends, 0.2) is None
    query, keys, values, mask, ends = _step(1, 1, 9, 8, [10], 32, 16, torch.float32, seed=1)  # 72 queries a head
    assert split_kv.attend(query, keys, values, mask, ends, 0.2) is None


def check_default_splits_fill_the_device_and_keep_ranges_a_block_long(split_kv):
    cpu = torch.device("cpu")  # counts 8 processors there
    assert split_kv.default_splits(128, 640, cpu) == 1  # already four programs a processor
    assert split_kv.default_splits(2, 640, cpu) == 8  # 640 keys: ranges of 80, none under a block
    assert split_kv.default_splits(2, 100, cpu) == 1


def check_graph_ready_steps_through_the_split_kernels_equal_hf_greedy(split_kv):
    """The graph-ready step (static buffers, run eagerly) attending through the split kernels: batched copyspec trees
    (and the plain steps between drafts) give every row HF's greedy tokens, and the kernels served every step. The
    chains' widths are the first check's."""
    from specdec_core.drafters.copyspec import CopySpecDrafter
    from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
    from specdec_core.loop.requests import DecodeParams
    from tests.tiny_models import repetitive_prompt, tiny_llama

    runner = tiny_llama()
    runner.graph_mode, runner.gpu_attention = "eager", "split"
    served = []
    attend = split_kv.attend
    split_kv.attend = lambda *args, **kwargs: served.append(attend(*args, **kwargs)) or served[-1]
    prompts = [repetitive_prompt(seed, n) for seed, n in enumerate([5, 23, 11, 40, 17])]
    expected = []
    for prompt in prompts:
        with torch.inference_mode():
            out = runner.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=14,
                                        min_new_tokens=14, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    try:
        decoder = BatchDecoder(runner, max_batch=3)  # trees, chains where one branch is found, plain steps between
        for key, prompt in enumerate(prompts):
            decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=14),
                                         CopySpecDrafter(gamma=2, copy_tokens=6, candidates=3)))
        got = {request.key: result.token_ids for request, result in decoder.run()}
        assert [got[key] for key in range(len(prompts))] == expected
        assert decoder.stats.drafted_tokens > 0
    finally:
        split_kv.attend = attend
    assert runner.graph_step().attention == "split" and runner.graph_step().steps > 0
    assert served and all(out is not None for out in served)  # every layer of every step: no SDPA fallback


CHECKS = [check_split_ranges_give_sdpa_attention_fp32, check_keys_past_a_rows_end_are_never_read,
          check_declines_what_it_does_not_hold, check_default_splits_fill_the_device_and_keep_ranges_a_block_long,
          check_graph_ready_steps_through_the_split_kernels_equal_hf_greedy]

if __name__ == "__main__":  # the interpreter's process (test_split_kv_attention_in_the_interpreter)
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from specdec_core.kernels import split_kv_attention

    for check in CHECKS:
        check(split_kv_attention)
    print(f"{len(CHECKS)} checks passed")
