"""The graph-ready decode and verify step (graph_step.py), on the CPU: run eagerly on its static buffers it gives
greedy's tokens (chains, trees, a batch of mixed drafters, Llama and Qwen2), verifies on the device exactly as the
host verifier does, copies to the host once a step, picks its buckets, and where capture fails runs eagerly with one
log line. The real model's check is test_lossless.py's; the GPU's timing is benchmarks/gpu_step_roofline.py's."""

import logging
import random
import re
import time

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from specdec_core.drafters.base import Draft
from specdec_core.engine import BatchItem, Engine
from specdec_core.loop.batch_decode import _drawn_on_device
from specdec_core.loop.draft_tree import ancestor_mask, build_trie, depths
from specdec_core.loop.kv_cache import new_slot_cache
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.sampling import (PositionDraws, SamplingParams, draw_nodes, logits_to_probs, row_seed,
                                        sample)
from specdec_core.loop.speculation_budget import batch_bucket, context_bucket
from specdec_core.loop.verification import accept_greedy, accept_greedy_nodes, verify_tree_greedy
from specdec_core.methods import MethodOptions
from specdec_core.model import block_attention, graph_step
from specdec_core.model.graph_step import GraphStep
from specdec_core.model.model_runner import ModelRunner
from specdec_core.model.step_batch import StepBatch
from specdec_core.model.step_buckets import KEY_QUANTUM, Bucket, bucket_for
from tests.tiny_models import DigitsTokenizer, hf_greedy, repetitive_prompt, tiny_llama, tiny_qwen2

LENGTHS = [6, 41, 13, 60, 24, 9, 33, 18]
MAX_NEW = 24
MIXED = [("ar", MethodOptions()), ("pld", MethodOptions()), ("copyspec", MethodOptions(candidates=3)),
         ("copyspec", MethodOptions())]


def _runner(make, mode: str, monkeypatch):
    monkeypatch.setenv(graph_step.MODE_ENV, mode)
    return make(0)


def _decode_mixed(engine, prompts, plans, batch_size=4):
    """prompts[i] decoded with plans[i % len(plans)] in one decoder -> {key: result dict}."""
    decoder = engine.decoder(batch_size=batch_size, speculation_budget=False)
    methods = {}
    for key, prompt in enumerate(prompts):
        method, options = plans[key % len(plans)]
        decoder.submit(engine.request(BatchItem(key, prompt, DecodeParams(max_new_tokens=MAX_NEW)), method, options,
                                      decoder))
        methods[key] = method
    return {request.key: engine.result_dict(methods[request.key], request.params, result)
            for request, result in decoder.run()}


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
def test_eager_graph_steps_give_greedy_tokens_in_a_mixed_batch(make, monkeypatch):
    """Rows of plain decoding, chains and trees share each step; every step goes through the graph-ready step."""
    engine = Engine.from_runners(_runner(make, "eager", monkeypatch))
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS)]
    results = _decode_mixed(engine, prompts, MIXED)
    step = engine.target.graph_step()
    assert step is not None and step.mode == "eager" and step.steps > 0
    drafted = accepted = 0
    for key, prompt in enumerate(prompts):
        row = results[key]
        assert row["error"] is None, row["error"]
        assert row["output_token_ids"] == hf_greedy(engine.target, prompt, MAX_NEW), key
        drafted, accepted = drafted + row["drafted_tokens"], accepted + row["accepted_tokens"]
    assert drafted > accepted > 20, (drafted, accepted)  # accepted drafts, and rejected tokens rolled back


@pytest.mark.slow  # Inductor compiles in worker processes
def test_compiled_steps_give_greedy_tokens(monkeypatch, tmp_path):
    """The compiled mode: each layer's dense work fused by Inductor (here its CPU code), the cache write and the
    attention between; chains and trees still give greedy's tokens."""
    import shutil

    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("Inductor's CPU code needs a C++ compiler (without one the step runs uncompiled, one log line)")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    engine = Engine.from_runners(_runner(tiny_qwen2, "compiled", monkeypatch))
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS[:4])]
    results = _decode_mixed(engine, prompts, MIXED)
    step = engine.target.graph_step()
    assert step.mode == "compiled" and step.fused is not None and step.steps > 0
    assert step.after_attention.run not in (None, graph_step._dense_after_attention)  # it compiled, and kept it
    for key, prompt in enumerate(prompts):
        assert results[key]["output_token_ids"] == hf_greedy(engine.target, prompt, MAX_NEW), key
    assert sum(r["accepted_tokens"] for r in results.values()) > 0


