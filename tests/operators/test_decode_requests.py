"""The decode stage's per-row failure handling, in process on the real default model (no Ray)."""

import pandas as pd
import pytest

from operators.build_prompts import BuildPrompts
from operators.decode_requests import DecodeRequests
from operators.requests_schema import normalize_row

pytestmark = pytest.mark.slow


@pytest.fixture
def stage(engine):
    from contract.decode_config import DecodeConfig

    # the session's engine instead of a second model load
    return DecodeRequests.on_engine(engine, DecodeConfig(methods=["ar", "copyspec"], max_new_tokens=4, batch_size=4))


def batch(*rows):
    prompts = BuildPrompts("smollm2-135m")
    return prompts(pd.DataFrame([normalize_row(r) for r in rows])).to_pandas()


def test_a_failing_batched_pass_is_redone_row_by_row_and_only_the_failing_row_errors(stage, monkeypatch):
    decode_method = stage._decode_method

    def failing_with_boom(rows, method):
        if any(row["id"] == "boom" for row in rows):
            raise RuntimeError("the forward failed")
        return decode_method(rows, method)

    monkeypatch.setattr(stage, "_decode_method", failing_with_boom)
    table = stage(batch({"id": "a", "prompt": "Say one."}, {"id": "boom", "prompt": "Say two."},
                        {"id": "b", "prompt": "Say three."}))
    rows = {(r["request_id"], r["method"]): r for r in table.to_pylist()}
    assert len(rows) == 6
    for request in ("a", "b"):
        for method in ("ar", "copyspec"):
            assert rows[(request, method)]["error"] is None and rows[(request, method)]["new_tokens"] == 4
    assert rows[("boom", "ar")]["error"] == "RuntimeError: the forward failed"


def test_a_scoring_failure_keeps_the_output_and_says_why_it_has_no_score(stage, monkeypatch):
    import operators.decode_requests as module

    def broken_score(row, text):
        raise ValueError("bad reference")

    monkeypatch.setattr(module, "output_annotations", broken_score)
    table = stage(batch({"id": "a", "prompt": "Say one.", "reference": "one"}))
    for row in table.to_pylist():
        assert row["error"] == "scoring the output failed: ValueError: bad reference"
        assert row["new_tokens"] == 4 and row["output_text"]
