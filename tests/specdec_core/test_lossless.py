"""Lossless on the real default model (fp32): every lossless method's greedy output equals that request's own
single-request `ar` output, token for token, in batches whose rows use different methods, with prompts of very
different lengths and rows finishing early. The drafters with another tokenizer (slem, tli, union, slrs) are
test_slem.py's. The mechanics variants (batch sizes, late admission, budget, trees, pools, a failing row) run on a tiny
model in test_lossless_mechanics.py."""

import pytest

from specdec_core.engine import BatchItem
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.sampling import SamplingParams
from specdec_core.methods import METHODS, MethodOptions
from tests.prompts import LOSSLESS_MAX_NEW, lossless_items

pytestmark = pytest.mark.slow

CROSS_VOCABULARY = {"slem", "tli", "union", "slrs"}  # test_slem.py: they need a drafter with another tokenizer
JOB_MEMORY = {"suffix", "auto"}  # test_suffix_decoding.py: with the job memory empty, right and wrong

# Two batches of the 8 cases, each row with its own method (every draft verified: the budget is off). In the first,
# each row's `context` holds the later part of its own answer, so the context drafters copy long, accepted drafts;
# in the second, the corpus index holds parts of the answers, and the draft models draft.
WITH_CONTEXT = [("pld", MethodOptions()), ("copyspec", MethodOptions()), ("copyspec", MethodOptions(candidates=3)),
                ("pld_plus_h", MethodOptions()), ("casd_strict", MethodOptions()), ("pld_plus_a", MethodOptions()),
                ("ar", MethodOptions()), ("spectra", MethodOptions(spectra_pool=6))]
WITHOUT_CONTEXT = [("draft", MethodOptions(adaptive=True)), ("copyspec+draft", MethodOptions()),
                   ("rest", MethodOptions()), ("spectra+retrieval", MethodOptions(spectra_pool=6)),
                   ("pld", MethodOptions(candidates=3)), ("copyspec", MethodOptions(gamma=5, copy_tokens=32)),
                   ("pld_plus_h", MethodOptions(hidden_layer=4, adaptive=True)), ("draft", MethodOptions())]


@pytest.fixture(scope="module", autouse=True)
def fixed_induction_heads(engine):
    """pld_plus_a ranks occurrences by the target's induction heads, discovered once per model and saved (~1 min on 2
    cores the first time). Which heads rank them changes the drafts, never the output: here the first heads stand in
    for the discovered ones. Discovery itself is test_pld_plus.py's."""
    from specdec_core.drafters import pld_plus

    config = engine.target.model.config
    ranking = {"heads": [[layer, head, 1] for layer in range(config.num_hidden_layers)
                         for head in range(config.num_attention_heads)]}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pld_plus, "head_ranking", lambda runner: ranking)
        yield


def items(engine):
    return lossless_items(engine)


@pytest.fixture(scope="module")
def reference(lossless_reference):
    return lossless_reference


def test_cases_are_long_and_varied(reference, engine):
    lengths = [len(item.prompt_ids) for item in items(engine)]
    assert max(lengths) > 4 * min(lengths), lengths  # very different prompt lengths share a batch
    for name, r in reference.items():
        assert r["new_tokens"] == LOSSLESS_MAX_NEW[name], (name, r["new_tokens"])
        assert r["mean_accepted_length"] == 1.0 and r["target_forwards"] == r["new_tokens"]


def test_every_lossless_method_is_checked_on_the_real_model():
    """A method added to the registry needs a row here (or in test_slem.py's cross-vocabulary set)."""
    checked = {method for method, _ in WITH_CONTEXT + WITHOUT_CONTEXT} | CROSS_VOCABULARY | JOB_MEMORY
    assert checked == {name for name, spec in METHODS.items() if spec.lossless}