def _random_draft(rng: random.Random, width: int):
    """A chain, a tree (with a repeated sibling now and then) or nothing, of at most width - 1 nodes."""
    kind = rng.choice(["chain", "tree", "none"])
    if kind == "none":
        return [], None
    if kind == "chain":
        return [rng.randrange(4) for _ in range(rng.randrange(1, width))], None
    branches = [[rng.randrange(4) for _ in range(rng.randrange(1, 4))] for _ in range(rng.randrange(1, 4))]
    tokens, parents = build_trie(branches)
    tokens, parents = tokens[:width - 1], parents[:width - 1]
    if len(tokens) >= 2 and rng.random() < 0.3:  # a repeated sibling: the host walks into the first one
        tokens.append(tokens[0])
        parents.append(parents[0])
        tokens, parents = tokens[:width - 1], parents[:width - 1]
    return tokens, parents


def test_device_verification_equals_the_host_verifiers():
    """accept_greedy_nodes against accept_greedy (chains) and verify_tree_greedy (trees) on random drafts and random
    argmaxes over a small alphabet (so drafts are often accepted), padding rows and padding nodes included."""
    rng = random.Random(0)
    width, rows = 8, 64
    for _ in range(20):
        drafts = [_random_draft(rng, width) for _ in range(rows)]
        step_ids = torch.zeros(rows, width, dtype=torch.long)
        visible = torch.zeros(rows, width, width, dtype=torch.bool)
        depth = torch.zeros(rows, width, dtype=torch.long)
        argmax = torch.randint(0, 4, (rows, width), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        for r, (tokens, parents) in enumerate(drafts):
            step_ids[r, 0] = 9
            step_ids[r, 1:1 + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            tree = parents if parents is not None else list(range(-1, len(tokens) - 1))
            visible[r] = ancestor_mask(tree, width)
            depth[r, 1:1 + len(tokens)] = torch.tensor(depths(tree), dtype=torch.long)
        found = accept_greedy_nodes(step_ids, visible, depth, argmax).tolist()
        for r, (tokens, parents) in enumerate(drafts):
            node_argmax = argmax[r, :1 + len(tokens)].tolist()
            if parents is None:
                accepted, token = accept_greedy(tokens, node_argmax)
                assert found[r][0] == accepted and found[r][1] == accepted and found[r][2] == token, (r, tokens)
            else:
                expected = verify_tree_greedy(parents, tokens, node_argmax)
                last = expected.path[-1] + 1 if expected.path else 0
                assert found[r] == [expected.num_accepted, last, expected.next_token], (r, tokens, parents)


def test_buckets():
    assert bucket_for(3, 1, 100, slots=8, capacity=512) == Bucket(4, 1, KEY_QUANTUM)
    assert bucket_for(5, 3, 254, slots=8, capacity=512) == Bucket(8, 4, 2 * KEY_QUANTUM)  # 254 + 4 keys
    assert bucket_for(40, 9, 10, slots=48, capacity=512) == Bucket(48, 16, KEY_QUANTUM)  # the cache's slots cap rows
    assert bucket_for(2, 2, 511, slots=2, capacity=512) is None  # 511 + 2 keys: no room past the longest row
    assert bucket_for(2, 2, 511, slots=2, capacity=768).keys == 768
    assert bucket_for(2, 40, 10, slots=2, capacity=512) is None  # wider than any bucket: the eager forward
    assert bucket_for(3, 1, 10, slots=2, capacity=512) is None


SYNCS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
         torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
         torch.Tensor.masked_select, torch.masked_select, torch.unique, torch.Tensor.unique, torch.equal}


class HostReads(TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host (on a GPU each waits for the device), and indexing
    by a boolean mask (its result's shape comes from the data)."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCS:
            self.seen.append(func.__name__)
        elif func is torch.Tensor.__getitem__ and _boolean_index(args[1]):
            self.seen.append("boolean index")
        return func(*args, **kwargs)


def _boolean_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


def test_a_graph_ready_step_reads_the_device_once(monkeypatch):
    """Every step of a drafting batch, its buffers' filling included, reads the device exactly once (its [rows, 3]
    verdicts), and only when the loop asks for its result: the launch reads nothing, so the host goes on while the
    device works. The eager forward and host verification it replaces read it several times a step (the hook sees
    them)."""
    engine = Engine.from_runners(_runner(tiny_llama, "eager", monkeypatch))
    launches, results = [], []
    launch, result = GraphStep.launch, graph_step.Launched.result
    monkeypatch.setattr(GraphStep, "launch", lambda self, *a, **k: _count(launches, launch, self, a, k))
    monkeypatch.setattr(graph_step.Launched, "result", lambda self: _count(results, result, self, (), {}))
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS[:4])]
    decoded = _decode_mixed(engine, prompts, MIXED)
    assert sum(r["drafted_tokens"] for r in decoded.values()) > 0
    assert launches and set(launches) == {0}, launches
    assert len(results) == len(launches) and set(results) == {1}, results
    # the eager path's steps, counted the same way: the hook can fail
    engine.target.graph_mode = "off"
    engine.target._graph_step = None
    eager = []
    forward = type(engine.target).forward_slots
    monkeypatch.setattr(type(engine.target), "forward_slots", lambda self, *a, **k: _count(eager, forward, self, a, k))
    _decode_mixed(engine, prompts, MIXED)
    assert eager and max(eager) > 1, eager


@pytest.mark.parametrize("mode", ["eager", "off"])
def test_drafters_bookkeeping_runs_while_the_step_verifies(mode, monkeypatch):
    """`suffix`'s job memory append (Drafter.while_verifying) runs once a step for every live row, drafting or not:
    after the graph-ready step's launch and before its verdicts are read, or before an eager forward, which blocks.
    The rows still give greedy's tokens."""
    from specdec_core.drafters.suffix import SuffixDrafter
    from specdec_core.model.model_runner import ModelRunner

    engine = Engine.from_runners(_runner(tiny_llama, mode, monkeypatch))
    events = []
    launch, result, work = GraphStep.launch, graph_step.Launched.result, SuffixDrafter.while_verifying
    forward = ModelRunner.forward_slots
    monkeypatch.setattr(GraphStep, "launch", lambda self, *a, **k: events.append("launch") or launch(self, *a, **k))
    monkeypatch.setattr(graph_step.Launched, "result", lambda self: events.append("result") or result(self))
    monkeypatch.setattr(SuffixDrafter, "while_verifying", lambda self, t: events.append("work") or work(self, t))
    monkeypatch.setattr(ModelRunner, "forward_slots", lambda self, *a, **k: events.append("forward") or forward(
        self, *a, **k))
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS[:3])]
    results = _decode_mixed(engine, prompts, [("suffix", MethodOptions())], batch_size=3)
    for key, prompt in enumerate(prompts):
        assert results[key]["output_token_ids"] == hf_greedy(engine.target, prompt, MAX_NEW), key
    assert sum(r["accepted_tokens"] for r in results.values()) > 0
    steps = "".join({"launch": "L", "result": "R", "work": "w", "forward": "F"}[e] for e in events)
    decode = steps.lstrip("F")  # (prefill's forwards come first: the batch of 3 starts together)
    if mode == "eager":
        assert decode.count("L") > 5 and "F" not in decode
        assert re.fullmatch(r"(Lw{1,3}R)+", decode), decode
        assert decode[:4] == "Lwww"  # every row works
    else:
        assert "L" not in decode and decode.count("F") > 5 and decode[:4] == "wwwF"
        assert re.fullmatch(r"(w{1,3}F)+", decode), decode


