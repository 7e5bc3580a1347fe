"""Attention through flex_attention with a block mask (block_attention.py), on the CPU.

On the CPU flex_attention runs eagerly, which evaluates the mask rule on every score and ignores which blocks the
block mask lists. So the blocks are checked apart: what a kernel that honours them computes (full blocks seen, partial
blocks by the rule, the rest skipped) equals the rule on every real query, and skips each row's dead keys. Then
compiled flex_attention (a kernel that does skip blocks; slow) gives the eager result, and the graph-ready step and
the eager forward give greedy's tokens through it."""

import logging
import random
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from specdec_core.engine import BatchItem, Engine
from specdec_core.loop.requests import DecodeParams
from specdec_core.model import block_attention, graph_step
from specdec_core.model.attention_masks import visible_keys
from specdec_core.model.graph_step import key_mask
from specdec_core.model.model_runner import ModelRunner
from tests.specdec_core.test_graph_step import LENGTHS, MAX_NEW, MIXED, _decode_mixed
from tests.tiny_models import hf_greedy, repetitive_prompt, tiny_llama, tiny_qwen2

BLOCK = block_attention.BLOCK


def _case(rng: random.Random, width: int, padded: bool):
    """A random step: rows' cached lengths, tree visibility (parents before children), real nodes, keys to attend."""
    rows = rng.randint(1, 5)
    lengths = torch.tensor([rng.choice([0, 1, BLOCK - 1, BLOCK, rng.randint(0, 700)]) for _ in range(rows)])
    news = torch.tensor([rng.randint(0, width) for _ in range(rows)]) if padded else None
    visible = torch.zeros(rows, width, width, dtype=torch.bool)
    for r in range(rows):
        real = width if news is None else int(news[r])
        for node in range(1, real):
            parent = rng.randrange(node)
            visible[r, node] = visible[r, parent]
        visible[r, range(real), range(real)] = True
    keys = int((lengths + width).max())
    keys = -(-keys // 256) * 256 if rng.random() < 0.5 else keys  # a bucket's multiple of 256, or just enough
    return lengths, visible, news, keys


def _rule(lengths, visible, news, keys):
    """[b, T, L] what each node sees: graph_step.key_mask's rule (padding nodes see themselves) without news, the
    eager forward's (attention_masks.visible_keys) with them."""
    return key_mask(lengths, visible, keys)[:, 0] if news is None else visible_keys(lengths, visible, keys)


def _block_states(mask, rows: int, width: int, keys: int) -> torch.Tensor:
    """[b, Qb, Kb]: 0 skipped, 1 partial (the rule evaluated), 2 full (seen without the rule)."""
    query_blocks, key_blocks = -(-width // BLOCK), -(-keys // BLOCK)
    states = torch.zeros(rows, query_blocks, key_blocks, dtype=torch.long)
    for r in range(rows):
        for q in range(query_blocks):
            for count, indices, state in ((mask.kv_num_blocks, mask.kv_indices, 1),
                                          (mask.full_kv_num_blocks, mask.full_kv_indices, 2)):
                listed = indices[r, 0, q, :int(count[r, 0, q])].tolist()
                assert len(set(listed)) == len(listed) and not states[r, q, listed].any(), (r, q)  # listed once
                states[r, q, listed] = state
    return states


@pytest.mark.parametrize("width", [1, 2, 3, 8, 32, 127, 128, 129, 300])
def test_the_blocks_a_kernel_runs_give_the_rule_and_skip_dead_keys(width):
    rng = random.Random(width)
    for case in range(40):
        lengths, visible, news, keys = _case(rng, width, padded=case % 2 == 1)
        rows = lengths.shape[0]
        rule = _rule(lengths, visible, news, keys)  # [b, T, L]
        mask = block_attention.block_mask(lengths, visible, keys, news)
        states = _block_states(mask, rows, width, keys)
        cells = states.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)[:, :width, :keys]  # [b, T, L]
        computed = (cells == 2) | ((cells == 1) & rule)
        real = torch.ones(rows, width, dtype=torch.bool) if news is None else \
            torch.arange(width)[None, :] < news[:, None]  # [b, T]
        assert torch.equal(computed[real], rule[real]), (width, case)
        # work: no block past the last new key a query block's nodes see (they see only nodes before them), no
        # block for a query block of padding only
        for r in range(rows):
            real_nodes = width if news is None else int(news[r])
            for q in range(states.shape[1]):
                last_key = int(lengths[r]) + min(real_nodes, (q + 1) * BLOCK) - 1
                assert not states[r, q, last_key // BLOCK + 1:].any(), (width, case, r, q)
            if news is not None:
                assert not states[r, -(-int(news[r]) // BLOCK):].any(), (width, case, r)
            assert (states[r, :, :int(lengths[r]) // BLOCK] != 1).all()  # cached blocks skip the rule


def test_attend_equals_masked_sdpa():
    """Grouped-query heads (H = 3 KV) over a strided cache view, as the graph-ready step calls it."""
    rng = random.Random(7)
    for width, padded in ((1, False), (4, False), (200, True)):
        lengths, visible, news, keys = _case(rng, width, padded)
        rows = lengths.shape[0]
        cache_keys, cache_values = torch.randn(2, rows + 1, 3, keys + 50, 16).unbind(0)  # [slots, KV, capacity, d]
        query = torch.randn(rows, 9, width, 16)
        out = block_attention.attend(query, cache_keys[:rows, :, :keys], cache_values[:rows, :, :keys],
                                     block_attention.block_mask(lengths, visible, keys, news), 0.25)  # [b, T, H, d]
        expected = F.scaled_dot_product_attention(query, cache_keys[:rows, :, :keys], cache_values[:rows, :, :keys],
                                                  attn_mask=_rule(lengths, visible, news, keys)[:, None], scale=0.25,
                                                  enable_gqa=True).transpose(1, 2)
        real = torch.ones(rows, width, dtype=torch.bool) if news is None else \
            torch.arange(width)[None, :] < news[:, None]
        torch.testing.assert_close(out[real], expected[real], rtol=1e-5, atol=1e-5)


def test_where_the_compiled_kernel_fails_masked_sdpa_takes_over(monkeypatch, caplog):
    """One log line, then the same attention through SDPA with the rule as a mask, for every later call too."""
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("no kernel for this shape\nand more")

    monkeypatch.setattr(block_attention, "COMPILED_ON", ("cpu",))
    monkeypatch.setattr(block_attention, "_kernels", {"cpu": failing})  # as torch.compile had made it
    rng = random.Random(5)
    for width, padded in ((3, False), (140, True)):
        lengths, visible, news, keys = _case(rng, width, padded)
        rows = lengths.shape[0]
        query, cache_keys, cache_values = torch.randn(rows, 4, width, 8), *torch.randn(2, rows, 2, keys, 8)
        mask = block_attention.block_mask(lengths, visible, keys, news)
        with caplog.at_level(logging.WARNING, logger=block_attention.__name__):
            out = block_attention.attend(query, cache_keys, cache_values, mask, 0.3)
        expected = block_attention.flex_attention(query, cache_keys, cache_values, block_mask=mask, scale=0.3,
                                                  enable_gqa=True).transpose(1, 2)
        real = torch.ones(rows, width, dtype=torch.bool) if news is None else \
            torch.arange(width)[None, :] < news[:, None]
        torch.testing.assert_close(out[real], expected[real], rtol=1e-5, atol=1e-5)
    assert len(calls) == 1 and block_attention._kernels == {"cpu": None}
    assert [r.message for r in caplog.records if "masked SDPA from now on" in r.message] and len(caplog.records) == 1


def test_past_the_recompile_limit_masked_sdpa_takes_over(monkeypatch, caplog):
    """Past Dynamo's recompile limit a compiled function would silently run its eager form (for flex_attention, the
    whole score matrix): here the limit raises, and attend falls back to masked SDPA with one log line."""
    compile_ = torch.compile

    def compile_eagerly(function, **options):  # attend's compile without Inductor; flex_attention's own unchanged
        return compile_(function, **(options or {"backend": "eager"}))

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", False)  # attend's first call sets it
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", False)  # each new shape: a recompile
    monkeypatch.setattr(block_attention, "COMPILED_ON", ("cpu",))
    monkeypatch.setattr(block_attention, "_kernels", {})
    torch._dynamo.reset()
    rng = random.Random(11)
    try:
        with caplog.at_level(logging.WARNING, logger=block_attention.__name__):
            for width, padded in ((2, False), (5, False), (7, True)):
                assert block_attention.kernel_state("cpu") == ("not compiled yet" if width == 2 else
                                                               "compiled" if width == 5 else "failed")
                lengths, visible, news, keys = _case(rng, width, padded)
                rows = lengths.shape[0]
                query, cache_keys, cache_values = torch.randn(rows, 4, width, 8), *torch.randn(2, rows, 2, keys, 8)
                mask = block_attention.block_mask(lengths, visible, keys, news)
                out = block_attention.attend(query, cache_keys, cache_values, mask, 0.3)
                expected = F.scaled_dot_product_attention(query, cache_keys, cache_values, scale=0.3,
                                                          attn_mask=_rule(lengths, visible, news, keys)[:, None],
                                                          enable_gqa=True).transpose(1, 2)
                real = torch.ones(rows, width, dtype=torch.bool) if news is None else \
                    torch.arange(width)[None, :] < news[:, None]
                torch.testing.assert_close(out[real], expected[real], rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()
    assert block_attention._kernels == {"cpu": None} and block_attention.kernel_state("cpu") == "failed"
    messages = [r.message for r in caplog.records]
    assert len(messages) == 1 and "masked SDPA from now on" in messages[0] and "FailOnRecompileLimitHit" in messages[0]


@pytest.mark.slow  # Inductor compiles flex_attention's CPU kernel (~15 s)
def test_compiled_flex_attention_honours_the_blocks(monkeypatch, tmp_path):
    """The compiled kernel skips what the block mask skips and still gives the rule's result: if the blocks missed a
    key a row sees, or a full block held a key it does not, this would differ from the eager result."""
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("Inductor's CPU code needs a C++ compiler")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    compiled = torch.compile(block_attention.flex_attention, dynamic=False)
    rng = random.Random(3)
    for width, padded in ((3, False), (150, True)):
        lengths, visible, news, keys = _case(rng, width, padded)
        keys = -(-keys // 256) * 256
        rows = lengths.shape[0]
        query, cache_keys, cache_values = torch.randn(rows, 6, width, 32), *torch.randn(2, rows, 2, keys, 32)
        mask = block_attention.block_mask(lengths, visible, keys, news)
        fast = compiled(query, cache_keys, cache_values, block_mask=mask, scale=0.2, enable_gqa=True).transpose(1, 2)
        eager = block_attention.attend(query, cache_keys, cache_values, mask, 0.2)
        real = torch.ones(rows, width, dtype=torch.bool) if news is None else \
            torch.arange(width)[None, :] < news[:, None]
        torch.testing.assert_close(fast[real], eager[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
def test_flex_attention_gives_greedy_tokens_in_graph_steps_and_prefill(make, monkeypatch):
    """SPECBATCH_GPU_ATTENTION=flex: the graph-ready steps (eager) and the eager forward's masked prefill both attend
    through block_attention.attend, and a mixed batch of chains and trees still gives HF greedy's tokens."""
    monkeypatch.setenv(block_attention.MODE_ENV, "flex")
    monkeypatch.setenv(graph_step.MODE_ENV, "eager")
    calls = {"graph": 0, "forward": 0}
    build = block_attention.block_mask

    def counted(lengths, visible, keys, news=None):  # the graph step's rows carry no news: padding sees itself
        calls["graph" if news is None else "forward"] += 1
        return build(lengths, visible, keys, news)

    monkeypatch.setattr(block_attention, "block_mask", counted)
    engine = Engine.from_runners(make(0))
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS)]
    results = _decode_mixed(engine, prompts, MIXED)
    assert engine.target.graph_step().attention == "flex" and engine.target.graph_step().steps > 0
    assert calls["graph"] > 0 and calls["forward"] > 0, calls
    for key, prompt in enumerate(prompts):
        assert results[key]["error"] is None, results[key]["error"]
        assert results[key]["output_token_ids"] == hf_greedy(engine.target, prompt, MAX_NEW), key
    assert sum(r["accepted_tokens"] for r in results.values()) > 20


def test_mode(monkeypatch):
    monkeypatch.delenv(block_attention.MODE_ENV, raising=False)
    assert block_attention.attention_mode() == "auto"
    monkeypatch.setenv(graph_step.MODE_ENV, "eager")
    assert tiny_llama(0).graph_step().attention == "sdpa"  # auto times captured graphs only
    monkeypatch.setenv(block_attention.MODE_ENV, "fast")
    with pytest.raises(ValueError, match="SPECBATCH_GPU_ATTENTION='fast'"):
        block_attention.attention_mode()


class _Replay:
    """A CPU's stand-in for a captured graph: a replay recomputes the bucket with its attention into the captured
    output, then sleeps out the rest of its stated time: a replay takes max(stated, recompute). Eager flex on a CPU
    recomputes slower than a stated time of a few ms, so the stated times sit apart by more than any recompute."""

    def __init__(self, step, args, output, seconds):
        self.step, self.args, self.output, self.seconds = step, args, output, seconds
        self.attention = step.attention

    def replay(self):
        started = time.perf_counter()
        chosen, self.step.attention = self.step.attention, self.attention
        try:
            with torch.inference_mode():
                self.output.copy_(self.step.compute(*self.args))
        finally:
            self.step.attention = chosen
        time.sleep(max(0.0, self.seconds[self.attention] - (time.perf_counter() - started)))


@pytest.mark.parametrize("seconds, fails, picked", [({"sdpa": 0.25, "flex": 0.005}, None, "flex"),
                                                     ({"sdpa": 0.005, "flex": 0.25}, None, "sdpa"),
                                                     ({"sdpa": 0.01, "flex": 0.005}, "flex", "sdpa"),
                                                     ({"sdpa": 0.01, "flex": 0.005}, "flex kernel", "sdpa")])
def test_auto_keeps_the_faster_attention_of_the_first_capture(monkeypatch, caplog, seconds, fails, picked):
    """`auto` under captured steps: the first bucket is captured with each attention and replayed; the faster
    serves every bucket (one log line), and the tokens are greedy's. A capture that fails drops its attention out, as
    does a flex capture whose compiled kernel failed (it holds masked SDPA)."""
    monkeypatch.delenv(block_attention.MODE_ENV, raising=False)
    monkeypatch.setenv(graph_step.MODE_ENV, "captured")
    monkeypatch.setattr(block_attention, "_kernels", {})

    def capture(self, bucket, inputs, cache, verify):
        if self.attention == fails:
            raise RuntimeError("no kernel for this")
        if self.attention == "flex" and fails == "flex kernel":  # as attend's fallback leaves it
            monkeypatch.setattr(block_attention, "COMPILED_ON", ("cpu",))
            block_attention._kernels["cpu"] = None
        output = self.compute(bucket, inputs, cache, verify)
        return graph_step._Captured(_Replay(self, (bucket, inputs, cache, verify), output, seconds), output)

    monkeypatch.setattr(graph_step.GraphStep, "_capture", capture)
    engine = Engine.from_runners(tiny_llama(0))
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS[:3])]
    with caplog.at_level(logging.INFO, logger=graph_step.__name__):
        results = _decode_mixed(engine, prompts, MIXED[:3], batch_size=3)
    step = engine.target.graph_step()
    assert step.attention == picked and step.capture and step.captures == len(step.graphs) >= 2
    assert set(step.attention_ms) == {"sdpa", "flex"} - {fails, "flex" if fails == "flex kernel" else None}
    assert all(graph.graph.attention == picked for graph in step.graphs.values())  # every bucket: the pick
    messages = [r.message for r in caplog.records]
    assert sum(f"attend through {picked}" in m for m in messages) == 1, messages
    assert sum("is not a candidate" in m for m in messages) == (fails is not None), messages
    assert sum("did not compile" in m for m in messages) == (fails == "flex kernel"), messages
    for key, prompt in enumerate(prompts):
        assert results[key]["output_token_ids"] == hf_greedy(engine.target, prompt, MAX_NEW), key


@pytest.mark.parametrize("seconds, fails, picked", [({"sdpa": 0.2, "flex": 0.03}, None, "flex"),
                                                     ({"sdpa": 0.03, "flex": 0.2}, None, "sdpa"),
                                                     ({"sdpa": 0.2, "flex": 0.03}, "flex", "sdpa"),
                                                     ({"sdpa": 0.2, "flex": 0.03}, "flex kernel", "sdpa")])
def test_auto_times_the_first_masked_prefill(monkeypatch, caplog, seconds, fails, picked):
    """`auto` where steps are captured: the first prefill of several prompts runs with each attention (stand-in
    times here), the faster serves the later prefills, the timing counts apart from the prefill, a flex forward that
    fails (or whose kernel did) drops out, and the tokens are greedy's."""
    monkeypatch.delenv(block_attention.MODE_ENV, raising=False)
    monkeypatch.setenv(graph_step.MODE_ENV, "captured")  # on a CPU the steps go eager at their first capture
    monkeypatch.setattr(block_attention, "_kernels", {})
    run, prefills = ModelRunner._run, []

    def timed(self, cache, lengths, batch, plan, head):
        if batch.prefill:
            attention = "sdpa" if plan.blocks is None else "flex"
            prefills.append(attention)
            if attention == fails:
                raise RuntimeError("no kernel for this")
            if attention == "flex" and fails == "flex kernel":  # as attend's fallback leaves it
                monkeypatch.setattr(block_attention, "COMPILED_ON", ("cpu",))
                block_attention._kernels["cpu"] = None
            started = time.perf_counter()  # the stand-in time, whatever the real forward took (see _Replay)
            output = run(self, cache, lengths, batch, plan, head)
            time.sleep(max(0.0, seconds[attention] - (time.perf_counter() - started)))
            return output
        return run(self, cache, lengths, batch, plan, head)

    monkeypatch.setattr(ModelRunner, "_run", timed)
    engine = Engine.from_runners(tiny_llama(0))
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate([30, 12, 25, 40])]
    decoder = engine.decoder(batch_size=2, speculation_budget=False)  # `ar` rows end together: two masked prefills
    for key, prompt in enumerate(prompts):
        decoder.submit(engine.request(BatchItem(key, prompt, DecodeParams(max_new_tokens=8)), "ar", None, decoder))
    with caplog.at_level(logging.INFO, logger="specdec_core.model.model_runner"):
        results = {request.key: result for request, result in decoder.run()}
    runner = engine.target
    assert runner.prefill_attention == picked
    assert set(runner.prefill_attention_ms) == {"sdpa", "flex"} - {fails, "flex" if fails == "flex kernel" else None}
    tried = ["flex"] * (1 if fails == "flex" else 2) + ["sdpa"] * 2  # a failing forward stops its attention's runs
    assert prefills == tried + [picked], prefills  # the second masked prefill: the pick alone
    pick_s = 2 * seconds["sdpa"] + (2 * seconds["flex"] if fails != "flex" else 0) - seconds["sdpa"]
    assert pick_s <= runner.attention_pick_s <= decoder.stats.capture_s
    kept = seconds["sdpa"] + seconds[picked]  # the first prefill's last forward, then the second prefill's
    assert kept <= decoder.stats.prefill_s < kept + 0.15  # (the pick's seconds counted once, apart)
    assert sum(f"prefills attend through {picked}" in r.message for r in caplog.records) == 1
    for key, prompt in enumerate(prompts):
        assert results[key].token_ids == hf_greedy(runner, prompt, 8), key


def test_no_prefill_is_timed_where_steps_are_not_captured(monkeypatch):
    monkeypatch.delenv(block_attention.MODE_ENV, raising=False)
    monkeypatch.setenv(graph_step.MODE_ENV, "eager")
    engine = Engine.from_runners(tiny_llama(0))
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate([30, 12])]
    engine.decode_batch([BatchItem(k, p, DecodeParams(max_new_tokens=4)) for k, p in enumerate(prompts)], "ar",
                        None, 2)
    assert engine.target.prefill_attention is None and engine.target.attention_pick_s == 0
