"""Drafters with another tokenizer on real models (issue 11; gemma3-270m is installed by `make install`): SLEM's
greedy outputs equal `ar` (fp32) for SmolLM2 -> Gemma3 and Gemma3 -> SmolLM2, alone and in a mixed batch with TLI's,
the union baseline's and SLRS's rows, whose seeded sampling runs complete reproducibly; tokenizer edge cases; `draft`
refuses such a drafter."""

import pytest

from specdec_core.drafters.cross_vocab_model import CrossVocabPool, SlemDrafter
from specdec_core.engine import BatchItem, Engine, EngineConfig
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.sampling import SamplingParams
from specdec_core.methods import MethodOptions
from tests.prompts import ARTICLE, CODE_RENAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MESSAGES = {
    "rename": [{"role": "user", "content": "Rename `values` to `samples` in this code and return the whole code.\n\n"
                                          + CODE_RENAME}],
    "summary": [{"role": "user", "content": "Summarize in two sentences:\n\n" + ARTICLE}],
    "chat": [{"role": "user", "content": "List three uses of the  Python  `zip` function, with   examples. Ünïcödé 🙂"}],
    # The GGUF-converted Gemma has no chat template and answers the two long raw prompts above with EOS at once:
    # a completion it continues for many tokens.
    "code": [{"role": "user", "content": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b"
                                          "\n\n\ndef mul(a, b):\n"}],
}


def engine_pair(target: str, drafter: str) -> Engine:
    return Engine(EngineConfig(model=target, dtype="float32", device="cpu", drafter=drafter, drafter_dtype="float32",
                               share_across_methods=True))  # tokens, not speed: methods share prefills


def run_batch(engine, items, methods, batch_size):
    decoder = engine.decoder(batch_size=batch_size, speculation_budget=False)
    for item, method in zip(items, methods):
        decoder.submit(engine.request(item, method, MethodOptions(), decoder))
    return {request.key: engine.result_dict(methods[[i.key for i in items].index(request.key)], request.params,
                                            result) for request, result in decoder.run()}


def make_items(engine, names, params):
    chat = bool(getattr(engine.tokenizer, "chat_template", None))  # the GGUF-converted Gemma ships none
    return [BatchItem(name, engine.prompt_ids(messages=MESSAGES[name]) if chat
                      else engine.prompt_ids(prompt=MESSAGES[name][0]["content"]),  # BOS + text
                      params) for name in names]


def check_pair(engine, names, new_tokens, methods, alone=True):
    """`methods[0]` alone on the first request (if `alone`), then one batch whose rows draft with `methods` (rows
    with different drafters): every row equals ar. -> the tokens the drafting rows accepted."""
    items = make_items(engine, names, DecodeParams(max_new_tokens=new_tokens))
    reference = {item.key: engine.generate_ids(item.prompt_ids, "ar", item.params)["output_token_ids"]
                 for item in items}
    accepted = 0
    if alone:
        # The speculation budget off: its timing-driven choice to skip drafting would make the accepted count depend
        # on the machine's load.
        [(_, single)] = engine.decode_batch(items[:1], methods[0], batch_size=1, speculation_budget=False)
        assert single["error"] is None and single["output_token_ids"] == reference[items[0].key], items[0].key
        accepted += single["accepted_tokens"]
    batched = run_batch(engine, items, methods, batch_size=len(items))
    for item, method in zip(items, methods):
        assert batched[item.key]["error"] is None, (method, batched[item.key]["error"])
        assert batched[item.key]["output_token_ids"] == reference[item.key], method
    return accepted + sum(batched[item.key]["accepted_tokens"] for item in items)


@pytest.fixture(scope="module")
def smol_target():
    return engine_pair("smollm2-135m", "gemma3-270m")


