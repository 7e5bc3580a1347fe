"""The decode loop on a simulated GPU: what a GPU actor's host work costs a step, method by method, on this CPU.

On a lent GPU a captured step of SmolLM2 at batch 64 takes a few ms, and what the loop does between steps on the
host (the drafters' proposals, the plan, the step's inputs, committing each row) adds to it: only the drafters'
`while_verifying` work runs while a launched step computes. This bench measures that host work without a GPU:
- the target's tokens come from an oracle: what our `ar` decoded for the same prompts on this CPU (recorded once,
  untimed, cached under $SPECBATCH_CACHE), so drafts are accepted as the real model would accept them;
- the loop runs its graph-ready path (graph_step.py) against a stand-in step that verifies each row's draft against
  the oracle with the device's own verifier (verification.accept_greedy_nodes), then sleeps for the rest of the
  device's time for its rows and width: the H200's captured SmolLM2 steps in benchmarks/results/gpu/step_roofline.json
  (or --step-ms);
- prefill forwards answer at once (--prefill-us-per-token adds a device time per prompt token);
- the KV cache holds one layer, one head of one dimension on the CPU: its copies cost the host their dispatch, as on a
  GPU, and almost no memory work;
- a step's wait spins its last millisecond: a sleeper woken late would count the delay as host time.

Per method it prints the decode steps' tok/s, the host ms a step (the step's wall time less the simulated device
time: the host work the device's time did not hide) and its share of the step, and the cycle collector's full
passes, side by side in one run, rounds interleaved; with --profile, cProfile's top host functions of the last
round. The ratios to `ar` predict what speculation gains on that GPU at that step time, with this CPU's host speed
(a GPU machine's host is usually faster). Admissions run between steps: their host work a row (prefill's inputs, the
drafters' start, less the simulated prefill's device time) is printed apart, with the ratio to `ar` counting it.

  python benchmarks/simulated_gpu_bench.py --workload code_edit --requests 64 --batch-size 64 --methods ar pld suffix
  python benchmarks/simulated_gpu_bench.py --requests 256  # a queue at batch 64, as issue 50 asks
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.batch_bench import hardware, workload_items  # noqa: E402
from specdec_core.defaults import DEFAULT_MODEL, cache_root  # noqa: E402
from specdec_core.engine import Engine, EngineConfig  # noqa: E402
from specdec_core.loop.kv_cache import SlotKVCache  # noqa: E402
from specdec_core.loop.prefix_cache import PrefixCache  # noqa: E402
from specdec_core.warm_up import freeze_heap  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOFLINE = Path(__file__).resolve().parent / "results" / "gpu" / "step_roofline.json"


class DeviceModel:
    """Seconds a captured step takes on the GPU, by (rows, width): the nearest measured batch at or above the rows,
    the measured widths interpolated linearly (extrapolated past the widest)."""

    def __init__(self, shape: str, mode: str, step_ms: float | None):
        self.fixed = step_ms
        self.table: dict[int, dict[int, float]] = {}
        if step_ms is None:
            for record in json.loads(ROOFLINE.read_text()):
                if record["shape"] == shape and record["mode"] == mode and record.get("attention", "sdpa") == "sdpa":
                    # the last record of a (batch, width) is the newest run's
                    self.table.setdefault(record["batch_size"], {})[record["width"]] = record["step_ms"] / 1e3
            if not self.table:
                raise SystemExit(f"{ROOFLINE} has no {mode} records of {shape}: pass --step-ms")

    def seconds(self, rows: int, width: int) -> float:
        if self.fixed is not None:
            return self.fixed / 1e3
        batch = min((b for b in self.table if b >= rows), default=max(self.table))
        widths = self.table[batch]
        known = sorted(widths)
        below = max((w for w in known if w <= width), default=known[0])
        above = min((w for w in known if w >= width), default=None)
        if above is None:  # past the widest measured: the last segment's slope
            above, below = known[-1], known[-2] if len(known) > 1 else known[-1]
        if above == below:
            return widths[below]
        slope = (widths[above] - widths[below]) / (above - below)
        return widths[below] + slope * (width - below)

    def describe(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed:g} ms a step, any width"
        return "; ".join(f"b{b}: " + ", ".join(f"T{w} {s * 1e3:.2f}" for w, s in sorted(ws.items()))
                         for b, ws in sorted(self.table.items())) + " ms"


class SimulatedStep:
    """Stands in for the runner's GraphStep: verifies against the oracle on the host, then sleeps out the device's
    time. `device_s` sums the device time of the steps (what the loop's wall time is not host work)."""

    calibrates = True

    def __init__(self, decoder_ref: list, oracle: dict, device: DeviceModel):
        self.decoder_ref = decoder_ref  # [the BatchDecoder running] (set once the decoder exists)
        self.oracle = oracle
        self.device = device
        self.capture_s = 0.0
        self.device_s = 0.0
        self.overrun_s = 0.0  # host work in the device's window that outlasted it (host time past the device's)
        self.steps = 0

    def launch(self, cache, batch, step_ids, verify, sampling=None) -> "SimulatedLaunch":
        """The step's verdicts, ready once the device's time from now has passed (the host goes on meanwhile, as
        after a graph's replay)."""
        started = time.perf_counter()
        rows = self.decoder_ref[0].rows
        live, width = step_ids.shape
        lengths = torch.tensor(cache.lengths[:live])
        depth = batch.positions - lengths[:, None]  # [B, T]
        # (over Python lists: iterating a tensor makes a tensor of each element, and the device's window holds it)
        argmax = torch.tensor([self._tokens(row, depths) for depths, row in zip(depth.tolist(), rows)])
        found = verify(step_ids, batch.visible, depth, argmax).tolist()
        self.steps += 1
        seconds = self.device.seconds(live, width)
        self.device_s += seconds
        return SimulatedLaunch(found, started + seconds, self)

    def run(self, cache, batch, step_ids, verify, sampling=None):
        return self.launch(cache, batch, step_ids, verify, sampling).result()

    def time_widths(self, cache, live, widths, verify, sampling=None, reps=3):
        return {w: self.device.seconds(live, w) for w in widths}

    def first_tokens(self, rows: list) -> torch.Tensor:
        """Prefill's logits [len(rows), vocab]: one-hot at each finishing row's first oracle token."""
        logits = torch.zeros(len(rows), self.decoder_ref[0].target.vocab_size)
        for i, row in enumerate(rows):
            logits[i, self.oracle[row.request.key][0]] = 1.0
        return logits

    def _tokens(self, row, depths: list[int]) -> list[int]:
        """The target's argmax after each node, `depth` tokens past the row's pending token."""
        tokens = self.oracle[row.request.key]
        last, generated = len(tokens) - 1, row.state.num_generated
        return [tokens[min(generated + depth, last)] for depth in depths]

    def occupy(self, seconds: float, since: float) -> None:
        """The device busy for `seconds` from `since` (the host waits, as for a step's copy back)."""
        self.device_s += seconds
        wait_until(since + seconds)


class SimulatedLaunch:
    """A simulated step under way: `result()` waits until the device is done, then hands the verdicts over. What
    the host did meanwhile overlapped the step; the wait is what the step cost the host beyond that."""

    def __init__(self, found: list, ready_at: float, step: SimulatedStep):
        self.found, self.ready_at, self.step = found, ready_at, step

    def result(self) -> list:
        self.step.overrun_s += max(0.0, time.perf_counter() - self.ready_at)  # the window's work past the device's
        wait_until(self.ready_at)
        return self.found


def wait_until(end: float) -> None:
    """Sleeps, then spins the last millisecond: the OS wakes a sleeper late, which would count as host time, while a
    device sync returns as the device finishes."""
    while (left := end - time.perf_counter()) > 0:
        if left > 1e-3:
            time.sleep(left - 1e-3)


def record_oracle(engine, items, workload: str, new_tokens: int, batch_size: int) -> dict:
    """{key: the tokens our `ar` decodes for it on this machine} (cached by the prompts' ids)."""
    digest = hashlib.sha256(json.dumps([engine.config.model, engine.target.dtype_name, new_tokens,
                                        [list(i.prompt_ids) for i in items]]).encode()).hexdigest()[:16]
    path = cache_root() / "simulated_gpu" / f"{workload}-{digest}.json"
    if path.exists():
        return {key: tokens for key, tokens in json.loads(path.read_text())}
    print(f"recording the oracle: our ar on {len(items)} {workload} prompts (untimed, once) ...", flush=True)
    got = {}
    for key, result in engine.decode_batch(items, "ar", batch_size=min(batch_size, 16)):
        if result.get("error"):
            raise SystemExit(f"the oracle's ar failed on {key}: {result['error']}")
        got[key] = result["output_token_ids"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([[key, tokens] for key, tokens in got.items()]))
    return got


def simulate(engine, items, method: str, batch_size: int, oracle: dict, device: DeviceModel,
             prefill_us: float, profiler: cProfile.Profile | None = None) -> dict:
    """One pass of `method` on the simulated GPU -> its decode figures."""
    runner = engine.target
    decoder_ref: list = []
    step = SimulatedStep(decoder_ref, oracle, device)
    real_forward, real_graph_step = runner.forward_slots, runner.graph_step

    def prefill(cache, batch, head=None):
        started = time.perf_counter()
        decoder = decoder_ref[0]
        finishing = [decoder.rows[batch.rows[b]] for b, _ in batch.logit_index.tolist()]
        logits = step.first_tokens(finishing)
        step.occupy(prefill_us * 1e-6 * int(batch.real.sum()), started)
        return logits

    runner.forward_slots, runner.graph_step = prefill, lambda: step
    try:
        decoder = engine.decoder(batch_size, method=method)
        # Keys and values of one layer, one head of one dimension on the CPU: the cache's copies (a tree's accepted
        # path, a retiring row) cost the host the dispatch of torch's C++ kernels, as a GPU's launches do (one copy
        # covers every layer there too), and almost no memory traffic, which a GPU does off the host. (On the meta
        # device each copy ran torch's shape checks in Python; with every layer, a retiring row's copy read all its
        # keys' cold lines.)
        decoder.cache = SlotKVCache(1, 1, 1, decoder.cache.dtype, "cpu")
        decoder.prefix_cache = PrefixCache(budget_bytes=0)  # (it would copy the stand-in keys; prefill is not timed)
        decoder_ref.append(decoder)
        phases = _time_phases(decoder)
        for item in items:
            decoder.submit(engine.request(item, method, None, decoder))
        step_s, host_s, tokens, steps, admit_s = 0.0, 0.0, 0, 0, 0.0
        full = FullCollections()
        decoder.waiting = type(decoder.waiting)(sorted(decoder.waiting, key=lambda r: len(r.prompt_ids)))
        started = time.perf_counter()
        while decoder.waiting or decoder.rows:
            before_device, began = step.device_s, time.perf_counter()
            decoder.admit()  # (prefill and the drafters' start: host work the decode steps leave out)
            admit_s += time.perf_counter() - began - (step.device_s - before_device)
            if not decoder.rows:
                continue
            before_tokens, before_device = decoder.stats.new_tokens, step.device_s
            if profiler:
                profiler.enable()
            began = time.perf_counter()
            decoder.step()
            took = time.perf_counter() - began
            if profiler:
                profiler.disable()
            step_s += took
            host_s += took - (step.device_s - before_device)
            tokens += decoder.stats.new_tokens - before_tokens
            steps += 1
        wall = time.perf_counter() - started
    finally:
        runner.forward_slots, runner.graph_step = real_forward, real_graph_step
        full.stop()
    errors = [r for _, r in decoder.finished if isinstance(r, str)]
    if errors:
        raise SystemExit(f"{method}: {len(errors)} rows failed, e.g. {errors[0]}")
    wrong = sum(r.token_ids != oracle[q.key][:len(r.token_ids)] for q, r in decoder.finished)
    phases["overrun"] = step.overrun_s
    return {"phases_ms": {k: v / steps * 1e3 for k, v in phases.items()}, "method": method, "steps": steps,
            "tokens": tokens, "decode_tok_s": tokens / step_s, "device_tok_s": tokens / (step_s - host_s),
            "host_ms": host_s / steps * 1e3, "host_share": host_s / step_s, "wall_s": wall,
            "admit_ms_per_row": admit_s / len(items) * 1e3, "pass_tok_s": tokens / (step_s + admit_s),
            "mean_rows": decoder.stats.mean_occupancy, "accepted": decoder.stats.accepted_tokens,
            "verified": decoder.stats.verified_tokens, "wrong_rows": wrong, "full_gc": full.count,
            "full_gc_ms": full.seconds * 1e3}


class FullCollections:
    """The cycle collector's full (generation 2) passes while it is on, and their seconds: host time too."""

    def __init__(self):
        self.count, self.seconds, self._began = 0, 0.0, 0.0
        gc.callbacks.append(self._seen)

    def _seen(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._began = time.perf_counter()
            else:
                self.count += 1
                self.seconds += time.perf_counter() - self._began

    def stop(self) -> None:
        gc.callbacks.remove(self._seen)


PHASES = {"_propose": "propose", "_plan": "plan", "_rank_planned": "rank", "_step_inputs": "inputs",
          "_commit": "commit", "_while_verifying": "overlapped"}


def _time_phases(decoder) -> dict[str, float]:
    """Wraps the decoder's step phases to sum their seconds -> {phase: seconds so far}. None holds the simulated
    device step; what they leave out of the host time is the loop's own glue."""
    spent = {name: 0.0 for name in PHASES.values()}
    for attribute, name in PHASES.items():
        method = getattr(decoder, attribute)

        def timed(*args, _method=method, _name=name, **kwargs):
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - started

        setattr(decoder, attribute, timed)
    return spent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="code_edit", choices=["code_edit", "summarization", "open_questions"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--methods", nargs="+", default=["ar", "pld", "copyspec", "suffix"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", default="captured", help="the step_roofline.json records to simulate")
    parser.add_argument("--step-ms", type=float, help="a device step of this many ms at every width instead")
    parser.add_argument("--prefill-us-per-token", type=float, default=0.0)
    parser.add_argument("--gc-as-is", action="store_true",
                        help="leave the heap unfrozen (decode actors freeze theirs after the warm-up: warm_up.py)")
    parser.add_argument("--profile", action="store_true", help="cProfile's top host functions, a pass after the rounds")
    parser.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"], help="--profile's order")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    engine = Engine(EngineConfig(model=DEFAULT_MODEL))
    device = DeviceModel("smollm2-135m", args.mode, args.step_ms)
    items = workload_items(engine, args.workload, args.requests, args.new_tokens, args.batch_size)
    oracle = record_oracle(engine, items, args.workload, args.new_tokens, args.batch_size)
    print(f"# {hardware('cpu')}, dtype {engine.target.dtype_name}, {DEFAULT_MODEL}; {len(items)} {args.workload} "
          f"prompts, batch {args.batch_size}, {args.new_tokens} new tokens; simulated device: {device.describe()}",
          flush=True)
    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    for method in args.methods:  # untimed: each method's first pass builds its indexes and kernels
        simulate(engine, items[: args.batch_size], method, args.batch_size, oracle, device, args.prefill_us_per_token)
    if not args.gc_as_is:
        print(f"# heap frozen as a decode actor's is after its warm-up: {freeze_heap()} objects", flush=True)
    for round_ in range(args.rounds):
        for method in args.methods:
            engine.forget()
            result = simulate(engine, items, method, args.batch_size, oracle, device, args.prefill_us_per_token)
            results[method].append(result)
            print(f"round {round_ + 1} {method:10s} decode {result['decode_tok_s']:8.0f} tok/s  host "
                  f"{result['host_ms']:.3f} ms/step ({result['host_share']:.0%})  steps {result['steps']}  "
                  f"accepted {result['accepted']}/{result['verified']}  rows off the oracle {result['wrong_rows']}  "
                  f"full gc {result['full_gc']} ({result['full_gc_ms']:.0f} ms)",
                  flush=True)
    base = [r["decode_tok_s"] for r in results[args.methods[0]]]
    print(f"\nmedians of {args.rounds} rounds; x = decode tok/s over {args.methods[0]}'s in the same round; with "
          f"admissions: their host work (prefill's inputs, the drafters' start) counted too, prefill's device time "
          f"{args.prefill_us_per_token:g} us a token")
    for method, rows in results.items():
        ratio = statistics.median(r["decode_tok_s"] / b for r, b in zip(rows, base))
        ceiling = statistics.median(r["device_tok_s"] / b["device_tok_s"]
                                    for r, b in zip(rows, results[args.methods[0]]))
        phases = ", ".join(f"{name} {statistics.median(r['phases_ms'][name] for r in rows):.2f}"
                           for name in [*PHASES.values(), "overrun"])
        host = statistics.median(r["host_ms"] for r in rows)
        with_admissions = statistics.median(r["pass_tok_s"] / b["pass_tok_s"]
                                            for r, b in zip(rows, results[args.methods[0]]))
        print(f"{method:10s} decode {statistics.median(r['decode_tok_s'] for r in rows):8.0f} tok/s  "
              f"x {ratio:.2f} (x {ceiling:.2f} with no host work)  host {host:.3f} ms/step "
              f"({statistics.median(r['host_share'] for r in rows):.0%} of the step)  "
              f"mean rows {statistics.median(r['mean_rows'] for r in rows):.1f}\n    host ms/step by phase: {phases}\n"
              f"    admissions: host {statistics.median(r['admit_ms_per_row'] for r in rows):.2f} ms a row; "
              f"x {with_admissions:.2f} with them")
    for method in args.methods if args.profile else []:  # a pass of its own: the profiler slows the host
        profile = cProfile.Profile()
        engine.forget()
        simulate(engine, items, method, args.batch_size, oracle, device, args.prefill_us_per_token, profile)
        print(f"\n## {method}: host functions by {args.sort} time (a profiled pass; time.sleep is the device)")
        pstats.Stats(profile).sort_stats(args.sort).print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
