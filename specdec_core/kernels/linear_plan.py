"""The linear kernels a CPU could run a model's linears with, timed on this machine: for each weight shape and row
count, every candidate's speed and whether its rows are invariant (what --deterministic needs).

kernel_plan.py chooses from these timings, per machine and model, which kernel runs each linear at each row count;
`python -m specdec_core kernels` prints the timings and the plan.

Every candidate takes and returns the model's dtype, so a candidate that computes in fp32 pays its conversions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from . import amx_linear, bf16_dot, coded_panels, packed_linear, panel_linear


@dataclass(frozen=True)
class Candidate:
    name: str
    row_invariant: bool  # a row's result depends on that row alone (--deterministic may use it)
    dtypes: tuple[torch.dtype, ...]  # the model dtypes it serves
    usable: Callable[[], bool]
    build: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]  # weight [out, in] -> x [M, in] -> y
    widened: bool = False  # its layout holds the weights in fp32 (4 bytes each, whatever the model's dtype)
    coded: bool = False  # it takes only weights that are exact block codes (coded_panels.encode)

    def layout_bytes(self, dtype: torch.dtype) -> int:
        """Bytes per weight of its layout, in a model of `dtype`."""
        return 4 if self.widened else dtype.itemsize


# Each builder keeps its own layout and not the weight it was given (a plan may drop the dense weight).
def _onednn(weight: torch.Tensor):
    return lambda x: F.linear(x, weight)


def _onednn_fp32(weight: torch.Tensor):
    wide, dtype = weight.float(), weight.dtype  # a second copy of the weights, in fp32
    return lambda x: F.linear(x.float(), wide).to(dtype)


def _onednn_fp32_packed(weight: torch.Tensor):
    source = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    source.weight.data = weight.float()
    packed, dtype = packed_linear.PackedLinear(source), weight.dtype
    return lambda x: packed.project(x.float()).to(dtype)


def _onednn_packed(weight: torch.Tensor):
    """oneDNN over the weight reordered once into its blocked layout, in the weight's own dtype: F.linear reorders
    a plain weight at every call (on an AMX CPU that copy bounded decode-sized linears: docs/decisions.md)."""
    packed = packed_linear.reorder(weight)
    return lambda x: packed_linear.linear(x, packed, None)


def _amx_tiles(weight: torch.Tensor):
    packed, out_features = amx_linear.pack(weight), weight.shape[0]
    return lambda x: amx_linear.linear(x, packed, out_features)


def _bf16_dot(weight: torch.Tensor):
    array, out_features = bf16_dot.as_words(bf16_dot.to_pair_panels(weight)), weight.shape[0]
    return lambda x: panel_linear.linear(x, array, None, out_features, torch.bfloat16)


def _panel(weight: torch.Tensor):
    """The panel kernel over the weight's own dtype (bf16 panels are widened to fp32 as they are read)."""
    array = panel_linear.as_kernel_array(panel_linear.to_panels(weight))
    out_features, dtype = weight.shape[0], weight.dtype
    return lambda x: panel_linear.linear(x, array, None, out_features, dtype)


def _panel_fp32(weight: torch.Tensor):
    array = panel_linear.as_kernel_array(panel_linear.to_panels(weight.float()))
    out_features, dtype = weight.shape[0], weight.dtype
    return lambda x: panel_linear.linear(x.float(), array, None, out_features).to(dtype)


def _panel_coded(weight: torch.Tensor):
    """fp32 weights that are exact 4- or 8-bit block codes, kept as the codes (coded_panels.py)."""
    panels = coded_panels.encode(weight)
    if panels is None:
        raise ValueError("the weight is not exact block codes: it cannot be held as coded panels")
    arrays, out_features = panels.arrays(), weight.shape[0]
    return lambda x: panel_linear.linear(x, arrays, None, out_features)


def _coded_usable() -> bool:
    return all(kernel() is not None for kernel in panel_linear.coded_kernels.values())


