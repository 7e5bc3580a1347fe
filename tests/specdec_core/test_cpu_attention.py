"""The compiled decode attention (cpu_attention.py): equal to grouped matmuls over the padded keys within fp32
rounding, a row's result bit-identical alone and in any batch, and the batched loop exact with it on."""

import pytest
import torch

from specdec_core.drafters.copyspec import CopySpecDrafter
from specdec_core.kernels import cpu_attention
from specdec_core.kernels.numba_kernels import LazyKernel
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.loop.requests import DecodeParams
from specdec_core.model import grouped_attention
from tests.tiny_models import hf_greedy, repetitive_prompt, tiny_llama


def case(rows=5, num_new=3, capacity=96, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(10, capacity - num_new, (rows,), generator=generator)
    keys = torch.randn(rows, 2, capacity, 16, generator=generator)  # [slots, KV, capacity, d]
    values = torch.randn(rows, 2, capacity, 16, generator=generator)
    query = torch.randn(rows, 6, num_new, 16, generator=generator)  # 3 query heads per key/value head
    kv_len = int(lengths.max()) + num_new
    key = torch.arange(kv_len)[None, None, :]
    allowed = key < lengths[:, None, None] + torch.arange(num_new)[None, :, None] + 1  # [b, T, L]: causal chain
    mask = torch.zeros(rows, 1, num_new, kv_len).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    return query, keys[:, :, :kv_len], values[:, :, :kv_len], lengths + num_new, mask


@pytest.mark.parametrize("num_new, capacity", [(1, 96), (4, 96), (3, 300), (8, 300)])
def test_equals_grouped_matmuls_over_the_padded_keys(num_new, capacity):
    """T = 1 runs the one-query loop, wider steps the wide one: 3 tokens x 3 heads is an odd count of queries (a
    zero query pads the pair), 300 keys span several chunks and end off a multiple of four."""
    query, key, value, counts, mask = case(num_new=num_new, capacity=capacity)
    got = cpu_attention.attend(query, key, value, counts, mask, 0.25)
    assert got is not None, cpu_attention.kernel.unavailable
    expected, _ = grouped_attention.grouped_attention_forward(None, query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_rows_padding_queries_are_not_computed():
    """A verify step as wide as its longest draft: row r's queries past its own extent are padding. Given each
    row's extent (and its keys up to it), the real queries get the attention of the whole padded step within fp32
    rounding, and the padding comes out zero."""
    query, key, value, counts, mask = case(rows=5, num_new=4, seed=3)
    extent = torch.tensor([4, 1, 2, 0, 3])
    whole = cpu_attention.attend(query, key, value, counts, mask, 0.25)
    got = cpu_attention.attend(query, key, value, counts - 4 + extent, mask, 0.25, extent)
    for row, real in enumerate(extent.tolist()):
        torch.testing.assert_close(got[row, :real], whole[row, :real], rtol=1e-5, atol=1e-6)
        assert not got[row, real:].any()


def test_a_row_gets_the_same_bits_alone_and_in_a_batch():
    query, key, value, counts, mask = case(rows=6)
    batched = cpu_attention.attend(query, key, value, counts, mask, 0.25)
    for row in range(6):
        n = int(counts[row])
        alone = cpu_attention.attend(query[row:row + 1], key[row:row + 1, :, :n], value[row:row + 1, :, :n],
                                     counts[row:row + 1], mask[row:row + 1, :, :, :n], 0.25)
        assert torch.equal(alone[0], batched[row])


def test_the_batched_loop_stays_exact_with_the_kernel_on(monkeypatch):
    monkeypatch.setattr(grouped_attention, "KERNEL_MIN_KEY_VALUES", 0)  # tiny prompts: on for every step
    calls = []
    real = cpu_attention.attend
    monkeypatch.setattr(cpu_attention, "attend", lambda *args: calls.append(1) or real(*args))
    llama = tiny_llama()
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate([6, 41, 13, 60, 24])]
    decoder = BatchDecoder(llama, max_batch=3)
    for key, prompt in enumerate(prompts):
        decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=16), CopySpecDrafter()))
    got = {request.key: result.token_ids for request, result in decoder.run()}
    assert calls
    assert [got[key] for key in range(len(prompts))] == [hf_greedy(llama, prompt, 16) for prompt in prompts]


def test_where_the_kernel_cannot_compile_the_matmuls_run(monkeypatch, caplog):
    def broken():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(cpu_attention, "kernel", LazyKernel(broken, "compiled CPU attention", "; using batched matmuls"))
    query, key, value, counts, mask = case()
    assert cpu_attention.attend(query, key, value, counts, mask, 0.25) is None
    assert cpu_attention.attend(query, key, value, counts, mask, 0.25) is None
    assert [r.message for r in caplog.records].count(
        "compiled CPU attention unavailable (RuntimeError: no compiler here); using batched matmuls") == 1
    monkeypatch.setattr(grouped_attention, "KERNEL_MIN_KEY_VALUES", 0)
    with grouped_attention.real_keys(counts, 1):  # the kernel is asked for, is unavailable: the matmuls answer
        got, _ = grouped_attention.grouped_attention_forward(None, query, key, value, mask, scaling=0.25)
    expected, _ = grouped_attention.grouped_attention_forward(None, query, key, value, mask, scaling=0.25)
    assert torch.equal(got, expected)


def test_the_kernel_threshold_counts_key_values_not_keys():
    """The thread handoff costs the same per layer whatever the model: the kernel pays only when the keys it reads
    are many values. 4 rows of 16 keys engage it for SmolLM2 (3 x 64 values a key), not for a 2 x 16 model."""
    counts = torch.full((4,), 16)
    with grouped_attention.real_keys(counts, 3 * 64):
        assert grouped_attention._row_keys is counts
    with grouped_attention.real_keys(counts, 2 * 16):
        assert grouped_attention._row_keys is None
    assert grouped_attention._row_keys is None  # restored after the block


def test_a_forwards_layers_share_one_conversion_and_a_new_mask_is_read_afresh():
    """Within one forward the step's arrays are converted once; a call with other tensors (another mask) still
    gets its own attention, and outside the block nothing is held."""
    query, key, value, counts, mask = case(num_new=4, seed=5)
    other = mask.clone()
    other[:, :, :, 0] = torch.finfo(torch.float32).min  # no row sees its first key
    expected = [cpu_attention.attend(query, key, value, counts, m, 0.25) for m in (mask, other, mask)]
    with cpu_attention.one_forward():
        got = [cpu_attention.attend(query, key, value, counts, m, 0.25) for m in (mask, mask, other, mask)]
        assert cpu_attention._held is not None
    assert cpu_attention._held is None
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[0])
    assert torch.equal(got[2], expected[1]) and not torch.equal(got[2], expected[0])
    assert torch.equal(got[3], expected[2])
