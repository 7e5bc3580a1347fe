"""The kernel plan (kernel_plan.py): which linear kernel runs at which row count, chosen from timings, cached per
machine and model, followed by the fast forward's linears, and set aside by --deterministic."""

import pytest
import torch

from specdec_core.engine import Engine
from specdec_core.kernels import bf16_attention, chain_plan, kernel_plan, linear_plan, step_plan
from specdec_core.kernels.kernel_plan import BUCKETS, KernelPlan
from specdec_core.kernels.linear_plan import Timing
from specdec_core.loop.kv_cache import new_slot_cache
from specdec_core.model.model_runner import ModelRunner, tune_for_cpu
from specdec_core.model.step_batch import StepBatch
from tests.tiny_models import repetitive_prompt, tiny_llama_64, tiny_qwen2

ROLES = ["qkv", "o", "gate_up", "down"]


def timings(rates: dict[str, list[float]], roles=ROLES) -> list[Timing]:
    """{candidate: GFLOP/s at each bucket's timed row count} -> the same Timing for every role."""
    return [Timing(role, 8, 8, rows, name, name != "onednn_fp32", rate[i])
            for role in roles for name, rate in rates.items() for i, (_, rows) in enumerate(BUCKETS)]


def test_a_layout_is_added_only_where_it_beats_the_held_ones_by_the_margin():
    # the Intel avx512_bf16 class of issue 52: the bf16 dot kernel at decode rows, oneDNN's fp32 at prefill rows
    plan = kernel_plan.choose(timings({"bf16_dot": [163, 170, 171, 170], "onednn_fp32": [81, 150, 290, 315]}),
                              "bf16_dot", ROLES)
    assert plan["down"] == ((64, "bf16_dot"), (None, "onednn_fp32"))
    # within the margin the held layout stays, at every bucket: no second copy of the weights for noise
    close = kernel_plan.choose(timings({"bf16_dot": [163, 170, 171, 170], "onednn": [150, 180, 185, 180]}),
                               "bf16_dot", ROLES)
    assert close["qkv"] == ((None, "bf16_dot"),)
    # once added, a layout is held: a later bucket keeps it unless another beats it by the margin
    held = kernel_plan.choose(timings({"bf16_dot": [163, 100, 171, 170], "onednn": [90, 180, 180, 180]}),
                              "bf16_dot", ROLES)
    assert held["o"] == ((8, "bf16_dot"), (None, "onednn"))


def test_paired_ratios_decide_where_the_timings_have_them():
    """A challenger whose best call looked 15 % faster (a moment the machine ran fast) but which ran at 1.02x the
    primary over paired rounds does not take the bucket; one that won 1.3x in the rounds does, whatever its best
    call said."""
    def paired(role, rows, name, gflops, ratio):
        return Timing(role, 8, 8, rows, name, True, gflops, ratio)

    found = []
    for _, rows in BUCKETS:
        found += [paired("o", rows, "bf16_dot", 170, 1.0), paired("o", rows, "onednn", 196, 1.02)]
        found += [paired("down", rows, "bf16_dot", 170, 1.0), paired("down", rows, "onednn", 160, 1.3)]
    plan = kernel_plan.choose(found, "bf16_dot", ["o", "down"])
    assert plan == {"o": ((None, "bf16_dot"),), "down": ((None, "onednn"),)}


def test_a_plans_memory_is_counted_and_its_description_names_each_route():
    routes = {"o": ((64, "bf16_dot"), (None, "onednn_fp32")), "down": ((None, "bf16_dot"),)}
    extra = kernel_plan.extra_bytes(routes, "bf16_dot", {"o": (576, 576), "down": (576, 1536)}, layers=30)
    assert extra == 4 * 576 * 576 * 30  # an fp32 copy of o's weights, none of down's
    plan = KernelPlan("abcdef0123456789", "bf16_dot", routes, (), 0.0, extra)
    assert plan.routed and plan.candidate("o", 64) == "bf16_dot" and plan.candidate("o", 65) == "onednn_fp32"
    assert "o: bf16_dot 1-64, onednn_fp32 65+" in plan.describe() and "MiB" in plan.describe()
    still = KernelPlan("abcdef0123456789", "bf16_dot", {"o": ((None, "bf16_dot"),)}, (), 0.0, 0)
    assert not still.routed
    assert still.describe() == ("plan abcdef01: bf16_dot everywhere; prompt attention: bf16_attention; "
                                "step attention: bf16_dot")


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """A fresh $SPECBATCH_CACHE and measure() answering the Intel class's timings; returns its calls (and in
    `calls.attention` and `calls.steps`, chain_plan.measure's and step_plan.measure's: an AMX CPU's answers)."""
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))
    monkeypatch.delenv(kernel_plan.ENV, raising=False)
    calls = _Calls()

    def measure(shapes, rows, dtype, seconds_each, reference=None):
        calls.append((dict(shapes), list(rows)))
        return timings({"bf16_dot": [163, 170, 171, 170], "onednn_fp32": [81, 150, 290, 315]}, list(shapes))

    monkeypatch.setattr(linear_plan, "measure", measure)
    monkeypatch.setattr(chain_plan, "measure", lambda heads, kv_heads, head_dim: calls.attention.append(
        (heads, kv_heads, head_dim)) or {"bf16_attention": 5.0, "sdpa": 2.0})
    monkeypatch.setattr(step_plan, "measure", lambda heads, kv_heads, head_dim: calls.steps.append(
        (heads, kv_heads, head_dim)) or {"bf16_dot": [0.50, 0.90], "amx": [0.46, 0.52]})
    return calls