def _count(counts, function, runner, args, kwargs):
    with HostReads() as reads:
        out = function(runner, *args, **kwargs)
    counts.append(len(reads.seen))
    return out


def test_where_capture_fails_the_step_runs_eagerly(monkeypatch, caplog):
    """On a CPU there is no CUDA graph: `captured` logs one line, runs every step eagerly from then on and gives the
    same tokens."""
    engine = Engine.from_runners(_runner(tiny_llama, "captured", monkeypatch))
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS[:3])]
    with caplog.at_level(logging.WARNING, logger=graph_step.__name__):
        results = _decode_mixed(engine, prompts, MIXED[:3], batch_size=3)
    step = engine.target.graph_step()
    failed = [r.message for r in caplog.records if "runs eagerly" in r.message]
    assert step.captures == 0 and len(failed) == len(step.graphs) == 1 and not step.capture, failed
    assert "CUDA graphs need a CUDA device" in failed[0] and step.steps > 1
    for key, prompt in enumerate(prompts):
        assert results[key]["output_token_ids"] == hf_greedy(engine.target, prompt, MAX_NEW)


def test_modes(monkeypatch):
    monkeypatch.setenv(graph_step.MODE_ENV, "auto")
    assert graph_step.step_mode("cpu") == "off" and graph_step.step_mode("cuda:0") == "compiled"
    assert tiny_llama(0).graph_step() is None  # the CPU's own kernels serve its steps by default
    monkeypatch.setenv(graph_step.MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match="SPECBATCH_GRAPH_STEP='sometimes'"):
        graph_step.step_mode("cpu")


