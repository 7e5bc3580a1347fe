"""--deterministic (invariant_attention.py through the fast forward): a token's logits are bit-identical however it
is fed (alone, in a verify block of 1..17 tokens, as a tree node, in a prefill chunk, beside other rows of any
length), in fp32 and in bf16; so every lossless method's tokens equal batch-1 `ar`'s in bf16 as well."""

import pytest
import torch

from specdec_core.engine import BatchItem, Engine
from specdec_core.loop.draft_tree import ancestor_mask, depths
from specdec_core.loop.kv_cache import new_slot_cache
from specdec_core.loop.requests import DecodeParams
from specdec_core.model.model_runner import DeterminismUnavailableError, ModelRunner, tune_for_cpu
from specdec_core.model.step_batch import StepBatch
from tests.tiny_models import repetitive_prompt, tiny_gemma3, tiny_llama, tiny_llama_64, tiny_qwen2

SEQUENCE = repetitive_prompt(7, 40)


def runner_in(dtype: torch.dtype, make=tiny_llama) -> ModelRunner:
    base = make()
    model = base.model.to(dtype)
    tune_for_cpu(model)  # as ModelRunner.load sets a CPU model up: its linears and head on the panel kernels
    runner = ModelRunner(model, base.tokenizer, base.name, "cpu", dtype)
    runner.deterministic = True
    return runner


def feed(runner, pieces: list[int], others: list[int] = (), prefill: bool = False) -> torch.Tensor:
    """SEQUENCE fed in chunks of the given sizes to row 0, each forward also feeding a chunk to rows of other
    lengths (`others`: their cached lengths), as prefill forwards or steps -> [len(SEQUENCE), vocab] logits of row 0
    at every position."""
    cache = new_slot_cache(runner)
    cache.fit(1 + len(others), len(SEQUENCE) + 64)
    cache.add_row()
    for seed, length in enumerate(others):  # the neighbours' caches, fed whole
        row = cache.add_row()
        ids = torch.tensor([repetitive_prompt(100 + seed, length)])
        runner.forward_slots(cache, StepBatch(ids, torch.arange(length)[None], torch.ones(length, length, dtype=torch.bool).tril()[None],
                             torch.tensor([[0, length - 1]]), rows=[row]))
        cache.set_length(row, length)
    logits, done = [], 0
    for size in pieces:
        b = 1 + len(others)
        width = size + len(others)  # the neighbours feed blocks of other widths
        ids = torch.zeros(b, width, dtype=torch.long)
        ids[0, :size] = torch.tensor(SEQUENCE[done:done + size])
        counts = [size] + [1 + (size + i) % 4 for i in range(len(others))]
        visible = torch.zeros(b, width, width, dtype=torch.bool)
        for r, count in enumerate(counts):
            visible[r, :count, :count] = torch.ones(count, count, dtype=torch.bool).tril()
            if r:
                ids[r, :count] = torch.tensor(repetitive_prompt(200 + r, count))
        lengths = torch.tensor(cache.lengths)
        positions = lengths[:, None] + torch.arange(width)
        index = torch.tensor([(0, t) for t in range(size)])
        logits.append(runner.forward_slots(cache, StepBatch(ids, positions, visible, index, prefill=prefill)))
        done += size
        cache.set_length(0, done)
    return torch.cat(logits)


# head_dim 64 in bf16: the steps' exact kernel (bf16_step_attention.py) where this CPU runs it, else the invariant one
RUNNERS = [(torch.float32, tiny_llama), (torch.bfloat16, tiny_llama), (torch.bfloat16, tiny_llama_64)]
RUNNER_IDS = ["fp32", "bf16", "bf16-head64"]