class _Calls(list):
    def __init__(self):
        super().__init__()
        self.attention = []
        self.steps = []


def test_the_prompt_attention_is_timed_with_the_linears_and_the_faster_kept(timed):
    """Given the model's heads, a plan also times the prompt-attention candidates once (an AMX CPU's answer: SDPA
    at 2.5x ours) and keeps the faster, read back from the cache with the routes; without heads nothing is timed
    and bf16_attention stays."""
    shapes = {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}
    plan = kernel_plan.plan_for(shapes, 2, torch.bfloat16, "bf16_dot", (4, 2, 16))
    assert timed.attention == [(4, 2, 16)] and plan.prompt_attention == "sdpa"
    assert plan.attention_ms == {"bf16_attention": 5.0, "sdpa": 2.0} and "prompt attention: sdpa" in plan.describe()
    again = kernel_plan.plan_for(shapes, 2, torch.bfloat16, "bf16_dot", (4, 2, 16))
    assert again.seconds == 0.0 and (again.prompt_attention, again.attention_ms) == ("sdpa", plan.attention_ms)
    without = kernel_plan.plan_for(shapes, 2, torch.bfloat16, "bf16_dot")
    assert without.key != plan.key and without.prompt_attention == chain_plan.DEFAULT
    assert timed.attention == [(4, 2, 16)]  # nothing more timed
    assert chain_plan.choose({}) == chain_plan.DEFAULT and chain_plan.choose({"a": 2.0, "b": 1.0}) == "b"


def test_the_step_attention_is_timed_with_the_prompts_and_the_faster_kept(timed):
    """Given the model's heads, a plan also times the step-attention candidates once at a decode and a verify width
    (an AMX CPU's answer: the tiles faster at both) and keeps the one faster over both, read back from the cache;
    without heads nothing is timed and the dot-product kernel stays."""
    shapes = {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}
    plan = kernel_plan.plan_for(shapes, 2, torch.bfloat16, "bf16_dot", (4, 2, 16))
    assert timed.steps == [(4, 2, 16)] and plan.step_attention == "amx" and "step attention: amx" in plan.describe()
    again = kernel_plan.plan_for(shapes, 2, torch.bfloat16, "bf16_dot", (4, 2, 16))
    assert again.seconds == 0.0 and (again.step_attention, again.step_ms) == ("amx", plan.step_ms)
    assert kernel_plan.plan_for(shapes, 2, torch.bfloat16, "bf16_dot").step_attention == step_plan.DEFAULT
    assert timed.steps == [(4, 2, 16)]
    assert step_plan.choose({}) == step_plan.DEFAULT
    assert step_plan.choose({"a": [0.2, 0.9], "b": [0.3, 0.5]}) == "b"  # a decode and a verify step together


def test_the_real_step_attention_timing_covers_every_candidate_that_runs_here():
    from specdec_core.kernels import amx_step_attention, bf16_step_attention

    timings = step_plan.measure(9, 3, 64)
    assert set(timings) == {name for name, usable in (("bf16_dot", bf16_step_attention.usable(64)),
                                                       ("amx", amx_step_attention.usable(64))) if usable}
    assert all(len(ms) == len(step_plan.WIDTHS) and min(ms) > 0 for ms in timings.values())