def test_key_mask():
    """A row sees its cached keys, the nodes it is shown at length + their index, and itself; never past that."""
    visible = torch.zeros(2, 3, 3, dtype=torch.bool)
    visible[0] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a tree: nodes 1 and 2 under 0
    mask = graph_step.key_mask(torch.tensor([2, 0]), visible, 6)[:, 0]  # [2, 3, 6]
    assert mask[0].int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]]
    assert mask[1].int().tolist() == [[1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0]]  # padding: itself


class _Replay:
    """A CPU's stand-in for a captured graph: each replay recomputes the bucket into the captured output."""

    def __init__(self, step, args, output):
        self.step, self.args, self.output = step, args, output

    def replay(self):
        with torch.inference_mode():
            self.output.copy_(self.step.compute(*self.args))


def _decode_pld(engine):
    """Three prompts decoded with `pld` under the speculation budget -> (decoder, prompts, {key: DecodeResult})."""
    decoder = engine.decoder(batch_size=3, speculation_budget=True)
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS[:3])]
    for key, prompt in enumerate(prompts):
        decoder.submit(engine.request(BatchItem(key, prompt, DecodeParams(max_new_tokens=MAX_NEW)), "pld",
                                      MethodOptions(), decoder))
    return decoder, prompts, {request.key: result for request, result in decoder.run()}


def test_capture_time_is_reported_apart(monkeypatch):
    """Captures (here slow stand-ins on a CPU) are counted in the pass's capture_s, within its wall time, and in no
    step's cost the budget learns from; each bucket is captured once, and replays give greedy's tokens."""
    from specdec_core.loop.speculation_budget import StepCostModel

    engine = Engine.from_runners(_runner(tiny_llama, "captured", monkeypatch))

    def slow_capture(self, bucket, inputs, cache, verify):
        time.sleep(0.2)
        output = self.compute(bucket, inputs, cache, verify)
        return graph_step._Captured(_Replay(self, (bucket, inputs, cache, verify), output), output)

    monkeypatch.setattr(GraphStep, "_capture", slow_capture)
    learned = []
    record = StepCostModel.observe
    monkeypatch.setattr(StepCostModel, "observe", lambda self, rows, width, seconds, *a, **k: (
        learned.append(seconds), record(self, rows, width, seconds, *a, **k))[1])
    decoder, prompts, results = _decode_pld(engine)
    step = engine.target.graph_step()
    buckets = len(step.graphs)
    assert buckets >= 2 and step.captures == buckets and step.steps > buckets  # replays after each capture
    assert 0.2 * buckets <= decoder.stats.capture_s <= decoder.stats.wall_s
    # the steps' own time, captures left out (counted twice, the two would pass the wall time)
    assert 0 < decoder.stats.graph_s <= decoder.stats.wall_s - decoder.stats.capture_s
    assert learned and max(learned) < 0.2, max(learned)
    for key, prompt in enumerate(prompts):
        assert results[key].token_ids == hf_greedy(engine.target, prompt, MAX_NEW), key


class _TimedReplay(_Replay):
    """A stand-in replay that takes longer the wider its bucket: what the decoder's width timing should see."""

    def replay(self):
        time.sleep(0.01 + 0.005 * self.args[0].width)  # steps 5 ms apart a width: far above the compute's noise
        super().replay()


