"""batch_bench's table: the host share of a pass's decode time, where its steps were graph-ready."""

from benchmarks.batch_bench import table


def row(system: str, **extra) -> dict:
    return {"system": system, "batch_size": 64, "new_tokens": 1000, "tokens_per_s": 100.0, "wall_s": 10.0,
            "prefill_s": 2.0, "capture_s": 1.0, **extra}


def test_the_host_share_is_the_decode_time_outside_graph_ready_steps():
    lines = table([row("ar", graph_s=5.6), row("pld")]).splitlines()
    assert lines[0].rstrip(" |").endswith("host share")
    assert lines[2].rstrip(" |").endswith("| 0.20")  # 1 - 5.6 / (10 - 2 - 1)
    assert lines[3].endswith("|  |")  # no graph-ready step: nothing to say
