"""The fp32 attention of long forwards (fp32_chain_attention.py): each row's chain against SDPA within fp32
rounding, a token's result the same however its prompt is chunked, and what the model runner sends to it."""

import pytest
import torch

from specdec_core.kernels import fp32_chain_attention
from specdec_core.loop.kv_cache import new_slot_cache
from specdec_core.model import grouped_attention
from specdec_core.model.step_batch import StepBatch
from tests.specdec_core.test_bf16_attention import reference
from tests.specdec_core.test_deterministic import SEQUENCE, feed, runner_in

pytestmark = pytest.mark.skipif(not fp32_chain_attention.usable(64), reason="numba cannot compile the kernel here")


def cache_of(heads_kv: int, dim: int, slots, lengths, news, capacity: int):
    """Keys and values [5, KV, capacity, d]: each row's first length + new positions random, NaN past them (never
    read)."""
    keys = torch.full((5, heads_kv, capacity, dim), float("nan"))
    values = keys.clone()
    for slot, length, new in zip(slots.tolist(), lengths.tolist(), news.tolist()):
        keys[slot, :, :length + new] = torch.randn(heads_kv, length + new, dim) * 2
        values[slot, :, :length + new] = torch.randn(heads_kv, length + new, dim)
    return keys, values


@pytest.mark.parametrize("dim, heads, kv_heads", [(16, 6, 2), (64, 9, 3), (128, 8, 2)])
def test_each_rows_chain_attends_its_own_keys_within_fp32_rounding(dim, heads, kv_heads):
    """Rows at other cache slots, with cached prefixes of other lengths, chains of other lengths (the padding after a
    row's chain gets zeros), two query blocks crossed, key counts that are not a multiple of 16, a group of 1-4 query
    rows past the last four: each row equals SDPA in fp32 within rounding; the NaN past a row's keys is not read."""
    torch.manual_seed(0)
    num_new = 2 * fp32_chain_attention.QUERY_BLOCK + 5
    slots, lengths, news = torch.tensor([4, 0, 2]), torch.tensor([0, 57, 100]), torch.tensor([num_new, 30, 1])
    keys, values = cache_of(kv_heads, dim, slots, lengths, news, 300)
    query = torch.randn(3, heads, num_new, dim) * 2  # [b, H, T, d]
    out = fp32_chain_attention.attend(query, keys, values, slots, lengths, news, dim ** -0.5)  # [b, T, H, d]
    assert out.shape == (3, num_new, heads, dim) and out.dtype == torch.float32
    for r in range(3):
        want = reference(query[r], keys, values, int(slots[r]), int(lengths[r]), int(news[r]))
        assert (out[r, :news[r]] - want).abs().max() < 1e-5, r
        assert not out[r, news[r]:].any()  # the padding


def test_a_tokens_result_is_the_same_however_its_prompt_is_chunked():
    """A prompt fed whole, or as a first chunk and then the rest over the cached keys, or next to another row in
    the batch: every token's attention is bit for bit the same."""
    torch.manual_seed(1)
    heads, kv_heads, dim, prompt = 9, 3, 64, 150
    slots, lengths, news = torch.tensor([1]), torch.tensor([0]), torch.tensor([prompt])
    keys, values = cache_of(kv_heads, dim, slots, lengths, news, 200)
    query = torch.randn(1, heads, prompt, dim)
    scale = dim ** -0.5
    whole = fp32_chain_attention.attend(query, keys, values, slots, lengths, news, scale)[0]  # [T, H, d]
    first = fp32_chain_attention.attend(query[:, :, :70], keys, values, slots, lengths, torch.tensor([70]), scale)[0]
    rest = fp32_chain_attention.attend(query[:, :, 70:], keys, values, slots, torch.tensor([70]),
                                       torch.tensor([prompt - 70]), scale)[0]
    assert torch.equal(torch.cat([first, rest]), whole)
    other = torch.randn(1, heads, prompt, dim)
    keys[3], values[3] = keys[1] * 0.5, values[1] + 1
    both = fp32_chain_attention.attend(torch.cat([other, query]), keys, values, torch.tensor([3, 1]),
                                       torch.tensor([0, 0]), torch.tensor([prompt, prompt]), scale)
    assert torch.equal(both[1], whole)


def test_an_fp32_prefill_attends_through_it_and_gives_the_sdpa_logits(monkeypatch):
    """The model runner sends an fp32 forward of more than MAX_QUERIES tokens a row (a prefill chunk, here a later
    chunk over cached keys too) here and short steps elsewhere; the logits of every position stay those of the SDPA
    path within fp32 rounding. With --deterministic it is not used."""
    runner = runner_in(torch.float32)
    runner.deterministic = False
    first, later = grouped_attention.MAX_QUERIES + 12, grouped_attention.MAX_QUERIES + 9
    pieces = [first, later, 2, 1]  # SEQUENCE's 40 tokens
    calls = []
    real_attend = fp32_chain_attention.attend
    monkeypatch.setattr(fp32_chain_attention, "attend",
                        lambda *args: calls.append(args[0].shape[2]) or real_attend(*args))
    ours = feed(runner, pieces, others=[40])
    # the neighbour's own prompt first, then row 0's chunks (each wider by the neighbour's token count)
    assert calls == [40] * runner.num_layers + [first + 1] * runner.num_layers + [later + 1] * runner.num_layers
    monkeypatch.setattr(fp32_chain_attention, "usable", lambda head_dim: False)
    calls.clear()
    theirs = feed(runner, pieces, others=[40])
    assert not calls
    assert ours.shape == theirs.shape == (sum(pieces), runner.vocab_size)
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    runner.deterministic = True
    monkeypatch.setattr(fp32_chain_attention, "usable", lambda head_dim: True)
    feed(runner, pieces)
    assert not calls


def test_trees_keep_sdpa(monkeypatch):
    """A long forward whose row is not a chain (a draft tree: node 3 a sibling of node 2) is not sent here."""
    runner = runner_in(torch.float32)
    runner.deterministic = False
    calls = []
    monkeypatch.setattr(fp32_chain_attention, "attend", lambda *args: calls.append(args))
    width = grouped_attention.MAX_QUERIES + 4
    visible = torch.ones(width, width, dtype=torch.bool).tril()
    visible[3, 2] = False
    cache = new_slot_cache(runner)
    cache.fit(1, width + 8)
    cache.add_row()
    logits = runner.forward_slots(cache, StepBatch(torch.tensor([SEQUENCE[:width]]), torch.arange(width)[None],
                                                   visible[None], torch.tensor([[0, width - 1]])))
    assert not calls and logits.shape == (1, runner.vocab_size)