@pytest.mark.parametrize("dtype,make", RUNNERS, ids=RUNNER_IDS)
def test_a_tokens_logits_are_bit_identical_however_it_is_fed(dtype, make, monkeypatch):
    from specdec_core.kernels import bf16_step_attention, decode_layer

    runner = runner_in(dtype, make)
    exact = []
    real_attend = bf16_step_attention.Step.attend
    monkeypatch.setattr(bf16_step_attention.Step, "attend", lambda step, *args: exact.append(step.exact)
                        or real_attend(step, *args))
    real_layers = decode_layer.run_layers  # a step's layers in one compiled call each: the same kernel, each layer
    monkeypatch.setattr(decode_layer, "run_layers", lambda layers, *args: exact.extend([args[4].exact] * len(layers))
                        or real_layers(layers, *args))
    alone = feed(runner, [1] * len(SEQUENCE))  # `ar`: one token a forward
    takes_steps = dtype == torch.bfloat16 and runner._bf16_step_kernel()
    assert exact == ([True] * runner.num_layers * len(SEQUENCE) if takes_steps else [])
    assert torch.equal(feed(runner, [len(SEQUENCE)]), alone)  # one prefill
    assert torch.equal(feed(runner, [17, 9, 1, 13]), alone)  # chunks and verify blocks of many sizes
    assert torch.equal(feed(runner, [3, 5, 2, 8, 6, 16], others=[11, 37]), alone)  # beside other rows and lengths
    for blocks in ([1] * 40, [2] * 20, list(range(1, 9)) + [4]):  # every query count 1..8 and 17 above
        assert torch.equal(feed(runner, blocks, others=[5]), alone)


def test_with_the_switch_a_bf16_prompts_tokens_are_bit_identical_however_its_prefill_is_cut(monkeypatch):
    """bf16 prefill forwards attend through bf16_attention.py under the switch (where it runs): a prompt token's
    logits are the same whole, in chunks of any size (short ones too), beside other rows."""
    from specdec_core.kernels import bf16_attention

    runner = runner_in(torch.bfloat16)
    if not runner._chain_attention(1, prefill=True):
        pytest.skip("no bf16 dot-product attention on this CPU")
    calls = []
    real_attend = bf16_attention.attend
    monkeypatch.setattr(bf16_attention, "attend", lambda *args: calls.append(args[0].shape[2]) or real_attend(*args))
    whole = feed(runner, [len(SEQUENCE)], prefill=True)
    assert calls
    for pieces, others in (([3, 37], ()), ([20, 1, 19], (5, 30)), ([8] * 5, (12,))):
        assert torch.equal(feed(runner, pieces, others, prefill=True), whole), (pieces, others)


@pytest.mark.parametrize("dtype,make", RUNNERS, ids=RUNNER_IDS)
def test_a_tree_node_equals_the_same_token_fed_as_a_chain(dtype, make):
    """After a 20-token prefix, row 0 feeds the pending token and two branches of two drafts (draft parents -1, -1,
    0, 1: nodes a and b under the pending token, a2 under a, b2 under b); each node's logits equal those of its
    own path fed as a chain."""
    runner = runner_in(dtype, make)
    prefix, (root, a, b, a2, b2) = SEQUENCE[:20], SEQUENCE[20:25]
    parents = [-1, -1, 0, 1]

    def after_prefix(ids: list[int], positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        cache = new_slot_cache(runner)
        cache.fit(1, 64)
        cache.add_row()
        runner.forward_slots(cache, StepBatch(torch.tensor([prefix]), torch.arange(20)[None],
                             torch.ones(20, 20, dtype=torch.bool).tril()[None], torch.tensor([[0, 19]])))
        cache.set_length(0, 20)
        width = len(ids)
        return runner.forward_slots(cache, StepBatch(torch.tensor([ids]), 20 + positions[None], visible[None],
                                    torch.tensor([[0, t] for t in range(width)])))  # [width, vocab]

    tree = after_prefix([root, a, b, a2, b2], torch.tensor([0] + depths(parents)), ancestor_mask(parents, 5))
    for path, node in (([root, a, a2], 3), ([root, b, b2], 4), ([root, a], 1), ([root, b], 2)):
        chain = after_prefix(path, torch.arange(len(path)), torch.ones(len(path), len(path), dtype=torch.bool).tril())
        assert torch.equal(tree[node], chain[-1]), (path, node)
    assert torch.equal(tree[0], chain[0])


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2, tiny_llama_64], ids=["llama", "qwen2", "llama-head64"])
def test_lossless_methods_equal_batch_one_ar_in_bf16(make):
    """bf16, deterministic: pld and copyspec in batches of 3 (more requests than slots, rows of different lengths)
    give batch-1 `ar`'s tokens on every row."""
    engine = Engine.from_runners(runner_in(torch.bfloat16, make))
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate([6, 41, 13, 60, 24])]
    items = [BatchItem(key, prompt, DecodeParams(max_new_tokens=24)) for key, prompt in enumerate(prompts)]
    reference = dict(engine.decode_batch(items, "ar", batch_size=1))
    for method in ("ar", "pld", "copyspec"):
        got = dict(engine.decode_batch(items, method, batch_size=3))
        for key in reference:
            assert got[key]["output_token_ids"] == reference[key]["output_token_ids"], (method, key)