def test_the_real_prompt_attention_timing_covers_every_candidate_that_runs_here():
    timings = chain_plan.measure(3, 1, 16)
    assert "sdpa" in timings and all(ms > 0 for ms in timings.values())
    assert ("bf16_attention" in timings) == bf16_attention.usable(16)


def test_a_plan_is_timed_once_per_machine_and_model_then_read_from_the_cache(timed, tmp_path):
    shapes = {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}
    first = kernel_plan.plan_for(shapes, 2, torch.bfloat16, "bf16_dot")
    assert len(timed) == 1 and timed[0][1] == [rows for _, rows in BUCKETS] and first.seconds > 0
    assert first.routes["gate_up"] == ((64, "bf16_dot"), (None, "onednn_fp32"))
    again = kernel_plan.plan_for(shapes, 2, torch.bfloat16, "bf16_dot")
    assert len(timed) == 1 and again.seconds == 0.0  # from $SPECBATCH_CACHE/kernel_plans
    assert (again.key, again.routes, again.extra_bytes) == (first.key, first.routes, first.extra_bytes)
    assert kernel_plan.plan_path(first.key).parent == tmp_path / "kernel_plans"
    other = kernel_plan.plan_for({**shapes, "down": (64, 256)}, 2, torch.bfloat16, "bf16_dot")  # another model
    assert len(timed) == 2 and other.key != first.key
    assert kernel_plan.plan_for(shapes, 2, torch.float32, "panel") is None  # fp32 stays exact: never routed


def test_plans_can_be_switched_off_and_never_take_more_memory_than_allowed(timed, monkeypatch):
    shapes = {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}
    monkeypatch.setenv(kernel_plan.ENV, "flags")
    assert kernel_plan.plan_for(shapes, 2, torch.bfloat16, "bf16_dot") is None and not timed
    monkeypatch.delenv(kernel_plan.ENV)
    monkeypatch.setattr(kernel_plan, "_available_memory", lambda: 100_000)
    plan = kernel_plan.plan_for(shapes, 2, torch.bfloat16, "bf16_dot")
    assert not plan.routed and plan.extra_bytes == 0 and "MiB available" in plan.note


def _bf16_model(make=tiny_llama_64):
    base = make()
    model = base.model.to(torch.bfloat16)
    tune_for_cpu(model)
    return base, model


def _last_logits(runner: ModelRunner, length: int) -> torch.Tensor:
    """One prefill forward of `length` tokens (M = length rows in every linear) -> the last position's logits."""
    cache = new_slot_cache(runner)
    cache.fit(1, length + 8)
    cache.add_row()
    ids = torch.tensor([repetitive_prompt(5, length)])
    batch = StepBatch(ids, torch.arange(length)[None], torch.ones(length, length, dtype=torch.bool).tril()[None],
                      torch.tensor([[0, length - 1]]), prefill=True)
    return runner.forward_slots(cache, batch)[0].float()


@pytest.mark.parametrize("make", [tiny_llama_64, tiny_qwen2], ids=["llama", "qwen2-biases"])
def test_the_fast_forward_runs_each_linear_on_the_kernel_its_row_count_is_planned_for(make, monkeypatch):
    base, model = _bf16_model(make)
    plain = ModelRunner(model, base.tokenizer, base.name, "cpu", torch.bfloat16)
    primary = kernel_plan.primary_kernel(model.get_decoder().layers[0].mlp.down_proj)
    plan = KernelPlan("test", primary, {role: ((8, primary), (None, "onednn_fp32")) for role in ROLES}, (), 0.0, 0)
    ran = []
    real_build = kernel_plan.build
    monkeypatch.setattr(kernel_plan, "build", lambda name, weight: (
        lambda run: lambda x: ran.append((name, x.shape[0])) or run(x))(real_build(name, weight)))
    routed = ModelRunner(model, base.tokenizer, base.name, "cpu", torch.bfloat16, plan=plan)
    layers = len(model.get_decoder().layers)
    assert torch.allclose(_last_logits(routed, 6), _last_logits(plain, 6), atol=1e-6)  # 6 rows: the modules' kernel
    # (on a stacked copy of q/k/v and gate/up where the modules hold an opaque oneDNN layout: an AMX CPU's, not built
    # through kernel_plan.build, so that its bias is added inside oneDNN's call as the modules add theirs)
    assert ran == []
    long, reference = _last_logits(routed, 24), _last_logits(plain, 24)
    assert ran and {name for name, _ in ran} == {"onednn_fp32"} and {rows for _, rows in ran} == {24}
    assert len(ran) == 4 * layers  # qkv, o, gate_up and down of every layer
    assert torch.allclose(long, reference, atol=0.05 * reference.abs().max().item())  # bf16 roundings differ


