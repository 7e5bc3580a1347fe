"""The kernel plan: which linear kernel runs each of a model's linears at each row count on this machine, chosen by
timing the candidates (linear_plan.py) at the model's first load on the machine and kept under
$SPECBATCH_CACHE/kernel_plans, keyed by the CPU, the kernels' sources, the library versions, the threads, the dtype
and the model's shapes.

Why: the fastest kernel depends on the CPU and on the row count, not on the CPU's flags alone. Where the CPU's bf16
dot product runs at half its fp32 rate (an Intel avx512_bf16 CPU without AMX), oneDNN's fp32 matmul over an fp32
copy of the weights ran prefill-sized linears well ahead of every bf16 kernel, while the bf16 dot kernel stayed the
fastest for decode-sized ones (docs/decisions.md: "A kernel plan per machine"). So a linear may hold a second layout
of its weights and pick by rows.

What a plan may change: the bf16 forwards of a CPU model without --deterministic. A row's numbers then depend on the
kernel its forward's row count picks, as they already did with oneDNN. --deterministic keeps every linear on the
kernel the model's modules hold (row-invariant, the same at every row count), and fp32 models, whose lossless
methods are exact through one row-invariant kernel, are not routed either.

A layout the model does not hold already costs memory (`extra_bytes`), so it is added only where it is clearly
faster (MARGIN) and only where memory allows (MEMORY_SHARE of what is available).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..defaults import cache_root
from . import chain_plan, linear_plan, step_plan
from .linear_plan import Timing
from .coded_panels import CodedPanels
from .numba_kernels import cache_key
from .packed_linear import PackedLinear
from .panel_linear import PanelLinear

log = logging.getLogger(__name__)

# (the most rows a bucket holds, None: no bound; the row count it is timed at). Decode steps, verify steps, verify
# trees and short prefill chunks, prefill chunks (loop/prefill_plan.PREFILL_TOKENS). 9-64 is timed at 32: a batch-16
# decode step and its verify steps of 2-4 tokens, where kernels that trade places with rows are compared.
BUCKETS = ((8, 8), (64, 32), (512, 512), (None, 1024))
MARGIN = 1.10  # a layout the model does not hold must be this much faster than the ones it holds to be added
MEMORY_SHARE = 0.5  # extra layouts may take at most this share of the memory available at load
SECONDS_EACH = 0.03  # timing per candidate, shape and row count
FORMAT = 4  # 2: paired timings; 3: the prompt attention (chain_plan.py); 4: the step attention (step_plan.py)
# A plan is keyed by the kernels' own sources (with the CPU, numba and llvmlite): an edit elsewhere in specdec_core
# does not time it again (each new timing on a noisy machine could route differently: decisions.md).
KERNELS_ROOT = Path(__file__).resolve().parent
# Roles of several modules, and primaries whose modules the fast forward cannot stack (an opaque oneDNN layout):
# a routed role then holds a stacked copy of the primary too (fast_forward._routed).
STACKED_ROLES, UNSTACKED = ("qkv", "gate_up"), ("onednn_packed",)
ENV = "SPECBATCH_KERNEL_PLAN"  # "flags": time nothing; every linear stays on the kernel the CPU's flags pick


@dataclass(frozen=True)
class KernelPlan:
    key: str
    primary: str  # the kernel the model's linear modules hold: routing to it costs no memory
    routes: dict[str, tuple[tuple[int | None, str], ...]]  # role -> ((the most rows or None, candidate), ...)
    timings: tuple[Timing, ...]
    seconds: float  # spent timing at this load: 0 when the plan came from the cache
    extra_bytes: int  # the layouts beyond the primary's, for the whole model
    note: str = ""  # why a faster plan was not taken (memory)
    prompt_attention: str = chain_plan.DEFAULT  # the kernel of bf16 prompt chains (chain_plan.py)
    attention_ms: dict = field(default_factory=dict)  # what each prompt-attention candidate took (chain_plan.measure)
    step_attention: str = step_plan.DEFAULT  # the kernel of bf16 decode and verify steps (step_plan.py)
    step_ms: dict = field(default_factory=dict)  # what each step-attention candidate took (step_plan.measure)

    def candidate(self, role: str, rows: int) -> str:
        for most, name in self.routes.get(role, ()):
            if most is None or rows <= most:
                return name
        return self.primary

    @property
    def routed(self) -> bool:
        """Whether some linear leaves the primary kernel at some row count."""
        return any(name != self.primary for route in self.routes.values() for _, name in route)

    def describe(self) -> str:
        """One line: the plan's id and each role's kernels by rows."""
        if not self.routed:
            text = f"{self.primary} everywhere"
        else:
            text = "; ".join(f"{role}: " + ", ".join(_bucket_text(route, i) for i in range(len(route)))
                             for role, route in self.routes.items())
            text += f" (+{self.extra_bytes / 2**20:.0f} MiB)"
        return (f"plan {self.key[:8]}: {text}; prompt attention: {self.prompt_attention}; step attention: "
                f"{self.step_attention}"
                + (f"; {self.note}" if self.note else ""))


def _bucket_text(route, index: int) -> str:
    most, name = route[index]
    low = 1 if index == 0 else route[index - 1][0] + 1
    return f"{name} {low}+" if most is None else f"{name} {low}-{most}"


def choose(timings: list[Timing], primary: str, roles: list[str]) -> dict[str, tuple[tuple[int | None, str], ...]]:
    """Each role's kernel per bucket: the fastest, unless a layout the role already holds (the primary, or one an
    earlier bucket added) is within MARGIN of it. Adjacent buckets with one kernel merge. Speeds are compared as
    paired ratios to the primary where the timings have them (linear_plan.measure's rounds): a best call of each
    candidate, taken at different moments, let a machine's drift pick a kernel at random (decisions.md)."""
    routes = {}
    for role in roles:
        held, route = {primary}, []
        for most, rows in BUCKETS:
            found = [t for t in timings if t.shape == role and t.rows == rows]
            paired = bool(found) and all(t.paired is not None for t in found)
            cells = {t.candidate: t.paired if paired else t.gflops for t in found}
            if not cells:
                route.append((most, primary))
                continue
            best = max(cells, key=cells.get)
            kept = max((name for name in held if name in cells), key=cells.get, default=None)
            pick = kept if kept is not None and cells[kept] * MARGIN >= cells[best] else best
            held.add(pick)
            if route and route[-1][1] == pick:
                route[-1] = (most, pick)
            else:
                route.append((most, pick))
        routes[role] = tuple(route)
    return routes


def extra_bytes(routes: dict, primary: str, shapes: dict[str, tuple[int, int]], layers: int,
                dtype: torch.dtype = torch.bfloat16) -> int:
    """The memory of the layouts a plan adds beyond the primary's, for the whole model."""
    candidates = {c.name: c for c in linear_plan.CANDIDATES}
    total = 0
    for role, route in routes.items():
        out_features, in_features = shapes[role]
        names = {name for _, name in route}
        copies = names - {primary}
        if copies and primary in names and primary in UNSTACKED and role in STACKED_ROLES:
            copies.add(primary)  # a routed q/k/v or gate/up runs the primary on a stacked copy
        total += sum(candidates[name].layout_bytes(dtype) for name in copies) * out_features * in_features * layers
    return total


def plan_key(shapes: dict, dtype: torch.dtype, primary: str, heads: tuple | None = None) -> str:
    text = json.dumps({"format": FORMAT, "kernels": cache_key(KERNELS_ROOT), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "dtype": str(dtype), "shapes": shapes,
                       "primary": primary, "buckets": BUCKETS, "heads": heads}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_path(key: str) -> Path:
    return cache_root() / "kernel_plans" / f"{key}.json"


def plan_for(shapes: dict[str, tuple[int, int]], layers: int, dtype: torch.dtype, primary: str,
             heads: tuple[int, int, int] | None = None) -> KernelPlan | None:
    """This machine's plan for a model's linears (shapes: linear_plan.model_shapes) and, given its heads (query
    heads, key/value heads, head_dim), its prompt attention; read from the cache or timed now and cached; None where
    plans are off (ENV=flags) or the dtype is not routed (fp32)."""
    if os.environ.get(ENV, "measure") == "flags" or dtype != torch.bfloat16:
        return None
    key = plan_key(shapes, dtype, primary, heads)
    cached = _read(key)
    if cached is not None:
        return cached
    with _timing_lock(key):  # processes loading the model together: one times it, the others then read its plan
        return _read(key) or _time_plan(key, shapes, layers, dtype, primary, heads)


@contextmanager
def _timing_lock(key: str):
    """An exclusive lock on $SPECBATCH_CACHE/kernel_plans/<key>.lock while a plan is timed (none where the cache
    cannot be written: each process then times its own)."""
    path = plan_path(key).with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _time_plan(key: str, shapes: dict, layers: int, dtype: torch.dtype, primary: str,
               heads: tuple | None = None) -> KernelPlan:
    started = time.perf_counter()
    attention_ms = chain_plan.measure(*heads) if heads is not None else {}
    step_ms = step_plan.measure(*heads) if heads is not None else {}
    timings = linear_plan.measure(shapes, [rows for _, rows in BUCKETS], dtype, SECONDS_EACH, reference=primary)
    routes = choose(timings, primary, list(shapes))
    extra, note = extra_bytes(routes, primary, shapes, layers, dtype), ""
    available = _available_memory()
    if extra and available is not None and extra > MEMORY_SHARE * available:
        note = (f"the routed plan's layouts (+{extra / 2**20:.0f} MiB) would exceed {MEMORY_SHARE:.0%} of the "
                f"{available / 2**20:.0f} MiB available: {primary} everywhere")
        routes, extra = {role: ((None, primary),) for role in shapes}, 0
    plan = KernelPlan(key, primary, routes, tuple(timings), time.perf_counter() - started, extra, note,
                      chain_plan.choose(attention_ms), attention_ms, step_plan.choose(step_ms), step_ms)
    _write(plan)
    log.info("kernel %s, timed in %.1f s", plan.describe(), plan.seconds)
    return plan


def _available_memory() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _read(key: str) -> KernelPlan | None:
    try:
        data = json.loads(plan_path(key).read_text())
        routes = {role: tuple((most, name) for most, name in route) for role, route in data["routes"].items()}
        return KernelPlan(key, data["primary"], routes, tuple(Timing(**t) for t in data["timings"]), 0.0,
                          int(data["extra_bytes"]), data.get("note", ""), data["prompt_attention"],
                          dict(data["attention_ms"]), data["step_attention"], dict(data["step_ms"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: timed again


def _write(plan: KernelPlan) -> None:
    path = plan_path(plan.key)
    data = {"format": FORMAT, "cpu": linear_plan.cpu_description(), "primary": plan.primary,
            "routes": {role: [list(step) for step in route] for role, route in plan.routes.items()},
            "extra_bytes": plan.extra_bytes, "note": plan.note, "timed_s": round(plan.seconds, 3),
            "prompt_attention": plan.prompt_attention, "attention_ms": plan.attention_ms,
            "step_attention": plan.step_attention, "step_ms": plan.step_ms,
            "timings": [asdict(t) for t in plan.timings]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(data, indent=1))
        temporary.replace(path)
    except OSError as exc:  # a read-only cache: the plan serves this process, and is timed again next time
        log.warning("kernel plan not cached (%s)", exc)


def primary_kernel(module) -> str:
    """The candidate name of the kernel a linear module runs (tune_for_cpu's choice)."""
    if type(module) is PanelLinear:
        return ("bf16_dot" if module.panels.dim() == 4
                else "panel_coded" if isinstance(module.panels, CodedPanels) else "panel")
    if type(module) is PackedLinear:
        return "onednn_packed" if module.dtype == torch.bfloat16 else "onednn_fp32_packed"
    return "onednn"


def build(name: str, weight: torch.Tensor):
    """Candidate `name` over a dense [out, in] weight: x [M, in] -> [M, out] in the weight's dtype."""
    return next(c for c in linear_plan.CANDIDATES if c.name == name).build(weight)