BF16, FP32 = torch.bfloat16, torch.float32
CANDIDATES = (
    Candidate("onednn", False, (BF16, FP32), lambda: True, _onednn),
    Candidate("onednn_packed", False, (BF16,), packed_linear.bf16_available, _onednn_packed),
    Candidate("onednn_fp32", False, (BF16,), lambda: True, _onednn_fp32, widened=True),
    Candidate("onednn_fp32_packed", False, (BF16, FP32), packed_linear.available, _onednn_fp32_packed, widened=True),
    Candidate("amx_tiles", True, (BF16,), amx_linear.usable, _amx_tiles),
    Candidate("bf16_dot", True, (BF16,), bf16_dot.available, _bf16_dot),
    Candidate("panel", True, (BF16, FP32), lambda: panel_linear.available(BF16) and panel_linear.available(FP32),
              _panel),
    Candidate("panel_fp32", True, (BF16,), lambda: panel_linear.available(FP32), _panel_fp32, widened=True),
    # bit-identical to `panel` over the same weights; timed on random weights rounded to 4-bit codes
    Candidate("panel_coded", True, (FP32,), _coded_usable, _panel_coded, coded=True),
)


@dataclass(frozen=True)
class Timing:
    shape: str  # the weight's role, e.g. "gate_up"
    out_features: int
    in_features: int
    rows: int  # M
    candidate: str
    row_invariant: bool
    gflops: float  # at its best call
    # the median, over rounds that time every candidate one after another, of the reference kernel's time over this
    # one's in the same round (1.0 for the reference; None without one): a drift of the machine's speed during the
    # timing moves both sides of each ratio alike
    paired: float | None = None


# Row counts up to this are timed with the weights streamed from memory, as a forward of every layer streams them:
# a weight timed again and again from the cache makes a kernel look fast where memory bounds it.
STREAMED_ROWS = 64


ROUNDS = 3  # the fewest rounds of calls a (shape, rows) is timed in
# A candidate whose first timed call took this many times the fastest one's (and not the reference) is timed no
# further: it cannot win, and the slowest (bf16 oneDNN on an AVX2 CPU) made the rounds most of a plan's time.
HOPELESS = 3.0


def measure(shapes: dict[str, tuple[int, int]], rows: list[int], dtype: torch.dtype,
            seconds_each: float = 0.05, reference: str | None = None) -> list[Timing]:
    """shapes {role: (out_features, in_features)} -> one Timing per (shape, rows, usable candidate). Up to
    STREAMED_ROWS rows, each timed call runs over enough copies of the weight to overflow the last-level cache.
    The candidates are timed in rounds, each round one call of every candidate in a rotating order, for about
    `seconds_each` a candidate: each one's best call gives its GFLOP/s, and its calls' ratios to `reference`'s
    (a candidate's name: the kernel the model already holds) in the same rounds give `paired`."""
    timings = []
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for role, (out_features, in_features) in shapes.items():
            weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).to(dtype)
            if dtype == FP32 and in_features % coded_panels.BLOCK == 0:  # as a GGUF's dequantized weights are
                weight = coded_panels.round_to_codes(weight)
            coded = coded_panels.encode(weight)
            candidates = [c for c in CANDIDATES
                          if dtype in c.dtypes and c.usable() and (coded is not None or not c.coded)]
            runs = {c.name: _copies(c, weight, coded.nbytes() if c.coded else c.layout_bytes(dtype) * weight.numel())
                    for c in candidates}
            for count in rows:
                x = torch.randn(count, in_features, generator=generator).to(dtype)
                calls = {name: (copies if count <= STREAMED_ROWS else copies[:1]) for name, copies in runs.items()}
                seconds = _rounds(calls, x, seconds_each, reference)  # {name: [seconds a call, per round]}
                base = seconds.get(reference)
                for candidate in candidates:
                    own = seconds[candidate.name]
                    paired = None if base is None else float(np.median([b / t for b, t in zip(base, own)]))
                    gflops = 2 * count * out_features * in_features / min(own) / 1e9
                    timings.append(Timing(role, out_features, in_features, count, candidate.name,
                                          candidate.row_invariant, gflops, paired))
            del runs
    return timings


