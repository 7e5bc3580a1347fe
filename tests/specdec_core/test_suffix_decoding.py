"""suffix and auto on the real default model (fp32): ar's exact tokens alone and in batches mixed with other methods,
whatever the job memory holds (the right answers, wrong ones, nothing), and the memory kept across a decode actor's
calls."""

import pytest

from specdec_core.methods import MethodOptions
from tests.prompts import LOSSLESS_MAX_NEW, lossless_items

pytestmark = pytest.mark.slow

# In case order: code_rename, code_hints, summary_news, summary_paper, chat_revise_poem, chat_revise_code,
# no_repetition_story, no_repetition_facts. The last two copy nothing from their prompts: only the memory helps them.
MIXED = ["ar", "copyspec", "suffix", "auto", "suffix", "auto", "suffix", "auto"]
FROM_MEMORY_ONLY = ("no_repetition_story", "no_repetition_facts")


@pytest.fixture
def fresh_memory(engine):
    """The session engine without the memories other tests left (and left as it was found)."""
    saved = engine.memories
    engine.memories = {}
    yield engine
    engine.memories = saved


@pytest.fixture(scope="module")
def reference(lossless_reference):
    return {name: result["output_token_ids"] for name, result in lossless_reference.items()}


def decode(engine, methods, memory_method, batch_size, rows=range(8)):
    """Case i (of `rows`) with methods[i], all in one decoder that has `memory_method`'s job memory."""
    decoder = engine.decoder(batch_size=batch_size, speculation_budget=False, method=memory_method)
    chosen = {}
    for row, item in enumerate(lossless_items(engine)):
        if row in rows:
            chosen[item.key] = methods[row]
            decoder.submit(engine.request(item, chosen[item.key], MethodOptions(), decoder))
    return {request.key: engine.result_dict(chosen[request.key], request.params, result)
            for request, result in decoder.run()}


def check(results, reference):
    for name, row in results.items():
        assert row["error"] is None, (name, row["error"])
        assert row["output_token_ids"] == reference[name], f"{row['method']} differs from ar on {name}"


def test_suffix_and_auto_equal_ar_with_the_right_answers_in_memory(fresh_memory, reference):
    engine = fresh_memory
    engine.memory_for("suffix").seed_sequences(list(reference.values()))
    results = decode(engine, MIXED, "suffix", batch_size=8)
    check(results, reference)
    for name in FROM_MEMORY_ONLY:
        # suffix drafts from the memory; auto may also ask the session engine's draft model (a noisy target copy)
        sources = ("memory",) if results[name]["method"] == "suffix" else ("memory", "draft_model")
        drafted = sum(results[name]["accepted_by_source"].get(source, 0) for source in sources)
        assert drafted >= LOSSLESS_MAX_NEW[name] // 3, results[name]
        assert results[name]["target_forwards"] <= LOSSLESS_MAX_NEW[name] // 3, results[name]  # ar: one per token
    assert sum(row["accepted_by_source"].get("memory", 0) for row in results.values() if row["method"] == "auto") > 0
    # Each alone (batch size 1): one that copies its prompt, and the two that only the memory helps.
    alone = decode(engine, MIXED, "suffix", batch_size=1, rows=(4, 6, 7))
    check(alone, reference)
    assert sum(row["accepted_by_source"].get("memory", 0) for row in alone.values()) >= 16


def test_suffix_and_auto_with_a_draft_model_equal_ar_when_the_memory_is_wrong(fresh_memory, reference):
    """Every fourth token of each remembered answer is replaced, so memory drafts run into rejections mid-tree;
    the session engine has a draft model (a noisy copy of the target), which auto asks when the copies fall short."""
    engine = fresh_memory
    wrong = [[t if i % 4 else (t + 1) % engine.target.vocab_size for i, t in enumerate(ids)]
             for ids in reference.values()]
    engine.memory_for("auto").seed_sequences(wrong)
    results = decode(engine, ["suffix", "auto"] * 4, "auto", batch_size=8)
    check(results, reference)
    sources = {s for row in results.values() for s in row["accepted_by_source"]}
    assert {"memory", "draft_model"} <= sources, sources
    assert sum(row["accepted_tokens"] < row["drafted_tokens"] for row in results.values()) >= 4


def test_the_memory_lasts_across_a_decode_actors_calls_and_changes_no_output(fresh_memory):
    import pandas as pd

    from contract.decode_config import DecodeConfig
    from operators.build_prompts import BuildPrompts
    from operators.decode_requests import DecodeRequests
    from operators.requests_schema import normalize_row

    engine = fresh_memory
    # the session's engine instead of a second model load. The budget off: it drafts by the clock's step costs, and
    # on a loaded machine it once chose plain steps for the whole short pass (1 failure in ~10 runs: 0 remembered)
    stage = DecodeRequests.on_engine(engine, DecodeConfig(methods=["ar", "suffix"], max_new_tokens=16, batch_size=4,
                                                          speculation_budget=False))
    rows = [{"id": name, "prompt": f"Write the first three sentences of a README for a tool named {name}."}
            for name in ("alpha", "beta")]
    batch = BuildPrompts("smollm2-135m")(pd.DataFrame([normalize_row(r) for r in rows])).to_pandas()
    first = {(r["request_id"], r["method"]): r for r in stage(batch).to_pylist()}
    second = {(r["request_id"], r["method"]): r for r in stage(batch).to_pylist()}
    for key, row in second.items():
        assert row["error"] is None and row["output_token_ids"] == first[key]["output_token_ids"]
        assert row["output_token_ids"] == second[(key[0], "ar")]["output_token_ids"]
    outputs = sum(len(first[(name, "suffix")]["output_token_ids"]) for name in ("alpha", "beta"))
    assert first[("alpha", "suffix")]["pass_memory_tokens"] == outputs
    assert second[("alpha", "suffix")]["pass_memory_tokens"] == 2 * outputs  # both calls' outputs
    assert second[("alpha", "ar")]["pass_memory_tokens"] is None
    remembered = sum(dict(second[(name, "suffix")]["accepted_by_source"]).get("memory", 0)
                     for name in ("alpha", "beta"))
    assert remembered >= 16  # the second call drafted the first call's outputs