@pytest.mark.parametrize("dtype,short_forwards_compiled", [(torch.bfloat16, True), (torch.float32, False)],
                         ids=["bf16", "fp32"])
def test_without_the_switch_bf16_decode_steps_attend_through_the_compiled_kernel(dtype, short_forwards_compiled,
                                                                                   monkeypatch):
    """Without --deterministic a bf16 CPU forward of at most MAX_QUERIES tokens a row still attends through
    invariant_attention.py (SDPA's flash kernel was ~4x slower at decode), a prefill through SDPA; fp32 keeps its
    own kernels."""
    from specdec_core.kernels import invariant_attention
    from specdec_core.model import grouped_attention

    runner = runner_in(dtype)
    runner.deterministic = False
    calls = []
    real_attend = invariant_attention.attend
    monkeypatch.setattr(invariant_attention, "attend", lambda *args: calls.append(args[0].shape[2]) or real_attend(*args))
    prefill = grouped_attention.MAX_QUERIES + 8
    feed(runner, [prefill] + [1] * (len(SEQUENCE) - prefill))
    assert calls == ([1] * runner.num_layers * (len(SEQUENCE) - prefill) if short_forwards_compiled else [])


def test_a_model_the_fast_forward_does_not_cover_is_one_clear_error():
    with pytest.raises(DeterminismUnavailableError, match="Llama-family"):
        tiny_gemma3().deterministic = True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_tokens_logits_do_not_depend_on_the_thread_count(dtype):
    """The linears, attention and norms split their work over threads by whole rows, panels or heads, never inside
    one sum: a forward on 1 thread and on 2 gives the same bits (the issue asks this of the matmuls on each CPU)."""
    runner = runner_in(dtype, tiny_llama_64)
    threads = torch.get_num_threads()
    got = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            got.append(feed(runner, [3, 5, 2, 8, 6, 16], others=[11, 37]))
            got.append(feed(runner, [24, 16], prefill=True))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[0], got[2]) and torch.equal(got[1], got[3])


