"""The CPU fast paths of a short slot-cache forward compute the same numbers as the plain ones: grouped-query
attention as matmuls (grouped_attention.py) against SDPA, and the per-token modules run on real tokens only
(ragged_tokens.py) against the padded forward."""

import pytest
import torch
import torch.nn.functional as F

from specdec_core.loop.kv_cache import new_slot_cache
from specdec_core.model import grouped_attention
from specdec_core.model.step_batch import StepBatch
from tests.tiny_models import repetitive_prompt, tiny_gemma3, tiny_llama, tiny_qwen2


class Module:
    num_key_value_groups = 3


def cache_like(b, kv_heads, kv_len, dim, capacity=64):
    """A view of a larger buffer, as the slot cache hands keys to attention: [b, kv, kv_len, d], not contiguous."""
    return torch.randn(b, kv_heads, capacity, dim)[:, :, :kv_len]


@pytest.mark.parametrize("num_new", [1, 3, 8])
def test_grouped_attention_equals_sdpa_with_dead_keys(num_new):
    torch.manual_seed(num_new)
    b, heads, kv_heads, dim, kv_len = 4, 6, 2, 16, 40
    query = torch.randn(b, heads, num_new, dim)
    key, value = cache_like(b, kv_heads, kv_len, dim), cache_like(b, kv_heads, kv_len, dim)
    allowed = torch.rand(b, 1, num_new, kv_len) < 0.7
    allowed[..., 0] = True  # every query sees at least one key
    mask = torch.zeros(b, 1, num_new, kv_len).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out, _ = grouped_attention.grouped_attention_forward(Module(), query, key, value, mask, scaling=0.3)  # [b,T,H,d]
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert out.shape == (b, num_new, heads, dim)
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5), (out - expected.transpose(1, 2)).abs().max()


def test_grouped_attention_leaves_long_or_unmasked_forwards_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(grouped_attention, "sdpa_attention_forward", lambda *args, **kwargs: calls.append(1))
    key = value = cache_like(1, 2, 20, 16)
    long_query = torch.randn(1, 6, grouped_attention.MAX_QUERIES + 1, 16)
    grouped_attention.grouped_attention_forward(Module(), long_query, key, value, torch.zeros(1, 1, 9, 20))
    grouped_attention.grouped_attention_forward(Module(), torch.randn(1, 6, 2, 16), key, value, None)
    grouped_attention.grouped_attention_forward(Module(), torch.randn(1, 6, 2, 16), key, value,
                                                torch.ones(1, 1, 2, 20, dtype=torch.bool))  # HF's own boolean masks
    assert len(calls) == 3


def filled_cache(runner, lengths):
    cache = new_slot_cache(runner)
    cache.fit(len(lengths), max(lengths) + 16)
    for seed, length in enumerate(lengths):
        row = cache.add_row()
        prompt = torch.tensor([repetitive_prompt(seed, length)])
        runner.forward_slots(cache, StepBatch(prompt, torch.arange(length)[None],
                             torch.ones(length, length, dtype=torch.bool).tril()[None], torch.tensor([[0, length - 1]]),
                             rows=[row]))
        cache.set_length(row, length)
    return cache


@pytest.mark.parametrize("make, tree", [(tiny_llama, False), (tiny_gemma3, False), (tiny_qwen2, False),
                                        (tiny_llama, True)],
                         ids=["llama", "gemma3-sliding", "qwen2-biases", "llama-tree"])
def test_a_padded_step_on_real_tokens_only_gives_the_padded_forwards_logits_and_keys(make, tree):
    """3 rows verifying 4, 0 and 1 draft tokens (width 5: 8 real tokens of 15): logits and the real tokens' keys
    equal those of the fully padded forward; the hooks did gather. Qwen2's q/k/v projections carry biases (a
    scattered padding row is zeros, not the bias: it must never be read); with `tree`, row 0's 4 drafts are two
    branches of two (parents -1, -1, 0, 1: positions length + 0, 1, 1, 2, 2; each node sees only its ancestors)."""
    from specdec_core.loop.draft_tree import ancestor_mask, depths

    runner = make()
    runner.fast = None  # the HF forward's hooks (Gemma's path); test_fast_forward.py covers the fast forward
    lengths, counts, width = [13, 30, 21], [5, 1, 2], 5
    input_ids = torch.randint(1, 90, (3, width), generator=torch.Generator().manual_seed(1))
    visible = torch.zeros(3, width, width, dtype=torch.bool)
    for b, count in enumerate(counts):
        visible[b, :count, :count] = torch.ones(count, count, dtype=torch.bool).tril()
    positions = torch.tensor(lengths)[:, None] + torch.arange(width)
    if tree:
        parents = [-1, -1, 0, 1]
        visible[0] = ancestor_mask(parents, width)
        positions[0, 1:] = lengths[0] + torch.tensor(depths(parents))
    index = torch.tensor([(b, t) for b, count in enumerate(counts) for t in range(count)])
    assert runner.ragged.worth_it(visible.diagonal(dim1=1, dim2=2))

    mlp_inputs = []  # inside the MLP: what it computes
    runner.base_model.layers[0].mlp.up_proj.register_forward_pre_hook(
        lambda module, args: mlp_inputs.append(args[0].shape))
    caches, logits = [], []
    for ragged in (runner.ragged, None):
        runner.ragged = ragged
        cache = filled_cache(runner, lengths)
        mlp_inputs.clear()
        logits.append(runner.forward_slots(cache, StepBatch(input_ids, positions, visible, index)))
        caches.append(cache)
        hidden = runner.model.config.hidden_size
        assert mlp_inputs == ([(1, 8, hidden)] if ragged else [(3, width, hidden)])
    assert torch.allclose(logits[0], logits[1], atol=1e-5), (logits[0] - logits[1]).abs().max()
    for layer in range(caches[0].num_layers):
        for b, (length, count) in enumerate(zip(lengths, counts)):
            real = slice(length, length + count)
            assert torch.allclose(caches[0].keys[layer][b, :, real], caches[1].keys[layer][b, :, real], atol=1e-5)
            assert torch.allclose(caches[0].values[layer][b, :, real], caches[1].values[layer][b, :, real], atol=1e-5)


