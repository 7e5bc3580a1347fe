"""The fast forward (fast_forward.py) computes what Hugging Face's forward computes over the owned cache: the same
logits, keys, values and captured hidden states for padded, ragged, tree and prefill forwards, and the same tokens
through the whole loop; models it does not cover keep HF's forward."""

import pytest
import torch

from specdec_core.engine import BatchItem, Engine
from specdec_core.kernels import residual_norm, rope_store
from specdec_core.kernels.packed_linear import PackedLinear, pack_linears
from specdec_core.loop.draft_tree import ancestor_mask, depths
from specdec_core.loop.requests import DecodeParams
from specdec_core.model import fast_forward
from specdec_core.model.fast_forward import unsupported
from specdec_core.model.int8_linear import quantize_int8
from specdec_core.model.model_runner import ModelRunner
from specdec_core.model.step_batch import StepBatch
from tests.specdec_core.test_step_kernels import filled_cache
from tests.tiny_models import hf_greedy, repetitive_prompt, tiny_gemma3, tiny_llama, tiny_qwen2


def packed_llama() -> ModelRunner:
    """The tiny Llama with its decoder linears on oneDNN's reordered weights, as ModelRunner.load sets up fp32."""
    runner = tiny_llama()
    assert pack_linears(runner.model.model.layers) == 2 * 7
    return ModelRunner(runner.model, runner.tokenizer, "tiny-llama-packed", "cpu", torch.float32)


def step(runner, tree: bool, counts=(5, 1, 2), lengths=(13, 30, 21), **signals):
    """One verify forward of 3 rows (width 5) after a prefill each -> (logits [N, vocab], cache)."""
    width = 5
    input_ids = torch.randint(1, 90, (3, width), generator=torch.Generator().manual_seed(1))
    visible = torch.zeros(3, width, width, dtype=torch.bool)
    for b, count in enumerate(counts):
        visible[b, :count, :count] = torch.ones(count, count, dtype=torch.bool).tril()
    positions = torch.tensor(lengths)[:, None] + torch.arange(width)
    if tree:  # row 0's 4 drafts as two branches of two
        parents = [-1, -1, 0, 1]
        visible[0] = ancestor_mask(parents, width)
        positions[0, 1:] = lengths[0] + torch.tensor(depths(parents))
    index = torch.tensor([(b, t) for b, count in enumerate(counts) for t in range(count)])
    cache = filled_cache(runner, list(lengths))
    return runner.forward_slots(cache, StepBatch(input_ids, positions, visible, index, **signals)), cache


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2, packed_llama], ids=["llama", "qwen2-biases", "packed"])
@pytest.mark.parametrize("counts, tree", [((5, 1, 2), False), ((5, 1, 2), True), ((5, 5, 5), False),
                                          ((1, 1, 1), False)], ids=["ragged", "ragged-tree", "full", "decode"])
def test_fast_forward_equals_the_hf_forward(make, counts, tree):
    """Logits, the real tokens' keys and values, a captured layer's hidden states and chosen heads' queries at real
    tokens equal those of HF's modules over the same cache; the prefills that filled the cache ran through each path too. `ragged` rows
    verify 4, 0 and 1 drafts (only the real tokens are computed); the tree is row 0's 4 drafts as two branches."""
    runner = make()
    fast = runner.fast
    assert fast is not None
    results = []
    for path in (fast, None):
        runner.fast = path
        captured, queries = {0: None, 1: None}, {}
        logits, cache = step(runner, tree, counts, captured=captured, query_heads={0: [0, 3], 1: [2]},
                             queries=queries)
        results.append((logits, cache, captured, queries))
    (fast_logits, fast_cache, fast_hidden, fast_queries), (hf_logits, hf_cache, hf_hidden, hf_queries) = results
    assert torch.allclose(fast_logits, hf_logits, atol=1e-5), (fast_logits - hf_logits).abs().max()
    for layer in range(fast_cache.num_layers):
        for b, (length, count) in enumerate(zip((13, 30, 21), counts)):
            real = slice(0, length + count)
            assert torch.allclose(fast_cache.keys[layer][b, :, real], hf_cache.keys[layer][b, :, real], atol=1e-5)
            assert torch.allclose(fast_cache.values[layer][b, :, real], hf_cache.values[layer][b, :, real], atol=1e-5)
    for layer in (0, 1):
        for b, count in enumerate(counts):
            assert torch.allclose(fast_hidden[layer][b, :count], hf_hidden[layer][b, :count], atol=1e-5)
            assert torch.allclose(fast_queries[layer][b, :, :count], hf_queries[layer][b, :, :count], atol=1e-5)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