def test_captured_steps_time_their_widths_for_the_budget(monkeypatch):
    """Where steps are captured, the first time the rows meet a (batch bucket, context bucket) with drafts, a step
    is timed at widths 1, 2, 4 and 8 and the budget gets their cost ratios; the timing counts as capture time,
    adds no decoding step, and decoding still gives greedy's tokens. Eager steps (a CPU) time nothing."""
    from specdec_core.loop.speculation_budget import StepCostModel

    engine = Engine.from_runners(_runner(tiny_llama, "captured", monkeypatch))
    monkeypatch.setattr(GraphStep, "_capture", lambda self, bucket, inputs, cache, verify: graph_step._Captured(
        _TimedReplay(self, (bucket, inputs, cache, verify), out := self.compute(bucket, inputs, cache, verify)), out))
    calibrations, timed = [], []
    calibrate, time_widths = StepCostModel.calibrate, GraphStep.time_widths
    monkeypatch.setattr(StepCostModel, "calibrate", lambda self, rows, context, ratios: (
        calibrations.append((rows, context, ratios)), calibrate(self, rows, context, ratios))[1])

    def counted(self, *args, **kwargs):
        steps, started = self.steps, time.perf_counter()
        out = time_widths(self, *args, **kwargs)
        timed.append(time.perf_counter() - started)
        assert self.steps == steps  # no decoding step
        return out

    monkeypatch.setattr(GraphStep, "time_widths", counted)
    decoder, prompts, results = _decode_pld(engine)
    for key, prompt in enumerate(prompts):
        assert results[key].token_ids == hf_greedy(engine.target, prompt, MAX_NEW), key
    assert calibrations, "no widths timed"
    buckets = {(batch_bucket(rows), context_bucket(context)) for rows, context, _ in calibrations}
    assert len(buckets) == len(calibrations)  # once per (batch bucket, context bucket)
    for _, _, ratios in calibrations:
        assert sorted(ratios) == [1, 2, 4, 8]
        # widths may share a bucket (one sleep: level within the compute's noise there); 8 sits in a wider one
        # than 1 (sleeps alone: at least 0.05 / 0.03 s, at most 0.05 / 0.015 s)
        assert ratios[2] < 1.25 * ratios[4] and ratios[4] < 1.25 * ratios[8] and 1.4 < ratios[8] < 5.0, ratios
    assert sum(timed) <= decoder.stats.capture_s <= decoder.stats.wall_s

    # eagerly, a timed step would cost a whole forward: nothing is timed
    eager = Engine.from_runners(_runner(tiny_llama, "eager", monkeypatch))
    calibrations.clear()
    _decode_mixed(eager, prompts, MIXED)
    assert not eager.target.graph_step().calibrates and not calibrations


def test_calibrated_widths_price_the_first_wide_steps():
    """One timing per width replaces the priors in its bucket (a GPU's wide steps cost little more than plain ones;
    the priors are a CPU's), and buckets without a timing keep borrowing as before."""
    from specdec_core.loop.speculation_budget import StepCostModel

    model = StepCostModel()
    before = model.ratio(128, 4, context=500)
    assert model.ratio(64, 4, context=500) == before
    model.calibrate(64, 500, {1: 1.0, 2: 1.02, 4: 1.06, 8: 1.14})
    assert before > 1.3 and abs(model.ratio(64, 4, context=500) - 1.06) < 0.03, (before, model.ratio(64, 4, 500))
    assert abs(model.ratio(64, 8, context=500) - 1.14) < 0.04
    assert model.ratio(128, 4, context=500) == before  # more rows borrow no fewer rows' fit (it could overprice)