def test_slem_tli_union_and_slrs_with_a_gemma_drafter_equal_smollm2_ar_alone_and_in_one_mixed_batch(smol_target):
    """slem alone, then one batch whose rows draft with slem, TLI, the union baseline and SLRS. (Two tests before,
    slem's and the other three's: ~20 s of the suite more for the same proof.)"""
    accepted = check_pair(smol_target, ["rename", "summary", "chat", "code"], 24, ["slem", "tli", "union", "slrs"])
    assert accepted > 16, accepted  # the translated drafts are accepted, not only verified


def test_slem_with_a_smollm2_drafter_equals_gemma_ar(smol_target):
    """The other direction, Gemma 3 the target, in one batch (the alone path is the test above's), on the fixture's
    models with their roles swapped (loading them again cost ~10 s)."""
    gemma_target = Engine.from_runners(smol_target.draft_model, smol_target.target)
    accepted = check_pair(gemma_target, ["code", "chat"], 16, ["slem", "slem"], alone=False)
    assert accepted > 5, accepted


def test_tli_union_and_slrs_sample_with_a_seed_reproducibly(smol_target):
    """The sampling path (q'' / q' rows of the target's width, the OUTSIDE id fed to the target): seeded rows of the
    three methods in one batch complete and draw the same tokens twice; exactness itself is the
    χ² tests' (test_cross_vocab.py)."""
    params = DecodeParams(max_new_tokens=12, sampling=SamplingParams(temperature=1.0, seed=5))
    items = make_items(smol_target, ["rename", "chat", "summary"], params)
    methods = ["tli", "union", "slrs"]
    runs = [run_batch(smol_target, items, methods, batch_size=3) for _ in range(2)]
    for item, method in zip(items, methods):
        first = runs[0][item.key]
        assert first["error"] is None and len(first["output_token_ids"]) > 0, (method, first["error"])
        assert first["output_token_ids"] == runs[1][item.key]["output_token_ids"], method
    assert sum(runs[0][item.key]["accepted_tokens"] for item in items) > 0


def test_draft_refuses_a_drafter_with_another_tokenizer(smol_target):
    item = BatchItem("x", smol_target.prompt_ids(prompt="hello"), DecodeParams(max_new_tokens=4))
    decoder = smol_target.decoder()
    with pytest.raises(Exception, match="different tokenizer.*slem"):
        smol_target.request(item, "draft", MethodOptions(), decoder)


@pytest.mark.parametrize("text", ["a    b\t\tc  ", "héllo wörld 🙂 世界", "\n\n    indented()\n", " leading space",
                                  "x = {'k': [1, 2]}  # comment"])
def test_draft_text_reaches_the_target_as_the_same_text(smol_target, text):
    pool = smol_target.decoder().draft_pool
    assert isinstance(pool, CrossVocabPool)
    drafter = SlemDrafter(pool)
    committed = smol_target.tokenizer("def f():\n    return", add_special_tokens=False)["input_ids"]
    ids = drafter.target_tokens(committed, text)
    assert pool.target_text(committed + ids) == pool.target_text(committed) + text
    assert pool.target_text(pool.target_ids(text)) == text  # runs of spaces and unicode survive the round trip
    # Re-encoding a fragment never adds BOS or any special token.
    specials = set(pool.runner.tokenizer.all_special_ids)
    assert not specials & set(pool.draft_ids(text))


def test_prompt_translation_keeps_the_text_and_maps_special_tokens(smol_target):
    pool = smol_target.decoder().draft_pool
    prompt = smol_target.prompt_ids(messages=MESSAGES["chat"])
    translated = pool.translate_prompt(prompt)
    gemma = pool.runner.tokenizer
    assert gemma.decode(translated, skip_special_tokens=True) \
        == smol_target.tokenizer.decode(prompt, skip_special_tokens=True)
    assert translated[0] == gemma.bos_token_id  # SmolLM2's <|im_start|> is its BOS: Gemma's <bos>
    # A special token of the drafter appears only where a target special token maps to it; the others are dropped.
    mapped = {int(pool.mapping.target_to_draft[t]) for t in prompt
              if t in pool.target_specials and pool.mapping.target_to_draft[t] >= 0}
    assert {t for t in translated if t in set(gemma.all_special_ids)} <= mapped