def test_the_loop_on_the_fast_forward_equals_hf_greedy(make):
    """Prompts of different lengths, batched with copy drafts (ragged verify steps), more requests than slots."""
    engine = Engine.from_runners(make())
    assert engine.target.fast is not None
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate([6, 41, 13, 60, 24])]
    items = [BatchItem(key, prompt, DecodeParams(max_new_tokens=24)) for key, prompt in enumerate(prompts)]
    for method in ("ar", "copyspec"):
        results = dict(engine.decode_batch(items, method, batch_size=3))
        for key, prompt in enumerate(prompts):
            assert results[key]["output_token_ids"] == hf_greedy(engine.target, prompt, 24), (method, key)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2-biases"])
def test_the_gpu_layout_computes_what_hf_computes(make, monkeypatch):
    """On a GPU the fast forward stacks the plain q/k/v and gate/up linears into one matmul each (the modules' weights
    become views of the stack) and runs none of the compiled CPU passes. Laid out so on a CPU: its logits equal HF's
    forward, HF's own forward over the shared weights is unchanged, and the loop's tokens equal HF greedy."""
    monkeypatch.setattr(fast_forward, "_on_gpu", lambda module: True)
    monkeypatch.setattr(rope_store, "prepare", lambda *args: None)
    monkeypatch.setattr(residual_norm, "usable", lambda x: False)
    plain_logits, _ = step(make(fast_forward=False), tree=False)
    runner = make()
    layer = runner.fast.layers[0]
    assert layer.qkv is not None and layer.gate_up is not None and layer.on_gpu
    stacked = layer.qkv.module.weight
    attn = runner.model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == stacked[attn.q_proj.out_features:].data_ptr()  # a view, not a copy
    fast_logits, _ = step(runner, tree=True)
    runner.fast, fast = None, runner.fast
    hf_logits, _ = step(runner, tree=True)
    assert torch.allclose(fast_logits, hf_logits, atol=1e-5), (fast_logits - hf_logits).abs().max()
    assert torch.equal(step(runner, tree=False)[0], plain_logits)
    runner.fast = fast
    engine = Engine.from_runners(runner)
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate([6, 41, 13, 24])]
    items = [BatchItem(key, prompt, DecodeParams(max_new_tokens=16)) for key, prompt in enumerate(prompts)]
    results = dict(engine.decode_batch(items, "copyspec", batch_size=3))
    for key, prompt in enumerate(prompts):
        assert results[key]["output_token_ids"] == hf_greedy(runner, prompt, 16), key


def test_models_it_does_not_cover_keep_the_hf_forward():
    assert tiny_gemma3().fast is None
    assert "model type 'gemma3_text'" in unsupported(tiny_gemma3().model)
    runner = tiny_llama()
    quantize_int8(runner.model)
    assert "not plain nn.Linear" in unsupported(runner.model)


def test_a_packed_linear_computes_the_linear_and_each_row_alone():
    """Equal to nn.Linear within float rounding, on any leading shape; a row's result is the same whatever the
    number of rows beside it (1 to 80: the batch does not change a row's numbers); `weight` reads back exactly."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    packed = PackedLinear(linear)
    x = torch.randn(80, 64)
    with torch.no_grad():
        assert torch.allclose(packed(x), linear(x), atol=1e-5)
        assert torch.allclose(packed(x.view(4, 20, 64)), linear(x).view(4, 20, 96), atol=1e-5)
        alone = packed(x[:1])[0]
        assert all(torch.equal(packed(x[:rows])[0], alone) for rows in (2, 5, 16, 80))
    assert torch.equal(packed.weight, linear.weight.detach())


def test_load_packs_fp32_decoder_linears_when_the_panel_kernel_is_off(monkeypatch):
    from specdec_core.model.model_runner import tune_for_cpu

    monkeypatch.setenv("SPECBATCH_PANEL_LINEAR", "0")
    model = tiny_llama().model
    tune_for_cpu(model)
    assert isinstance(model.model.layers[0].mlp.up_proj, PackedLinear)
    monkeypatch.setenv("SPECBATCH_ONEDNN", "0")
    model = tiny_llama().model
    tune_for_cpu(model)
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