def test_a_step_without_padding_skips_the_gathers():
    runner = tiny_llama()
    full = torch.ones(4, 3, dtype=torch.bool)
    assert not runner.ragged.worth_it(full)  # nothing to save, the gathers would cost
    assert not runner.ragged.worth_it(torch.ones(4, 1, dtype=torch.bool))  # plain decode steps


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_short_verify_forwards_run_grouped_attention_and_match_sdpa_inside_the_model(make, monkeypatch):
    """A width-3 step with masks (Gemma3: a dict of full and sliding masks) dispatches to the grouped path in every
    layer, and its logits equal the same step through SDPA; the model's own setting is restored after."""
    runner = make()
    runner.fast = None  # the HF forward's dispatch (Gemma's path); the fast forward calls grouped attention itself
    calls = []
    original = grouped_attention.grouped_attention_forward
    monkeypatch.setattr(grouped_attention, "MAX_QUERIES", 8)
    lengths, width = [13, 30], 3
    input_ids = torch.randint(1, 90, (2, width), generator=torch.Generator().manual_seed(2))
    visible = torch.ones(width, width, dtype=torch.bool).tril()[None].repeat(2, 1, 1)
    positions = torch.tensor(lengths)[:, None] + torch.arange(width)
    index = torch.tensor([(b, t) for b in range(2) for t in range(width)])
    from transformers import AttentionInterface

    AttentionInterface.register(grouped_attention.NAME, lambda *a, **k: calls.append(1) or original(*a, **k))
    try:
        logits = []
        for grouped in (True, False):
            runner.grouped_attention = grouped
            cache = filled_cache(runner, lengths)
            calls.clear()
            logits.append(runner.forward_slots(cache, StepBatch(input_ids, positions, visible, index)))
            assert len(calls) == (runner.num_layers if grouped else 0)
    finally:
        AttentionInterface.register(grouped_attention.NAME, original)
    assert runner.model.config._attn_implementation == "sdpa"
    assert torch.allclose(logits[0], logits[1], atol=1e-5), (logits[0] - logits[1]).abs().max()


def test_only_dense_per_token_modules_are_hooked_and_only_during_a_ragged_forward():
    runner = tiny_llama()
    layers = runner.base_model.layers
    assert runner.ragged.hooked == 5 * len(layers)  # q, k, v, o projections and the MLP of each layer
    mlp = layers[0].mlp
    assert not mlp._forward_pre_hooks and not mlp._forward_hooks  # HF generate on this model runs stock modules

    class SparseMoeBlock(torch.nn.Module):
        experts = None

    from specdec_core.model.ragged_tokens import RaggedTokens

    layer = torch.nn.Module()
    layer.mlp = SparseMoeBlock()
    assert RaggedTokens([layer]).hooked == 0  # routers and aux outputs keep the padded layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 16, 300])  # 300: the parallel loop (rope_store.PARALLEL_MIN_TOKENS)
def test_the_compiled_rope_and_cache_write_equal_the_eager_ops_bit_for_bit(tokens, dtype):
    """fp32, and bf16 rounded where each eager bf16 op rounds."""
    from specdec_core.kernels import rope_store
    from specdec_core.model import fast_forward

    generator = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim, slots, capacity = 9, 3, 64, 4, 400
    q, k, v = (torch.randn(tokens, n, dim, generator=generator).to(dtype) for n in (heads, kv_heads, kv_heads))
    angles = torch.rand(tokens, 1, dim // 2, generator=generator) * 50
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))  # [M, 1, d], as HF's
    rows = torch.randint(0, slots, (tokens,), generator=generator)
    places = torch.randperm(capacity, generator=generator)[:tokens]  # every token its own slot
    eager_keys = torch.zeros(slots, kv_heads, capacity, dim, dtype=dtype)
    eager_values = torch.zeros_like(eager_keys)
    eager_q, eager_k = fast_forward._rope(q, cos, sin), fast_forward._rope(k, cos, sin)
    eager_keys[rows, :, places], eager_values[rows, :, places] = eager_k, v
    keys, values = torch.zeros_like(eager_keys), torch.zeros_like(eager_values)
    rotation = rope_store.prepare(cos, sin, rows, places, q, keys)
    assert rotation is not None
    got_q = rotation(q.clone(), k, v, keys, values)
    assert torch.equal(got_q, eager_q)
    assert torch.equal(keys, eager_keys) and torch.equal(values, eager_values)
    # other dtypes, or a cache of another dtype, keep the eager ops
    assert rope_store.prepare(cos.half(), sin.half(), rows, places, q.half(), keys.half()) is None
    assert rope_store.prepare(cos, sin, rows, places, q, keys.double()) is None