@pytest.fixture(scope="module")
def index(engine, reference, tmp_path_factory):
    """A corpus index for the default model: the later parts of the answers but the last case's, and unrelated
    text."""
    from specdec_core.drafters.retrieval_index import write_index
    from specdec_core.prompts import tokenizer_fingerprint

    directory = tmp_path_factory.mktemp("index") / "index"
    texts = [reference[name]["output_token_ids"][12:] for name in list(reference)[:-1]]
    texts.append(engine.tokenizer("The quick brown fox jumps over the lazy dog. " * 20)["input_ids"])
    write_index(directory, texts, {"model": engine.config.model, "tokenizer": tokenizer_fingerprint(engine.tokenizer)})
    return str(directory)


def decode_mixed(engine, plans, index=None, with_context=None, batch_size=8, rows=range(8)):
    """The 8 cases (or those in `rows`), case i decoded with plans[i], batch_size at a time (1: each alone); returns
    {case: (method, result dict)}."""
    decoder = engine.decoder(batch_size=batch_size, speculation_budget=False)
    methods = {}
    for row, (item, (method, options)) in enumerate(zip(items(engine), plans)):
        if row not in rows:
            continue
        if index is not None:
            options = options.model_copy(update={"retrieval_index": index})
        if with_context is not None:
            item.context_ids = with_context[item.key]
        decoder.submit(engine.request(item, method, options, decoder))
        methods[item.key] = method
    return {request.key: (methods[request.key], engine.result_dict(methods[request.key], request.params, result))
            for request, result in decoder.run()}


