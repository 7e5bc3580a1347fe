"""A decode or verify step that a CUDA graph can capture: the fast forward's arithmetic on static buffers, with greedy
verification on the device and one device-to-host copy a step.

On a GPU, a step of a small model is many small kernels, each launched from Python: the launches, not the memory,
set its time. A captured graph replays them all in one launch, but only if the step has no device-to-host
copy inside and no shape that depends on data. So this step:
- runs at a fixed bucket of rows x width x keys (step_buckets.py), whose inputs are device buffers written in place
  (one host-to-device copy of ids, positions and lengths, one of the nodes' visibility);
- writes each node's keys at its row's length + its index, and attends over the bucket's first `keys` positions of
  the cache slots `[0, rows)`: with `SPECBATCH_GPU_ATTENTION=sdpa`, SDPA and an additive mask built on the device from
  the lengths (grouped-query heads folded into the query length, so no key is copied per query head); with `flex`,
  flex_attention and a block mask that skips each row's dead keys (block_attention.py); with `split`, Triton kernels
  that split each row's keys into ranges (kernels/split_kv_attention.py; opt-in until timed on a GPU); with `auto`,
  captured steps time their first bucket's graph with sdpa and flex and keep the faster;
- takes the argmax of every node's logits (or a sampling row's draw, below) and verifies the drafts on the device
  (the verifier the loop hands it: verification.accept_greedy_nodes), and copies `[rows, 3]` numbers back: the
  step's one sync.

Sampling rows whose drafts carry no probabilities are drawn on the device too: each node's token is drawn from its
distribution with the uniform number of its position (sampling.py), and greedy verification of those draws is
one-hot speculative sampling. A step with such rows has graphs of its own: the draw the loop hands it
(sampling.draw_nodes) adds a softmax and a cumulative sum over every node's logits, and with top-k or top-p a sort
of them. Prefill and steps that need more (a draft model's probabilities, drafters that read the target's hidden
states or attention, CASD's rule) run the eager forward (model_runner.forward_slots), as do steps no bucket holds.

Modes (`SPECBATCH_GRAPH_STEP`): `auto` (compiled on a GPU, where it was the faster of the two graph modes at every
batch and width measured; off on a CPU, whose compiled kernels beat these static shapes), `captured`, `compiled`
(each layer's norms, projections, RoPE with the cache write, residual adds and SiLU-gate fused by torch.compile's
Inductor around the attention, then captured), `eager` (static buffers without a graph: how the CPU suite checks
this step), `off`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..defaults import cache_root
from ..kernels import split_kv_attention
from . import block_attention
from .attention_masks import visible_keys
from .fast_forward import _rms_norm, _rope
from .step_batch import StepBatch
from .step_buckets import Bucket, bucket_for

log = logging.getLogger(__name__)

MODE_ENV = "SPECBATCH_GRAPH_STEP"
MODES = ("auto", "captured", "compiled", "eager", "off")
WARM_UP_RUNS = 2  # eager runs of a bucket before its capture (allocator and library handles settle)
PICK_REPLAYS = 5  # replays of the first bucket under each attention, where `auto` picks the faster

# verify(step_ids [B, T], visible [B, T, T], depth [B, T], argmax [B, T]) -> [B, 3] (accepted, last node, next)
Verifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# draw(logits [B, T, vocab], argmax [B, T], temperature [B], top_k [B], top_p [B], seeds [B], positions [B, T],
#      filtered) -> [B, T] each node's token
Drawer = Callable[..., torch.Tensor]


def step_mode(device: str) -> str:
    """The graph-ready step's mode on `device`: captured, compiled, eager or off (see the module's docstring)."""
    mode = os.environ.get(MODE_ENV, "auto")
    if mode not in MODES:
        raise ValueError(f"{MODE_ENV}={mode!r}: choose one of {', '.join(MODES)}")
    on_gpu = str(device).startswith("cuda")
    if mode == "auto":
        return "compiled" if on_gpu else "off"
    return mode


class _Inputs:
    """The static inputs of one (rows, width): written in place before each step, read by its graphs."""

    def __init__(self, rows: int, width: int, device: torch.device):
        self.rows, self.width = rows, width
        pinned = device.type == "cuda"
        # [B, 2T + 3]: each row's node ids, their positions, its cached length, its draw seed and top-k
        self.packed = torch.zeros(rows, 2 * width + 3, dtype=torch.long, device=device)
        self.visible = torch.zeros(rows, width, width, dtype=torch.bool, device=device)  # [B, T, T]
        self.floats = torch.zeros(rows, 2, device=device)  # [B, 2]: each row's temperature (0: greedy) and top-p
        self.host_packed = torch.zeros(rows, 2 * width + 3, dtype=torch.long, pin_memory=pinned)
        self.host_visible = torch.zeros(rows, width, width, dtype=torch.bool, pin_memory=pinned)
        self.host_floats = torch.zeros(rows, 2, pin_memory=pinned)
        self.offsets = torch.arange(width, device=device)  # [T]: where node t's keys go, past its row's length
        self.write_rows = torch.arange(rows, device=device).repeat_interleave(width)  # [B T]: its cache slot
        self.sampled = False  # whether the step has sampling rows (its graphs draw tokens; others take argmaxes)
        self.filtered = False  # whether some row has top-k or top-p (its graphs sort every node's logits)
        self.draw: Drawer | None = None

    def fill(self, step_ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor, lengths: list[int],
             sampling: Sampling | None = None) -> None:
        """step_ids, positions [n, T'], visible [n, T', T'] of the live rows (T' <= width); lengths [n]."""
        live, width = step_ids.shape
        packed, shown = self.host_packed, self.host_visible
        packed.zero_()
        shown.zero_()
        length = packed[:, 2 * self.width]
        length[:live] = torch.tensor(lengths)
        packed[:live, :width] = step_ids
        places = packed[:, self.width:2 * self.width]
        places.copy_(length[:, None] + torch.arange(self.width))  # a padding node sits at its own place
        places[:live, :width] = positions
        shown[:live, :width, :width] = visible  # padding sees nothing (the mask lets it see itself)
        self.sampled = sampling is not None
        self.filtered = self.sampled and sampling.filtered
        if self.sampled:
            self.draw = sampling.draw
            packed[:live, 2 * self.width + 1] = torch.tensor(sampling.seeds)
            packed[:live, 2 * self.width + 2] = torch.tensor(sampling.top_k)
            floats = self.host_floats
            floats[:, 0], floats[:, 1] = 0.0, 1.0  # padding rows: greedy, nothing filtered (no row of -inf)
            floats[:live, 0] = torch.tensor(sampling.temperatures)
            floats[:live, 1] = torch.tensor(sampling.top_p)
            self.floats.copy_(floats, non_blocking=True)
        self.packed.copy_(packed, non_blocking=True)
        self.visible.copy_(shown, non_blocking=True)


@dataclass
class Sampling:
    """A step's sampling rows, for the device's draws: each live row's temperature (0: greedy), top-k (0: off),
    top-p (1: off) and draw seed (SequenceState.draw_seed), and what draws (the loop's sampling.draw_nodes)."""

    temperatures: list[float]
    top_k: list[int]
    top_p: list[float]
    seeds: list[int]
    draw: Drawer

    @property
    def filtered(self) -> bool:
        """Whether some sampling row has top-k or top-p: its graphs sort every node's logits."""
        return any(t > 0 and (k > 0 or p < 1) for t, k, p in zip(self.temperatures, self.top_k, self.top_p))


class Launched:
    """A step under way: its verdicts [rows, 3] stay on the device until `result()` copies them to the host, the
    step's one device-to-host copy (it waits for the device)."""

    __slots__ = ("output",)

    def __init__(self, output: torch.Tensor):
        self.output = output

    def result(self) -> list[list[int]]:
        return self.output.tolist()


@dataclass
class _Captured:
    graph: object  # torch.cuda.CUDAGraph
    output: torch.Tensor  # [B, 3], in the graph's memory pool


class GraphStep:
    """The graph-ready decode and verify step of one runner's fast forward (see the module's docstring)."""

    def __init__(self, runner, mode: str):
        self.runner = runner
        self.mode = mode  # captured, compiled or eager
        # sdpa or flex (block_attention.py); auto: the faster at the first capture (_pick_attention), else sdpa
        self.attention = runner.gpu_attention
        self.attention_ms: dict[str, float] = {}  # what each attention's first graph took a replay, where timed
        self.capture = mode in ("captured", "compiled")
        self.device = torch.device(runner.device)
        rope = getattr(runner.fast.rotary, "rope_type", "default")
        if self.capture and "dynamic" in rope:  # it reads the longest position on the host: no graph holds that
            log.warning("captured steps off: %s RoPE reads positions on the host; the steps run eagerly", rope)
            self.capture = False
        if self.attention == "auto" and not self.capture:
            self.attention = "sdpa"
        self.fused = None  # each layer's dense weights, for the compiled mode's fused functions
        if mode == "compiled":
            try:
                self.fused = _fused_layers(runner.fast)
            except TypeError as exc:
                log.warning("compiled steps off: %s; the steps are captured unfused", exc)
                self.mode = "captured"
        # this step's compiled layer functions (compiled mode), each compiled at its first call
        self.before_attention = _Compiled(_dense_before_attention)
        self.after_attention = _Compiled(_dense_after_attention)
        self.inputs: dict[tuple[int, int], _Inputs] = {}
        # (bucket, whether it draws tokens, whether with top-k or top-p) -> its graph; None: its capture failed, the
        # bucket runs eagerly
        self.graphs: dict[tuple[Bucket, bool, bool], _Captured | None] = {}
        self.pool = None  # the captured graphs' shared memory pool
        self.cache_key = None  # the cache storage the graphs were captured over
        self.capture_s = 0.0  # seconds spent capturing, apart from the steps
        self.captures = 0
        self.steps = 0
        self.uncapturable: set[tuple[bool, bool]] = set()  # (sampled, filtered) kinds of step whose capture failed

    def run(self, cache, batch: StepBatch, step_ids: torch.Tensor, verify: Verifier,
            sampling: Sampling | None = None) -> list[list[int]] | None:
        """`launch`, then its result: per row [accepted, last accepted node, next token]; None where no bucket holds
        the step."""
        launched = self.launch(cache, batch, step_ids, verify, sampling)
        return None if launched is None else launched.result()

    def launch(self, cache, batch: StepBatch, step_ids: torch.Tensor, verify: Verifier,
               sampling: Sampling | None = None) -> Launched | None:
        """One step over every live row of `cache` (batch.rows must be None: rows 0..n-1), launched: on a GPU the
        host goes on while the device works, until `result()`.
        step_ids [n, T] the rows' pending tokens and drafts as proposed (ids past the vocabulary never match).
        sampling: the rows' sampling parameters and draw seeds where some row samples (its drafts one-hot), else None.
        -> the step under way; None where no bucket holds the step (run the eager forward). The caller commits:
        lengths are not advanced."""
        live, width = step_ids.shape
        bucket = bucket_for(live, width, max(cache.lengths[:live]), cache.slots, cache.capacity)
        if bucket is None:
            return None
        inputs = self.inputs.get((bucket.rows, bucket.width))
        if inputs is None:
            inputs = self.inputs[(bucket.rows, bucket.width)] = _Inputs(bucket.rows, bucket.width, self.device)
        inputs.fill(step_ids, batch.positions, batch.visible, cache.lengths[:live], sampling)
        self.steps += 1
        if self.capture and (inputs.sampled, inputs.filtered) not in self.uncapturable:
            captured = self._captured(bucket, inputs, cache, verify)
            if captured is not None:
                captured.graph.replay()
                return Launched(captured.output[:live])
        return Launched(self.compute(bucket, inputs, cache, verify)[:live])

    @property
    def calibrates(self) -> bool:
        """Whether the decoder times this step's widths for its budget (time_widths): only while steps are captured,
        where a timed step costs a replay; eagerly it would cost a whole forward."""
        return self.capture

    def time_widths(self, cache, live: int, widths: list[int], verify: Verifier, sampling: Sampling | None = None,
                    reps: int = 3) -> dict[int, float]:
        """Seconds a step over the first `live` rows of `cache` takes at each width (median of `reps`, after one
        untimed run, in which a bucket met the first time is captured): what a verify step costs on this device,
        for the speculation budget. The nodes are a chain of token 0 whose keys land past each row's length, where
        a rejected draft's keys go, so no row's cached content changes. A width no bucket holds is left out."""
        lengths = torch.tensor(cache.lengths[:live])
        steps, seconds = self.steps, {}
        for width in widths:
            step_ids = torch.zeros(live, width, dtype=torch.long)
            visible = torch.ones(width, width, dtype=torch.bool).tril().expand(live, width, width)
            batch = StepBatch(step_ids, lengths[:, None] + torch.arange(width), visible,
                              torch.zeros(0, 2, dtype=torch.long))
            if self.run(cache, batch, step_ids, verify, sampling) is None:
                continue
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                self.run(cache, batch, step_ids, verify, sampling)  # its [rows, 3] copy back waits for the device
                times.append(time.perf_counter() - started)
            seconds[width] = sorted(times)[len(times) // 2]
        self.steps = steps  # these were no decoding steps
        return seconds

    def _captured(self, bucket: Bucket, inputs: _Inputs, cache, verify: Verifier) -> _Captured | None:
        """The bucket's graph, captured on first use over this cache's storage (a cache that reallocated drops the
        graphs: they hold its addresses)."""
        # every buffer's address: a freed cache's memory may come back to a new one in another order
        key = (cache.slots, cache.capacity, *(buffer.data_ptr() for buffer in cache.keys + cache.values))
        if key != self.cache_key:
            self.graphs.clear()
            self.cache_key = key
        shape = (bucket, inputs.sampled, inputs.filtered)  # a step that draws tokens has graphs of its own
        if shape in self.graphs:
            return self.graphs[shape]
        started = time.perf_counter()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        try:
            if self.attention == "auto":
                captured = self._pick_attention(bucket, inputs, cache, verify, stream)
            else:
                captured = self._capture(bucket, inputs, cache, verify)
        except Exception as exc:  # eager still gives the same tokens
            if stream is not None:  # a capture that raised may leave its own stream current
                torch.cuda.set_stream(stream)
            captured = None
            if inputs.sampled:  # the draws' ops (a sort, a search) failed: greedy steps keep their graphs
                log.warning("captured step %s with draws failed (%s: %s); such steps run eagerly on the same "
                            "buffers", bucket, type(exc).__name__, exc)
                self.uncapturable.add((inputs.sampled, inputs.filtered))
            else:
                log.warning("captured step %s failed (%s: %s); every step runs eagerly on the same buffers", bucket,
                            type(exc).__name__, exc)
                self.capture = False  # what failed once would fail again, at a price each time
                self.attention = "sdpa" if self.attention == "auto" else self.attention
        self.capture_s += time.perf_counter() - started
        self.captures += captured is not None
        self.graphs[shape] = captured
        return captured

    def _pick_attention(self, bucket: Bucket, inputs: _Inputs, cache, verify: Verifier, stream) -> _Captured:
        """The first capture under `auto`: the bucket captured with each attention and replayed PICK_REPLAYS times;
        the faster serves this bucket and every later one (one log line). An attention whose capture fails drops
        out (one log line); where none captures, the last failure is raised."""
        graphs, failure = {}, None
        for attention in block_attention.CANDIDATES:
            self.attention = attention
            try:
                captured = self._capture(bucket, inputs, cache, verify)
            except Exception as exc:
                if stream is not None:
                    torch.cuda.set_stream(stream)
                log.warning("captured step %s with %s attention failed (%s: %s); it is not a candidate", bucket,
                            attention, type(exc).__name__, exc)
                failure = exc
                continue
            if attention == "flex" and block_attention.kernel_state(self.device) == "failed":
                log.warning("captured step %s with flex attention holds masked SDPA: flex_attention did not compile; "
                            "it is not a candidate", bucket)
                continue
            times = []
            for _ in range(PICK_REPLAYS):
                started = time.perf_counter()
                captured.graph.replay()
                captured.output.tolist()  # waits for the device
                times.append(time.perf_counter() - started)
            self.attention_ms[attention] = sorted(times)[len(times) // 2] * 1e3
            graphs[attention] = captured
        if not graphs:
            self.attention = "sdpa"  # the eager steps that follow attend as `auto` does where nothing is captured
            raise failure
        self.attention = min(graphs, key=self.attention_ms.get)
        log.info("graph-ready steps attend through %s (bucket %s: %s)", self.attention, bucket,
                 ", ".join(f"{name} {ms:.3f} ms" for name, ms in self.attention_ms.items()))
        return graphs[self.attention]

    def _capture(self, bucket: Bucket, inputs: _Inputs, cache, verify: Verifier) -> _Captured:
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {self.device}")
        # The warm-up runs are the step itself: they write the same keys the replay writes.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARM_UP_RUNS):
                self.compute(bucket, inputs, cache, verify)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.compute(bucket, inputs, cache, verify)
        return _Captured(graph, output)

    @torch.inference_mode()
    def compute(self, bucket: Bucket, inputs: _Inputs, cache, verify: Verifier) -> torch.Tensor:
        """The step in tensor operations of the bucket's shapes -> [B, 3] on the device."""
        fast = self.runner.fast
        rows, width = bucket.rows, bucket.width
        packed = inputs.packed
        step_ids, positions, lengths = packed[:, :width], packed[:, width:2 * width], packed[:, 2 * width]
        ids = step_ids.masked_fill(step_ids >= self.runner.vocab_size, 0)  # a draft id the target lacks: never kept
        x = fast.embed(ids.reshape(-1))  # [B T, hidden]
        cos, sin = fast.rotary(x, positions)  # [B, T, d] each
        cos, sin = cos.reshape(rows * width, 1, -1), sin.reshape(rows * width, 1, -1)  # [B T, 1, d]
        places = (lengths[:, None] + inputs.offsets).reshape(-1)  # [B T]: node t's keys at length + t
        group = fast.heads // fast.kv_heads
        if self.attention == "flex":  # one block mask for every layer
            mask = block_attention.block_mask(lengths, inputs.visible, bucket.keys)
        else:  # additive, in the queries' dtype: SDPA would turn a boolean mask into this in every layer
            allowed = key_mask(lengths, inputs.visible, bucket.keys)  # [B, 1, T, L]
            allowed = allowed[:, :, None].expand(rows, 1, group, width, bucket.keys).reshape(
                rows, 1, group * width, bucket.keys)
            mask = torch.zeros(allowed.shape, dtype=x.dtype, device=x.device).masked_fill_(~allowed, float("-inf"))
        # [B] int32: the keys worth reading, for the split attention (converted once, not in every layer)
        ends = (lengths + width).clamp(max=bucket.keys).int() if self.attention == "split" else None
        for index, layer in enumerate(fast.layers):
            x = self._layer(index, layer, x, cache, (cos, sin, inputs.write_rows, places, mask, ends), bucket)
        hidden = _rms_norm(x, fast.final_norm, fast.final_eps)  # [B T, hidden]
        logits = self.runner.model.get_output_embeddings()(hidden)  # [B T, vocab]
        # argmax over the head's own dtype: a bf16 logit converts to fp32 exactly, so it picks what fp32 would
        chosen = logits.argmax(dim=-1).view(rows, width)  # [B, T]
        if inputs.sampled:
            chosen = inputs.draw(logits.view(rows, width, -1), chosen, inputs.floats[:, 0], packed[:, 2 * width + 2],
                                 inputs.floats[:, 1], packed[:, 2 * width + 1], positions, inputs.filtered)
        return verify(step_ids, inputs.visible, positions - lengths[:, None], chosen)

    def _layer(self, index: int, layer, x: torch.Tensor, cache, step: tuple, bucket: Bucket) -> torch.Tensor:
        """One decoder layer over the bucket's [B T, hidden] residual stream."""
        fast = self.runner.fast
        cos, sin, write_rows, places, mask, ends = step
        rows, width, count = bucket.rows, bucket.width, x.shape[0]
        heads, kv_heads, head_dim = fast.heads, fast.kv_heads, fast.head_dim
        group = heads // kv_heads
        keys, values = cache.keys[index], cache.values[index]  # [slots, KV, capacity, d]
        if self.fused is not None:  # the cache write fused with RoPE: one kernel, not two index_put launches
            q = self.before_attention(x, *self.fused[index].before, cos, sin, (keys, values, write_rows, places),
                                      (heads, kv_heads, head_dim))
        else:
            q, k, v = _before_attention(x, layer, cos, sin, heads, kv_heads, head_dim)
            keys[write_rows, :, places] = k.to(keys.dtype)
            values[write_rows, :, places] = v.to(values.dtype)
        if self.attention == "flex":
            query = q.view(rows, width, heads, head_dim).transpose(1, 2)  # [B, H, T, d]
            attended = block_attention.attend(query, keys[:rows, :, :bucket.keys], values[:rows, :, :bucket.keys],
                                              mask, layer.scaling)  # [B, T, H, d]
            return self._after_attention(index, layer, x, attended.reshape(count, heads * head_dim))
        # the query heads of one key head side by side along the query axis: [B, KV, group T, d]
        query = q.view(rows, width, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        query = query.reshape(rows, kv_heads, group * width, head_dim)
        keys, values = keys[:rows, :, :bucket.keys], values[:rows, :, :bucket.keys]  # [B, KV, L, d]
        attended = None  # [B, KV, group T, d]
        if self.attention == "split":  # None where its kernels do not hold the step: SDPA then
            attended = split_kv_attention.attend(query, keys, values, mask, ends, layer.scaling)
        if attended is None:
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=layer.scaling)
        attended = attended.view(rows, kv_heads, group, width, head_dim).permute(0, 3, 1, 2, 4)
        return self._after_attention(index, layer, x, attended.reshape(count, heads * head_dim))

    def _after_attention(self, index: int, layer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """x [B T, hidden], attended [B T, H d] -> the layer's output [B T, hidden]."""
        if self.fused is not None:
            return self.after_attention(x, attended, *self.fused[index].after)
        x = x + layer.o(attended)
        normed = _rms_norm(x, layer.norm2, layer.eps2)
        if layer.gate_up is not None:
            gate, up = layer.gate_up(normed).chunk(2, dim=1)
        else:
            gate, up = layer.gate(normed), layer.up(normed)
        return x + layer.down(F.silu(gate) * up)

    def summary(self) -> str:
        """One line: the mode, the attention, the steps run, the graphs captured and what capturing cost."""
        failed = sum(1 for captured in self.graphs.values() if captured is None)
        timed = "" if not self.attention_ms else " (" + ", ".join(
            f"{name} {ms:.3f} ms" for name, ms in self.attention_ms.items()) + ")"
        if self.attention == "flex":
            timed += f" [flex_attention {block_attention.kernel_state(self.device)}]"
        if self.attention == "split" and not split_kv_attention.usable():
            timed += " [split kernels unavailable or failed: SDPA]"
        picked = self.runner.prefill_attention_ms
        if picked:
            timed += f"; prefills {self.runner.prefill_attention} (" + ", ".join(
                f"{name} {ms:.2f} ms" for name, ms in picked.items()) + ")"
        return (f"graph-ready steps: {self.mode}, {self.attention} attention{timed}, {self.steps} steps, "
                f"{self.captures} graphs captured in {self.capture_s:.2f} s"
                + (f", {failed} buckets eager after a failed capture" if failed else ""))


def _before_attention(x: torch.Tensor, layer, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                      head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, hidden] -> post-rotary q [M, H, d], k [M, KV, d] and v [M, KV, d] through the layer's own kernels."""
    count = x.shape[0]
    normed = _rms_norm(x, layer.norm1, layer.eps1)
    if layer.qkv is not None:
        q, k, v = layer.qkv(normed).split(layer.qkv_widths, dim=1)
    else:
        q, k, v = layer.q(normed), layer.k(normed), layer.v(normed)
    return (_rope(q.reshape(count, heads, head_dim), cos, sin), _rope(k.reshape(count, kv_heads, head_dim), cos, sin),
            v.reshape(count, kv_heads, head_dim))


@dataclass
class _DenseLayer:
    """One layer's weights as plain tensors, for the fused functions (arguments, not attributes: torch.compile then
    compiles one function for every layer instead of one per layer)."""

    before: tuple  # (norm1, eps1, qkv weight, qkv bias or None)
    after: tuple  # (o weight, o bias, norm2, eps2, gate-up weight, gate-up bias, down weight, down bias)


def _fused_layers(fast) -> list[_DenseLayer]:
    """Each layer's dense weights (q/k/v and gate/up stacked; the GPU's stacked modules are reused, not copied)."""
    layers = []
    for layer in fast.layers:
        def dense(*projections):
            modules = [p.module for p in projections]
            if not all(type(m) is torch.nn.Linear for m in modules):
                raise TypeError("the compiled step needs plain linear layers (a GPU's), not the CPU's packed kernels")
            if len(modules) == 1:
                return modules[0].weight, modules[0].bias
            weight = torch.cat([m.weight for m in modules])
            biased = any(m.bias is not None for m in modules)
            bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features)
                              for m in modules]) if biased else None
            return weight, bias

        qkv = dense(layer.qkv) if layer.qkv is not None else dense(layer.q, layer.k, layer.v)
        gate_up = dense(layer.gate_up) if layer.gate_up is not None else dense(layer.gate, layer.up)
        layers.append(_DenseLayer((layer.norm1, layer.eps1, *qkv),
                                  (*dense(layer.o), layer.norm2, layer.eps2, *gate_up, *dense(layer.down))))
    return layers


def _dense_before_attention(x, norm, eps, qkv_weight, qkv_bias, cos, sin, store, shape):
    """_before_attention over dense weights, the new keys and values written into the layer's cache. store: (keys,
    values [slots, KV, capacity, d], written in place; write_rows, places [B T]); shape: (H, KV, d) -> q [B T, H, d]
    (what Inductor fuses: the write becomes one scatter kernel with RoPE)."""
    keys, values, write_rows, places = store
    heads, kv_heads, head_dim = shape
    count = x.shape[0]
    qkv = F.linear(_rms_norm(x, norm, eps), qkv_weight, qkv_bias)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    keys[write_rows, :, places] = _rope(k.reshape(count, kv_heads, head_dim), cos, sin).to(keys.dtype)
    values[write_rows, :, places] = v.reshape(count, kv_heads, head_dim).to(values.dtype)
    return _rope(q.reshape(count, heads, head_dim), cos, sin)


def _dense_after_attention(x, attended, o_weight, o_bias, norm, eps, gate_up_weight, gate_up_bias, down_weight,
                           down_bias):
    """The attention's output projection, the residual adds, the second norm and the MLP over dense weights."""
    x = x + F.linear(attended, o_weight, o_bias)
    gate, up = F.linear(_rms_norm(x, norm, eps), gate_up_weight, gate_up_bias).chunk(2, dim=1)
    return x + F.linear(F.silu(gate) * up, down_weight, down_bias)


class _Compiled:
    """`function` compiled by Inductor at its first call (shapes turn dynamic at the first recompile, so the buckets
    share its kernels); where compiling fails, the function itself runs from then on (one log line)."""

    def __init__(self, function):
        self.function = function
        self.run = None

    def __call__(self, *args):
        if self.run is None:
            # Inductor's generated code goes with the project's other compiled kernels, not to a shared /tmp
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
            torch._dynamo.config.fail_on_recompile_limit_hit = True  # past the limit: raise (and log), not run eager
            self.run = torch.compile(self.function)
        if self.run is self.function:
            return self.function(*args)
        try:  # a new shape compiles again, and may fail where the first did not
            return self.run(*args)
        except Exception as exc:
            log.warning("torch.compile failed on %s (%s: %s); it runs uncompiled", self.function.__name__,
                        type(exc).__name__, exc)
            self.run = self.function
            return self.function(*args)


def key_mask(lengths: torch.Tensor, visible: torch.Tensor, keys: int) -> torch.Tensor:
    """lengths [B], visible [B, T, T] -> [B, 1, T, L] bool: node t of row r sees every cached position of its row,
    the step's nodes it is shown (their keys at length + i), and itself (a padding node too: no row sees nothing)."""
    width = visible.shape[1]
    offset = torch.arange(keys, device=lengths.device)[None, :] - lengths[:, None]  # [B, L]: position - length
    itself = offset[:, None, :] == torch.arange(width, device=lengths.device)[None, :, None]  # [B, T, L]
    return (visible_keys(lengths, visible, keys) | itself)[:, None]