def test_auto_switches_determinism_on_only_where_it_costs_nothing(monkeypatch):
    """--deterministic auto (the default): on for a bf16 CPU model the bf16 kernels run (avx512_bf16, no AMX, head_dim
    64 or 128), off in fp32, for head sizes the bf16 kernels do not take, and with AMX; "on" still errors where it
    cannot run, "off" stays off."""
    from specdec_core.defaults import determinism_mode
    from specdec_core.kernels import bf16_attention, bf16_step_attention

    assert [determinism_mode(v) for v in (True, False, "auto", "off")] == ["on", "off", "auto", "off"]
    with pytest.raises(ValueError, match="auto, on, off"):
        determinism_mode("yes")
    from specdec_core.model.model_runner import bf16_linears_on_panels

    kernels = bf16_attention.usable(64) and bf16_step_attention.usable(64) and bf16_linears_on_panels()  # not AMX
    bf16 = runner_in(torch.bfloat16, tiny_llama_64)
    bf16.deterministic = False
    assert Engine.from_runners(bf16).target.deterministic == kernels
    bf16_off = runner_in(torch.bfloat16, tiny_llama_64)
    bf16_off.deterministic = False
    assert not Engine.from_runners(bf16_off, deterministic="off").target.deterministic
    fp32 = runner_in(torch.float32, tiny_llama_64)
    fp32.deterministic = False
    assert not Engine.from_runners(fp32).target.deterministic
    small_heads = runner_in(torch.bfloat16)  # tiny_llama: head_dim 16, the bf16 kernels take 64 and 128
    small_heads.deterministic = False
    assert not Engine.from_runners(small_heads).target.deterministic
    assert Engine.from_runners(small_heads, deterministic=True).target.deterministic  # the fp32 kernel
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert not runner_in(torch.bfloat16, tiny_llama_64).determinism_costs_nothing()
    with pytest.raises(DeterminismUnavailableError, match="Llama-family"):
        Engine.from_runners(tiny_gemma3(), deterministic="on")
    assert not Engine.from_runners(tiny_gemma3()).target.deterministic  # auto: quietly off


@pytest.mark.slow
def test_the_real_model_in_bf16_gives_batch_one_ar_tokens_with_every_lossless_method_batched():
    """SmolLM2 in bf16 with --deterministic: rows of different lengths, each with its own lossless method (copy
    drafters, a candidates tree, CASD, SPECTRA, the draft model, PLD+ (h) and (a)), batched, equal batch-1 ar token for
    token. (On the AVX2 CPU these rows happen to agree without the switch too; the logits below are what it
    changes.)"""
    from specdec_core.engine import EngineConfig
    from specdec_core.methods import MethodOptions
    from tests.prompts import LOSSLESS_CASES

    engine = Engine(EngineConfig(dtype="bfloat16", deterministic=True, drafter="smollm2-135m", share_across_methods=True))
    # The shorter cases (37-329 prompt tokens): a bf16 prefill on an AVX2 CPU runs at ~1/7 of fp32's speed.
    names = ("code_rename", "summary_news", "summary_paper", "chat_revise_poem", "no_repetition_story",
             "no_repetition_facts", "code_hints", "chat_revise_code")
    cases = [(name, LOSSLESS_CASES[name]) for name in names]
    items = [BatchItem(name, engine.prompt_ids(messages=messages), DecodeParams(max_new_tokens=12))
             for name, messages in cases]
    reference = {item.key: engine.generate_ids(item.prompt_ids, "ar", item.params) for item in items}
    methods = [("pld", MethodOptions()), ("copyspec", MethodOptions()), ("copyspec", MethodOptions(candidates=3)),
               ("casd_strict", MethodOptions()), ("spectra", MethodOptions(spectra_pool=6)), ("draft", MethodOptions()),
               ("pld_plus_h", MethodOptions()), ("pld_plus_a", MethodOptions())]  # PLD+: steps recording signals
    decoder = engine.decoder(batch_size=len(items), speculation_budget=False)
    for item, (method, options) in zip(items, methods):
        decoder.submit(engine.request(item, method, options, decoder))
    got = {request.key: result for request, result in decoder.run()}
    for item, (method, _) in zip(items, methods):
        assert got[item.key].token_ids == reference[item.key]["output_token_ids"], (item.key, method)
    # The numbers under those tokens: bit-identical logits however a token is fed (without the switch, SmolLM2's
    # bf16 logits differed by up to 0.66 between these feeds; measured on the AVX2 CPU).
    alone = feed(engine.target, [1] * len(SEQUENCE))
    assert torch.equal(feed(engine.target, [3, 5, 2, 8, 6, 16], others=[11, 37]), alone)