def own_answer_contexts(reference) -> dict:
    """Each case's `context`: a document holding the last two thirds of its own answer."""
    return {name: [11, 12] + ar["output_token_ids"][len(ar["output_token_ids"]) // 3:] + [13]
            for name, ar in reference.items()}


def check_equal_to_ar(results, reference):
    drafted, rejected = {}, {}
    for name, (method, row) in results.items():
        ar = reference[name]
        assert row["error"] is None, (method, name, row["error"])
        assert row["output_token_ids"] == ar["output_token_ids"], f"{method} differs from ar on {name}"
        assert row["output_text"] == ar["output_text"] and row["finish_reason"] == ar["finish_reason"]
        assert row["target_forwards"] <= ar["target_forwards"]
        drafted[method] = drafted.get(method, 0) + row["drafted_tokens"]
        rejected[method] = rejected.get(method, 0) + (row["accepted_tokens"] < row["drafted_tokens"])
    never = [method for method, count in drafted.items() if method != "ar" and count == 0]
    assert not never, f"{never} never drafted, so their rows proved nothing"
    return rejected


def test_context_drafters_in_one_batch_equal_ar(engine, reference, monkeypatch):
    """Each row gets as its `context` a document holding the last two thirds of its own answer: context drafts are
    long and accepted, and the context copies are counted as their own source. The compiled decode attention
    (cpu_attention.py) runs every step here, though these prompts are below its threshold; the references ran
    without it."""
    from specdec_core.model import grouped_attention

    monkeypatch.setattr(grouped_attention, "KERNEL_MIN_KEY_VALUES", 0)
    contexts = own_answer_contexts(reference)
    results = decode_mixed(engine, WITH_CONTEXT, with_context=contexts)
    check_equal_to_ar(results, reference)
    from_context = 0
    for method, row in results.values():
        if method in ("pld", "copyspec", "casd_strict"):
            from_context += row["accepted_by_source"].get("context", 0)
            assert row["copied_tokens"] >= row["accepted_by_source"].get("context", 0)
    assert from_context > 16, from_context


def test_draft_model_and_retrieval_drafters_in_one_batch_equal_ar(engine, reference, index):
    """The draft model (conftest: a noisy copy of the target) is wrong now and then, so its rollback runs; rows that
    retrieve from the index (and rows that find nothing) still equal ar."""
    results = decode_mixed(engine, WITHOUT_CONTEXT, index=index)
    rejected = check_equal_to_ar(results, reference)
    assert rejected["draft"] + rejected["copyspec+draft"] >= 2, rejected
    assert sum(row["accepted_by_source"].get("retrieval", 0) for method, row in results.values()
               if method in ("rest", "spectra+retrieval")) > 0


def first_row_of_each_method(plans) -> list[int]:
    return [row for row, (method, _) in enumerate(plans) if method != "ar"
            and method not in [m for m, _ in plans[:row]]]


def test_each_method_alone_equals_ar(engine, reference, index):
    """Each method once more, its row decoded alone (batch size 1), with the same case, options and context as in
    the batches above."""
    contexts = own_answer_contexts(reference)
    alone = decode_mixed(engine, WITH_CONTEXT, with_context=contexts, batch_size=1,
                         rows=first_row_of_each_method(WITH_CONTEXT))
    check_equal_to_ar(alone, reference)
    alone = decode_mixed(engine, WITHOUT_CONTEXT, index=index, batch_size=1,
                         rows=first_row_of_each_method(WITHOUT_CONTEXT))
    check_equal_to_ar(alone, reference)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_graph_ready_steps_equal_ar(engine, reference, monkeypatch, attention):
    """The graph-ready step (graph_step.py: static buffers, verification on the device, as a GPU captures it), run
    eagerly: rows of plain decoding, chains and trees in one batch equal `ar`, with masked SDPA and with
    flex_attention's block masks (block_attention.py; the prefills through it too)."""
    runner = engine.target
    monkeypatch.setattr(runner, "gpu_attention", attention)
    plans = [("pld", MethodOptions()), ("copyspec", MethodOptions()), ("copyspec", MethodOptions(candidates=3)),
             ("ar", MethodOptions()), ("pld", MethodOptions(candidates=3)),
             ("copyspec", MethodOptions(gamma=5, copy_tokens=32)), ("casd_strict", MethodOptions()),
             ("ar", MethodOptions())]
    monkeypatch.setattr(runner, "graph_mode", "eager")
    monkeypatch.setattr(runner, "_graph_step", None)
    results = decode_mixed(engine, plans, with_context=own_answer_contexts(reference))
    check_equal_to_ar(results, reference)
    assert runner.graph_step().steps > 0 and runner.graph_step().attention == attention
    assert sum(row["accepted_tokens"] for _, row in results.values()) > 100
    if attention == "flex":
        return  # (the attention's rule is the same alone as in a batch: test_block_attention.py)
    alone = decode_mixed(engine, plans, with_context=own_answer_contexts(reference), batch_size=1, rows=range(3))
    check_equal_to_ar(alone, reference)  # a chain, a chain and a tree, each alone through the same step


def test_graph_ready_steps_sample_what_ar_samples(engine, monkeypatch):
    """Seeded sampling rows on the real model (fp32, temperature 0.7, two with top-p, one with top-k too): `ar`
    through the eager forward and the host's draws, and chains and trees through the graph-ready step's draws on the
    device (graph_step.py), give the same tokens: the draws are by position (sampling.PositionDraws), so neither the
    width nor the path changes them."""
    runner = engine.target
    cases = [BatchItem(item.key, item.prompt_ids, DecodeParams(max_new_tokens=32, sampling=SamplingParams(
        temperature=0.7, seed=index, top_p=0.9 if index % 2 else 1.0, top_k=40 if index == 3 else 0)))
        for index, item in enumerate(lossless_items(engine)[:4])]
    plans = [("pld", MethodOptions()), ("copyspec", MethodOptions(candidates=3)), ("copyspec", MethodOptions()),
             ("pld", MethodOptions(candidates=3))]

    def decode(plan_of):
        decoder = engine.decoder(batch_size=4, speculation_budget=False)
        for item in cases:
            method, options = plan_of(item)
            decoder.submit(engine.request(item, method, options, decoder))
        return {request.key: result for request, result in decoder.run()}

    ar = decode(lambda item: ("ar", MethodOptions()))
    monkeypatch.setattr(runner, "graph_mode", "eager")
    monkeypatch.setattr(runner, "_graph_step", None)
    drafted = decode(lambda item: plans[cases.index(item)])
    assert runner.graph_step().steps > 0
    assert sum(result.metrics.accepted_tokens for result in drafted.values()) > 10
    for item in cases:
        assert drafted[item.key].token_ids == ar[item.key].token_ids, item.key