class _OffDevice(TorchDispatchMode):
    """Records every op that gets a tensor from anywhere but `device` (on a GPU: a host copy inside the step, which
    a CUDA graph cannot hold)."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.seen = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for leaf in tree_leaves((args, kwargs or {})):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != self.device:
                self.seen.append(f"{func} got a {leaf.device} tensor of shape {tuple(leaf.shape)}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
@pytest.mark.parametrize("mode, attention, sampled", [("eager", "sdpa", None), ("eager", "flex", None),
                                                      ("compiled", "sdpa", None), ("eager", "sdpa", "temperature"),
                                                      ("eager", "sdpa", "top-p")])
def test_the_step_holds_only_device_tensors(make, mode, attention, sampled, monkeypatch):
    """What a CUDA graph captures, checked without a GPU: the step computed on the meta device (shapes without
    data, and not the CPU, so the GPU's code paths run) over a mixed batch of a chain, a tree and a plain row, with
    sampling rows' draws too. A tensor made on the host inside it, or a read of a device value, would fail there or
    show in the op log."""
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)  # the fused functions, uncompiled
    monkeypatch.setattr(block_attention, "_kernels", {"meta": None})  # flex_attention has no meta kernel: its
    # block mask is still built, and attended through as the fallback does
    model = make(0).model.to("meta")
    runner = ModelRunner(model, DigitsTokenizer(), "tiny-on-meta", "meta", torch.float32, fast_forward=True)
    runner.gpu_attention = attention
    step = GraphStep(runner, mode)
    assert runner.fast is not None and step.attention == attention and (step.fused is not None) == (mode != "eager")
    cache = new_slot_cache(runner)
    lengths = [10, 200, 37]
    cache.fit(4, 512)
    for row, length in enumerate(lengths):
        cache.add_row()
        cache.set_length(row, length)
    parents = [-1, 0, 0, 1]  # the tree row: node 1 and 2 under the pending token, node 3 under node 1
    width = 1 + len(parents)
    visible = torch.ones(width, width, dtype=torch.bool).tril().repeat(3, 1, 1)  # [3, T, T]
    visible[1] = ancestor_mask(parents, width)
    visible[2, 1:] = False  # the plain row: its pending token alone (padding sees nothing)
    offsets = torch.arange(width).repeat(3, 1)
    offsets[1, 1:] = torch.tensor(depths(parents))
    bucket = bucket_for(3, width, max(lengths), cache.slots, cache.capacity)
    inputs = graph_step._Inputs(bucket.rows, bucket.width, torch.device("meta"))
    top_p = [0.9 if sampled == "top-p" else 1.0] * 3
    sampling = graph_step.Sampling([0.8, 0.0, 1.2], [0, 0, 4 if sampled == "top-p" else 0], top_p, [row_seed(s) for s in (1, 2, 3)],
                                   draw_nodes) if sampled else None
    inputs.fill(torch.randint(0, 90, (3, width)), torch.tensor(lengths)[:, None] + offsets, visible, lengths,
                sampling)
    with _OffDevice("meta") as watch:
        out = step.compute(bucket, inputs, cache, accept_greedy_nodes)
    assert out.device.type == "meta" and tuple(out.shape) == (bucket.rows, 3) and out.dtype == torch.long
    assert watch.seen == []
    with _OffDevice("meta") as watch:  # the watch sees a host tensor that indexes (which the meta device takes)
        inputs.packed[:, torch.tensor([0, 2])]
    assert any("aten.index" in seen for seen in watch.seen), watch.seen


@pytest.mark.parametrize("filtered", [False, True])
def test_the_device_draws_what_the_host_draws(filtered):
    """sampling.draw_nodes (a captured step's draws) gives each sampling node the token the host's verifier draws for
    the same position (sampling.sample with PositionDraws, over logits_to_probs's distribution: temperature, top-k,
    top-p), and greedy rows their argmax."""
    gen = torch.Generator().manual_seed(4)
    for vocab in (7, 96, 1000):
        rows, width = 5, 6
        logits = torch.randn(rows, width, vocab, generator=gen) * 3
        temperature = torch.tensor([0.8, 0.0, 1.3, 0.31, 2.0])
        top_k = torch.tensor([0, 4, 5, 0, 3] if filtered else [0] * rows)
        top_p = torch.tensor([1.0, 0.5, 1.0, 0.9, 0.8] if filtered else [1.0] * rows)
        seeds = torch.tensor([row_seed(s) for s in (1, 2, 3, None, 5)])
        positions = torch.randint(0, 5000, (rows, 1), generator=gen) + torch.arange(width)
        argmax = logits.argmax(-1)
        drawn = draw_nodes(logits, argmax, temperature, top_k, top_p, seeds, positions, filtered)
        for b in range(rows):
            for t in range(width):
                if temperature[b] == 0:
                    assert drawn[b, t] == argmax[b, t]
                    continue
                params = SamplingParams(temperature=float(temperature[b]), top_k=int(top_k[b]),
                                        top_p=float(top_p[b]))
                probs = logits_to_probs(logits[b, t], params)
                host = sample(probs, PositionDraws(int(seeds[b]), int(positions[b, t]) + 1))
                assert int(drawn[b, t]) == host, (vocab, b, t)
                assert probs[host] > 0
        assert (drawn != argmax)[temperature > 0].any()  # the draws are not argmaxes in disguise


def test_position_draws_follow_the_distribution():
    """Inverse-CDF draws with the position hash's uniform numbers reproduce p: along one row's positions, and across
    rows' seeds at one position (chi-square, 5 degrees of freedom, under the 0.001 point 20.5)."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    trials = 20000
    along = [sample(probs, PositionDraws(row_seed(9), position)) for position in range(trials)]
    across = [sample(probs, PositionDraws(row_seed(seed), 123)) for seed in range(trials)]
    for draws in (along, across):
        counts = torch.bincount(torch.tensor(draws), minlength=len(probs)).float()
        expected = probs * trials
        assert float(((counts - expected) ** 2 / expected).sum()) < 20.5, counts


PEAKED = {"tiny-llama": 30.0, "tiny-qwen2": 20.0}  # head scales: drafts accepted, draws still not all argmaxes


def _peaked(make):
    """A tiny model whose next-token distributions are peaked (its head scaled up), as a trained model's are: a
    sampled row repeats itself, so copy drafts get accepted under sampling too."""
    runner = make(0)
    with torch.no_grad():
        runner.model.get_output_embeddings().weight.mul_(PEAKED[runner.name])
    return runner


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2])
def test_graph_ready_steps_sample_what_the_eager_forward_samples(make, monkeypatch):
    """Seeded sampling rows (temperature, some with top-p or top-k; one-hot drafts: `ar`, chains and trees) beside
    greedy rows: the graph-ready step draws on the device and gives each row the tokens the eager forward and the
    host's verifier give, and a seeded row's tokens are `ar`'s whatever its method (draws by position)."""
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS)]
    plans = [("ar", MethodOptions()), ("pld", MethodOptions()), ("copyspec", MethodOptions(candidates=3)),
             ("copyspec", MethodOptions())]

    def decode(mode, method=None, greedy_only=False):
        monkeypatch.setenv(graph_step.MODE_ENV, mode)
        engine = Engine.from_runners(_peaked(make))
        decoder = engine.decoder(batch_size=4, speculation_budget=False)
        sampled = []
        launch = GraphStep.launch

        def counted(self, cache, batch, step_ids, verify, sampling=None):
            sampled.append(0 if sampling is None else 1 + sampling.filtered)
            return launch(self, cache, batch, step_ids, verify, sampling)

        monkeypatch.setattr(GraphStep, "launch", counted)
        for key, prompt in enumerate(prompts):
            greedy = greedy_only or key % 3 == 2
            params = DecodeParams(max_new_tokens=48, sampling=SamplingParams(
                temperature=0.0 if greedy else 0.8 + 0.1 * (key % 2), seed=None if greedy else 100 + key,
                top_p=0.9 if key % 4 == 1 else 1.0, top_k=5 if key % 4 == 3 else 0))
            name, options = (method, MethodOptions()) if method else plans[key % len(plans)]
            decoder.submit(engine.request(BatchItem(key, prompt, params), name, options, decoder))
        results = {request.key: result for request, result in decoder.run()}
        monkeypatch.setattr(GraphStep, "launch", launch)
        return results, sampled

    on_device, sampled = decode("eager")
    eager, _ = decode("off")
    ar, _ = decode("off", "ar")
    greedy, _ = decode("off", greedy_only=True)
    assert sampled.count(2) > 5, sampled  # steps drawn on the device, with top-p and top-k
    sampling_rows = [key for key in range(len(prompts)) if key % 3 != 2]
    accepted = sum(on_device[key].metrics.accepted_tokens for key in sampling_rows)
    assert accepted > 15, f"{accepted} draft tokens of sampling rows accepted: the test would prove little"
    assert sum(on_device[key].token_ids != greedy[key].token_ids for key in sampling_rows) >= 3  # they do sample
    for key in range(len(prompts)):
        assert on_device[key].token_ids == eager[key].token_ids == ar[key].token_ids, key