def _copies(candidate: Candidate, weight: torch.Tensor, size: int) -> list:
    """The candidate built over enough copies of the weight (its layout: `size` bytes) to fill twice the last-level
    cache."""
    copies = max(1, min(256, -(-2 * last_level_cache_bytes() // size)))
    return [candidate.build(weight.clone()) for _ in range(copies)]


def _rounds(calls: dict[str, list], x: torch.Tensor, seconds_each: float, reference: str | None
            ) -> dict[str, list[float]]:
    """Each candidate's seconds a call (over its copies), round by round, after one untimed call each; after the
    first round only the candidates that may still win (within HOPELESS of the fastest, and the reference)."""
    names = list(calls)
    for name in names:
        [run(x) for run in calls[name]]
    seconds = {name: [] for name in names}
    spent, budget, turn = 0.0, seconds_each * len(names), 0
    while spent < budget or turn < ROUNDS:
        order = names[turn % len(names):] + names[:turn % len(names)]  # no candidate always first after another
        for name in order:
            started = time.perf_counter()
            [run(x) for run in calls[name]]
            took = time.perf_counter() - started
            seconds[name].append(took / len(calls[name]))
            spent += took
        if turn == 0:
            fastest = min(times[0] for times in seconds.values())
            names = [name for name in names if name == reference or seconds[name][0] <= HOPELESS * fastest]
            budget = seconds_each * len(names)
        turn += 1
    return seconds


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), or 32 MiB where it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]] if text[-1] in "KMG"
                         else int(text))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 * 2**20)


def fastest(timings: list[Timing], deterministic: bool) -> dict[tuple[str, int], Timing]:
    """{(shape, rows): the fastest timing}, among row-invariant candidates only when `deterministic`."""
    best: dict[tuple[str, int], Timing] = {}
    for timing in timings:
        if deterministic and not timing.row_invariant:
            continue
        key = (timing.shape, timing.rows)
        if key not in best or timing.gflops > best[key].gflops:
            best[key] = timing
    return best


def table(timings: list[Timing]) -> list[str]:
    """A markdown table: a row per shape and row count, a column per candidate (* row-invariant), the fastest."""
    names = [c.name for c in CANDIDATES if c.name in {t.candidate for t in timings}]
    invariant_names = {t.candidate for t in timings if t.row_invariant}
    lines = ["| shape | out x in | rows | " + " | ".join(n + ("*" if n in invariant_names else "") for n in names)
             + " | fastest | fastest row-invariant |", "|---" * (len(names) + 5) + "|"]
    best, best_invariant = fastest(timings, False), fastest(timings, True)
    for (shape, rows), top in best.items():
        cells = {t.candidate: f"{t.gflops:.0f}" + ("" if t.paired is None else f" ({t.paired:.2f}x)")
                 for t in timings if (t.shape, t.rows) == (shape, rows)}
        invariant = best_invariant.get((shape, rows))
        lines.append(f"| {shape} | {top.out_features} x {top.in_features} | {rows} | "
                     + " | ".join(cells.get(n, "") for n in names)
                     + f" | {top.candidate} | {invariant.candidate if invariant else '-'} |")
    return lines


def cpu_description() -> str:
    """The CPU's model name, the flags that decide its kernels, and torch's threads."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return f"CPU ?, CPU flags: ?, threads {torch.get_num_threads()}"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in info)
    return f"{name}, CPU flags: {flags}, threads {torch.get_num_threads()}"


def model_heads(config) -> tuple[int, int, int]:
    """(query heads, key/value heads, head_dim) of a decoder layer's attention."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def model_shapes(config) -> dict[str, tuple[int, int]]:
    """The decoder layer's linears as the fast forward runs them (q, k, v stacked; gate and up stacked)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o": (hidden, heads * head_dim),
            "gate_up": (2 * config.intermediate_size, hidden), "down": (hidden, config.intermediate_size)}
