"""benchmarks/gpu_step_roofline.py's mechanics on the CPU (its timings are a GPU's): every mode of every step is
recorded with its roofline under each attention, the modes give the same tokens in fp32, capture falls back to eager
here, and a prefill is timed under each attention."""

import json

import pytest

from benchmarks import gpu_step_roofline


@pytest.mark.slow  # the compiled mode's Inductor compiles in worker processes
def test_the_roofline_records(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    out = tmp_path / "step_roofline.json"
    assert gpu_step_roofline.main(["--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--batch-sizes", "3",
                                   "--widths", "1", "4", "--context", "30", "--reps", "1", "--hf-new-tokens", "3",
                                   "--attention", "sdpa", "flex", "--prefill", "--sampling", "top-p",
                                   "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    sampled = [(r["width"], r["mode"], r["attention"]) for r in records if "sampling" in r]
    assert sorted(sampled) == sorted((width, mode, attention) for width in (1, 4)
                                     for mode in ("static", "captured", "compiled") for attention in ("sdpa", "flex"))
    records = [r for r in records if "sampling" not in r]
    modes = [(r["width"], r["mode"], r.get("attention")) for r in records if r["mode"] != "prefill"]
    assert sorted(modes, key=str) == sorted(
        [(width, mode, attention) for width in (1, 4) for mode in ("eager", "static", "captured", "compiled")
         for attention in ("sdpa", "flex")] + [(1, "hf", None)], key=str)
    prefill = [r for r in records if r["mode"] == "prefill"]
    assert sorted(r["attention"] for r in prefill) == ["flex", "sdpa"]
    flex = [r for r in json.loads(out.read_text()) if r.get("attention") == "flex"]
    assert flex and all(r["flex_kernel"] == "eager" for r in flex)  # a CPU runs it uncompiled; a GPU says compiled
    assert all(0 < r["tokens_per_s"] and r["width"] < r["prompt_tokens"] < r["batch_size"] * r["width"]
               for r in prefill), prefill  # rows of different lengths: a padded block
    records = [r for r in records if r["mode"] != "prefill"]
    for record in records:
        assert {"shape", "batch_size", "width", "mode", "step_ms", "roofline_ms", "roofline_ratio", "device",
                "torch"} <= set(record)
        assert record["step_ms"] > 0 and record["roofline_ms"] > 0
        assert record.get("same_tokens_as_eager", True), record
    captured = [r for r in records if r["mode"] in ("captured", "compiled")]
    assert len(captured) == 8 and all(not r["captured"] and r["syncs_per_step"] is None for r in captured)  # a CPU


def test_step_bytes_count_the_weights_and_the_cache():
    from tests.tiny_models import tiny_llama

    runner = tiny_llama(0)
    weights = gpu_step_roofline.step_bytes(runner, [0], 0)
    # 2 layers x (q, k, v, o: 64 x (64 + 32 + 32 + 64); gate, up, down: 3 x 64 x 128; 2 norms of 64) + a norm + head
    expected = 4 * (2 * (64 * 192 + 3 * 64 * 128 + 2 * 64) + 64 + 96 * 64)
    assert weights == expected
    per_position = 2 * 2 * 2 * 16 * 4  # keys and values, 2 layers, 2 key heads of 16, fp32
    assert gpu_step_roofline.step_bytes(runner, [10, 20], 2) - weights == per_position * 34