def test_vocab_overlap_command_reports_the_pair(capsys):
    from specdec_core.cli import main

    assert main(["vocab-overlap", "--drafter", "gemma3-270m", "--model", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    shared = int(out.split(": ", 1)[1].split(" shared")[0])
    assert "of the target's 49152" in out and 40000 < shared < 49152, out  # most SmolLM2 tokens are Gemma's too


def test_the_shared_token_head_gives_tli_its_exact_drafting_distribution(smol_target):
    """TLI drafts through the drafter's head over the shared tokens only (SubsetHead): its logits are the full
    head's there and -inf elsewhere, so its softmax is q'' (q restricted to the shared tokens, renormalised)."""
    import torch

    from specdec_core.drafters.cross_vocab import tli_distribution
    from specdec_core.drafters.tli import TliDrafter, UnionDrafter

    pool = CrossVocabPool(smol_target.draft_model, smol_target.tokenizer, smol_target.vocab_mapping())
    hidden = torch.randn(3, smol_target.draft_model.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    full = smol_target.draft_model.head_logits(hidden)  # [3, |D|]
    subset = pool.shared_head(hidden)  # [3, |D|]
    shared = pool.shared_head.token_ids
    assert subset.shape == full.shape
    torch.testing.assert_close(subset[:, shared], full[:, shared])
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[shared] = False
    assert torch.isinf(subset[:, outside]).all() and outside.sum() > 100_000  # Gemma's head is mostly not shared
    q_full = torch.softmax(full, dim=-1)
    q_subset = torch.softmax(subset, dim=-1)
    mapping = smol_target.vocab_mapping()
    for row in range(3):
        torch.testing.assert_close(tli_distribution(q_subset[row], mapping), tli_distribution(q_full[row], mapping))
    assert (TliDrafter.head_tokens, UnionDrafter.head_tokens) == ("shared", "all")


def _indent_proposal(engine, heals: bool) -> str:
    """The text SLEM proposes after the target emitted "\\n" + "   " (SmolLM2 splits a 4-space indent so: "\\n   "
    then " return"), with Gemma 3 drafting: Gemma has one token per indent ("    "), and fed a 3-space one it reads
    the indent as finished."""
    from specdec_core.drafters.base import RequestContext
    from specdec_core.loop.sampling import SamplingParams

    pool = engine.decoder().draft_pool
    drafter = SlemDrafter(pool, num_tokens=4)
    drafter.heals_boundary = heals
    prompt = engine.tokenizer("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):", add_special_tokens=False)
    generated = engine.tokenizer("\n   ", add_special_tokens=False)["input_ids"]
    tokens = prompt["input_ids"] + generated
    drafter.start(tokens, RequestContext(prompt_len=len(prompt["input_ids"]), sampling=SamplingParams()))
    draft = drafter.propose(tokens, 4)  # (no loop collecting: the pool drafts at once)
    return pool.target_text(draft.tokens)


def test_healing_lets_the_drafter_redraft_an_indent_the_target_split(smol_target):
    pool = smol_target.decoder().draft_pool
    gemma = pool.runner.tokenizer
    [three] = gemma("   ", add_special_tokens=False)["input_ids"]
    [newline] = gemma("\n", add_special_tokens=False)["input_ids"]
    assert pool.is_indent(three) and not pool.is_indent(newline) and not pool.is_indent(gemma("x")["input_ids"][-1])
    longer = [pool.draft_text([int(t)]) for t in pool.tokens_extending(three)]
    assert "   " in longer and "    " in longer and all(text.startswith("   ") for text in longer)
    # Healed, the drafter completes the 4-space indent (" return ..."); fed the 3-space token, it does not.
    assert _indent_proposal(smol_target, heals=True).startswith(" return")
    assert not _indent_proposal(smol_target, heals=False).startswith(" ")


def test_a_priced_stop_is_measured_while_decoding_and_carried_to_the_next_decoder(smol_target):
    """`draft_confidence="priced"` (the default): the decoder times drafter forwards and its own steps, and the
    price each drafted token must beat is the measured one, kept by the engine for the method's next decoder.
    The budget is off: its plan follows the step costs earlier tests taught this engine, and for this pair (a
    drafter twice the target's size) it may rightly verify 1-token drafts, which need no drafter forward to time."""
    smol_target.learned.pop("slem", None)
    [item] = make_items(smol_target, ["code"], DecodeParams(max_new_tokens=12))
    [(_, result)] = smol_target.decode_batch([item], "slem", batch_size=1, speculation_budget=False)
    assert result["error"] is None and result["drafted_tokens"] > 0
    pooled, _, pricing = smol_target.learned["slem"]
    assert pricing.forward_s > 0 and pricing.token_s > 0 and pricing.verify_s >= 0 and pricing.drafting_rows == 1
    assert pricing.floor() == pytest.approx(max(0.02, (pricing.forward_s + pricing.verify_s) / pricing.token_s))
    assert pooled.accepted + pooled.rejections > 0
    decoder = smol_target.decoder(method="slem")
    assert decoder.budget.pricing is pricing and decoder.budget.pooled is pooled


def test_the_frequent_token_head_adds_each_rows_own_tokens_and_no_other_rows(smol_target):
    """SLEM drafts through the drafter's head over its frequent tokens (the standard library's) plus the row's own:
    a name only the prompt uses gets its logits in that row, and stays -inf in a row whose prompt lacks it."""
    import torch

    from specdec_core.drafters.base import RequestContext
    from specdec_core.loop.sampling import SamplingParams

    pool = smol_target.decoder().draft_pool
    gemma, frequent = pool.runner.tokenizer, pool.frequent
    assert SlemDrafter.head_tokens == "frequent"
    # Built once per draft model / pair, not per decoder (a decoder is built per batch of rows, or per prompt).
    other = smol_target.decoder().draft_pool
    assert other is not pool and other.frequent is frequent
    assert other.shared_head is pool.shared_head and other.first_tokens is pool.first_tokens
    assert 10_000 < len(frequent.ids) <= 32_768 < pool.runner.vocab_size
    assert not frequent.missing(gemma("    return self._value", add_special_tokens=False)["input_ids"])
    name = "quuxblorfle_zanthrope"
    rare = frequent.missing(gemma(name, add_special_tokens=False)["input_ids"])
    assert rare  # pieces of the name the standard library never produces

    hidden = torch.randn(2, pool.runner.model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    full = pool.runner.head_logits(hidden)  # [2, |D|]
    out = frequent.head_for_rows({5: rare, 7: set()}).for_rows([5, 7])(hidden)  # rows 5 and 7 of the cache
    rare_ids = torch.tensor(sorted(rare))
    torch.testing.assert_close(out[:, frequent.ids], full[:, frequent.ids])
    torch.testing.assert_close(out[0, rare_ids], full[0, rare_ids])
    assert torch.isinf(out[1, rare_ids]).all()
    assert int(torch.isfinite(out[1]).sum()) == len(frequent.ids)
    assert int(torch.isfinite(out[0]).sum()) == len(frequent.ids) + len(rare)

    # A row whose prompt defines the name can draft it (the target's 8 tokens cut it short); without the row's own
    # tokens the drafter cannot name it.
    prompt = smol_target.tokenizer(f"def {name}(a):\n    return a\n\n\nprint({name}(1))\nprint(",
                                   add_special_tokens=False)["input_ids"]
    proposals = []
    for own in (True, False):
        drafter = SlemDrafter(pool, num_tokens=8)
        drafter.start(prompt, RequestContext(prompt_len=len(prompt), sampling=SamplingParams()))
        assert rare <= drafter.own_tokens
        if not own:
            drafter.own_tokens = set()
        proposals.append(pool.target_text(drafter.propose(prompt, 8).tokens))
    assert name.startswith(proposals[0]) and len(proposals[0]) >= len("quuxblorfle"), proposals
    assert not proposals[1].startswith("quuxblorfle"), proposals