def test_deterministic_sets_a_routed_plan_aside_and_auto_does_not_give_it_up():
    from specdec_core.kernels import bf16_attention, bf16_step_attention

    base, model = _bf16_model()
    primary = kernel_plan.primary_kernel(model.get_decoder().layers[0].mlp.down_proj)
    routes = {role: ((8, primary), (None, "onednn_fp32")) for role in ROLES}
    routed = ModelRunner(model, base.tokenizer, base.name, "cpu", torch.bfloat16,
                         plan=KernelPlan("test", primary, routes, (), 0.0, 0))
    assert routed.fast.plan is not None and not routed.determinism_costs_nothing()
    assert not Engine.from_runners(routed).target.deterministic  # auto keeps the faster kernels
    if bf16_attention.usable(64) and bf16_step_attention.usable(64):
        routed.deterministic = True
        assert routed.fast.plan is None  # every linear on its module's row-invariant kernel
        routed.deterministic = False
        assert routed.fast.plan is not None
    same = {role: ((None, primary),) for role in ROLES}
    unrouted = ModelRunner(model, base.tokenizer, base.name, "cpu", torch.bfloat16,
                           plan=KernelPlan("test", primary, same, (), 0.0, 0))
    assert unrouted.determinism_costs_nothing() == ModelRunner(
        model, base.tokenizer, base.name, "cpu", torch.bfloat16).determinism_costs_nothing()


def test_each_output_row_names_the_plan_its_actor_followed():
    from contract.decode_config import DecodeConfig
    from operators.decode_requests import DecodeRequests

    base, model = _bf16_model()
    primary = kernel_plan.primary_kernel(model.get_decoder().layers[0].mlp.down_proj)
    plan = KernelPlan("0123456789abcdef", primary, {role: ((8, primary), (None, "onednn_fp32")) for role in ROLES},
                      (), 1.5, 1024)
    runner = ModelRunner(model, base.tokenizer, base.name, "cpu", torch.bfloat16, plan=plan)
    stage = DecodeRequests.on_engine(Engine.from_runners(runner, deterministic="off"), DecodeConfig(methods=["ar"]))
    row = stage._base({"id": "a"}, "ar", None)
    assert row["kernel_plan"] == plan.describe() and row["kernel_plan_s"] == 1.5
    assert row["kernel_plan"].startswith("plan 01234567: qkv: ")


@pytest.mark.slow
def test_the_kernels_command_prints_the_plan_the_engine_follows_and_says_where_it_came_from(timed, capsys):
    from specdec_core import cli

    assert cli.main(["kernels", "--dtype", "bfloat16"]) == 0
    first = capsys.readouterr().out
    assert "timed now in" in first and "| down | 8 x 8 | 1024 |" in first  # the timings measure() gave
    plan_line = next(line for line in first.splitlines() if line.startswith("kernel plan "))
    assert "down: " in plan_line and "onednn_fp32 65+" in plan_line  # the timings measure() gave
    assert cli.main(["kernels", "--dtype", "bfloat16"]) == 0
    again = capsys.readouterr().out
    assert "from the cache" in again and plan_line in again and len(timed) == 1
    assert cli.main(["kernels", "--dtype", "bfloat16", "--retime"]) == 0
    assert "timed now in" in capsys.readouterr().out and len(timed) == 2


def test_a_process_that_finds_the_plan_being_timed_waits_and_reads_it(timed):
    """Two decode actors loading the model together: the second waits for the first's plan instead of timing its own
    on a machine the first is busy timing."""
    import fcntl
    import threading

    shapes = {"qkv": (96, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}
    key = kernel_plan.plan_key(shapes, torch.bfloat16, "bf16_dot")
    lock = kernel_plan.plan_path(key).with_suffix(".lock")
    lock.parent.mkdir(parents=True)
    got = []
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process is timing this plan
        waiter = threading.Thread(target=lambda: got.append(kernel_plan.plan_for(shapes, 2, torch.bfloat16,
                                                                                 "bf16_dot")))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not timed  # it waits, and times nothing
        other = KernelPlan(key, "bf16_dot", {"o": ((None, "bf16_dot"),)}, (), 2.0, 0)
        kernel_plan._write(other)  # the other process's plan lands
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(timeout=10.0)
    assert got and got[0].routes == other.routes and got[0].seconds == 0.0 and not timed
