"""Lossless: greedy outputs of every speculative method equal plain AR's token for token (real model, fp32)."""

import pytest

from specdec_core.decode import DecodeParams
from specdec_core.methods import MethodOptions
from tests.prompts import LOSSLESS_CASES

pytestmark = pytest.mark.slow

MAX_NEW = 128
VARIANTS = {
    "pld": ("pld", MethodOptions()),
    "copyspec": ("copyspec", MethodOptions()),
    "draft": ("draft", MethodOptions()),
    "copyspec+draft": ("copyspec+draft", MethodOptions()),
    "pld-adaptive": ("pld", MethodOptions(adaptive=True)),
    "copyspec-adaptive": ("copyspec", MethodOptions(adaptive=True)),
    "copyspec-gamma5-m32": ("copyspec", MethodOptions(gamma=5, copy_tokens=32)),
    "draft-adaptive": ("draft", MethodOptions(adaptive=True)),
    "copyspec+draft-adaptive": ("copyspec+draft", MethodOptions(adaptive=True)),
}


@pytest.fixture(scope="module")
def reference(engine):
    """AR greedy ids for every case, computed once."""
    out = {}
    for name, messages in LOSSLESS_CASES.items():
        ids = engine.prompt_ids(messages=messages)
        out[name] = (ids, engine.generate_ids(ids, "ar", DecodeParams(max_new_tokens=MAX_NEW)))
    return out


def test_cases_are_long_enough(reference):
    lengths = {name: r["new_tokens"] for name, (_, r) in reference.items()}
    assert all(n >= MAX_NEW for n in lengths.values()), lengths
    for _, r in reference.values():
        assert r["mean_accepted_length"] == 1.0 and r["target_forwards"] == r["new_tokens"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_output_equals_ar(engine, reference, variant):
    method, options = VARIANTS[variant]
    drafted = 0
    for name, (ids, ar) in reference.items():
        got = engine.generate_ids(ids, method, DecodeParams(max_new_tokens=MAX_NEW), options)
        assert got["output_token_ids"] == ar["output_token_ids"], f"{variant} differs from ar on {name}"
        assert got["output_text"] == ar["output_text"]
        assert got["finish_reason"] == ar["finish_reason"]
        drafted += got["drafted_tokens"]
        assert got["target_forwards"] <= ar["target_forwards"]
    assert drafted > 0, "the method never drafted, so the test proved nothing"