def test_drafts_with_probabilities_run_the_eager_forward():
    one_hot, with_probs = Draft([1, 2], "copy"), Draft([1, 2], "draft_model", probs=torch.full((2, 5), 0.2))
    assert _drawn_on_device(one_hot) and _drawn_on_device(None) and not _drawn_on_device(with_probs)
    sampling = graph_step.Sampling([0.0, 0.7], [20, 0], [0.5, 1.0], [1, 2], draw_nodes)
    assert not sampling.filtered  # a greedy row's top-k and top-p change nothing
    assert graph_step.Sampling([0.0, 0.7], [0, 0], [1.0, 0.9], [1, 2], draw_nodes).filtered


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_the_eager_forward_runs_on_another_device(attention, monkeypatch):
    """The eager forward's GPU path (no CPU kernels: prefill of padded prompts, a verify step), on the meta device:
    a host tensor mixed into a device op there fails, as it would on a GPU."""
    monkeypatch.setattr(block_attention, "_kernels", {"meta": None})  # no meta flex kernel: its fallback, as above
    runner = ModelRunner(tiny_llama(0).model.to("meta"), DigitsTokenizer(), "tiny-on-meta", "meta", torch.float32,
                         fast_forward=True)
    runner.gpu_attention = attention
    cache = new_slot_cache(runner)
    cache.fit(4, 512)
    news, width = torch.tensor([20, 7, 13]), 20
    for _ in news:
        cache.add_row()
    real = torch.arange(width)[None, :] < news[:, None]  # [b, T]
    visible = torch.ones(width, width, dtype=torch.bool).tril() & real[:, None, :] & real[:, :, None]
    prefill = StepBatch(torch.randint(1, 90, (3, width)), torch.arange(width).expand(3, width).clone(), visible,
                        torch.stack([torch.arange(3), news - 1], 1), prefill=True)
    logits = runner.forward_slots(cache, prefill)
    assert logits.device.type == "meta" and tuple(logits.shape) == (3, runner.vocab_size)
    for row, length in enumerate(news.tolist()):
        cache.set_length(row, length)
    chain = torch.ones(4, 4, dtype=torch.bool).tril().expand(3, 4, 4).clone()
    verify = StepBatch(torch.randint(1, 90, (3, 4)), news[:, None] + torch.arange(4), chain,
                       torch.stack([torch.arange(3).repeat_interleave(4), torch.arange(4).repeat(3)], 1))
    logits = runner.forward_slots(cache, verify)
    assert logits.device.type == "meta" and tuple(logits.shape) == (12, runner.vocab_size)


def test_a_failed_capture_of_draws_leaves_greedy_steps_captured(monkeypatch, caplog):
    """Steps that draw have graphs of their own (a sort, a search): where their capture fails, they run eagerly (one
    log line) while greedy steps keep being captured, and every row's tokens stay the same."""
    engine = Engine.from_runners(_runner(tiny_llama, "captured", monkeypatch))
    engine.target.gpu_attention = "sdpa"

    def capture(self, bucket, inputs, cache, verify):
        if inputs.sampled:
            raise RuntimeError("no capture of a sort here")
        output = self.compute(bucket, inputs, cache, verify)
        return graph_step._Captured(_Replay(self, (bucket, inputs, cache, verify), output), output)

    monkeypatch.setattr(GraphStep, "_capture", capture)
    prompts = [repetitive_prompt(seed, length) for seed, length in enumerate(LENGTHS[:3])]
    sampled = DecodeParams(max_new_tokens=8, sampling=SamplingParams(temperature=0.8, seed=5))

    def decode(engine):
        decoder = engine.decoder(batch_size=3, speculation_budget=False)
        for key, prompt in enumerate(prompts):
            params = sampled if key == 0 else DecodeParams(max_new_tokens=MAX_NEW)
            decoder.submit(engine.request(BatchItem(key, prompt, params), "pld", None, decoder))
        return {request.key: result for request, result in decoder.run()}

    with caplog.at_level(logging.WARNING, logger=graph_step.__name__):
        results = decode(engine)
    step = engine.target.graph_step()
    assert step.capture and step.uncapturable == {(True, False)} and step.captures >= 1
    assert sum("with draws failed" in r.message for r in caplog.records) == 1
    monkeypatch.setenv(graph_step.MODE_ENV, "off")
    eager = decode(Engine.from_runners(tiny_llama(0)))
    for key, prompt in enumerate(prompts):
        assert results[key].token_ids == eager[key].token_ids, key
        if key:
            assert results[key].token_ids == hf_greedy(engine.target, prompt, MAX_NEW), key


def test_row_seeds_keep_every_part_of_the_seed():
    seeds = [0, 1, 2, 2**32, 2**32 + 1, 2**64, -1, 2**32 - 1, -2, 2**32 - 2, 7, -7]
    assert len({row_seed(seed) for seed in seeds}) == len(seeds)
    assert row_seed(12345) == row_seed(12345) and 0 <= row_seed(-12345) < 2**32
