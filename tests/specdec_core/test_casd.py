"""CASD: the suffix array, REST's frequency trie, the conditional acceptance rule (δ, EOS, top-k) and the drafter."""

import math

import numpy as np
import pytest
import torch

from specdec_core.drafters.base import RequestContext
from specdec_core.drafters.casd import ContextTreeDrafter
from specdec_core.drafters.suffix_array import SuffixArray, build_suffix_array
from specdec_core.engine import BatchItem, Engine
from specdec_core.errors import BadRequestError
from specdec_core.loop.draft_tree import frequency_trie
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.sampling import SamplingParams
from specdec_core.drafters.base import Draft, empty_draft
from specdec_core.loop import verification
from specdec_core.loop.verification import ConditionalRule, verify_conditional, verify_rows
from tests.tiny_models import tiny_llama


@pytest.mark.parametrize("seed", range(4))
def test_suffix_array_sorts_every_suffix(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 3 + seed, size=200 + 50 * seed)
    tokens[100:140] = tokens[10:50]  # a long repeat: several doubling rounds
    expected = sorted(range(len(tokens)), key=lambda i: tokens[i:].tolist())
    assert build_suffix_array(tokens).tolist() == expected
    assert build_suffix_array(np.array([7])).tolist() == [0]
    assert build_suffix_array(np.zeros(0, dtype=np.int64)).tolist() == []


def test_longest_suffix_match_and_its_occurrences():
    document = [1, 2, 3, 4, 9, 2, 3, 4, 5, 2, 3, 4]
    index = SuffixArray(document)
    # The running text ends with 7 2 3 4: the longest suffix in the document is (2 3 4), at 1, 5 and 9; the one at
    # 9 ends the document, so only 1 and 5 have continuations.
    length, lo, hi = index.longest_suffix_match(np.array([8, 7, 2, 3, 4]), min_length=1)
    assert length == 3 and sorted(index.order[lo:hi].tolist()) == [1, 5, 9]
    assert index.continuations(lo, hi, length, depth=2, limit=10) == [[9, 2], [5, 2]]
    assert index.longest_suffix_match(np.array([3, 4, 9, 2]), min_length=1)[0] == 4
    assert index.longest_suffix_match(np.array([6, 6]), min_length=1) is None
    assert index.longest_suffix_match(np.array([1, 7, 4]), min_length=2) is None  # only a 1-token match
    big = SuffixArray(list(range(50)) * 40)
    length, lo, hi = big.longest_suffix_match(np.array([48, 49]), 1)
    assert hi - lo == 40 and len(big.continuations(lo, hi, length, 3, limit=8)) == 8


def test_frequency_trie_keeps_the_most_traveled_nodes_as_a_tree():
    branches = [[5, 6, 7], [5, 6, 8], [5, 9, 1], [4, 2, 2]]
    tokens, parents = frequency_trie(branches, budget=4)
    # counts: 5:3, 6:2, then depth-1 4 (count 1) beats deeper count-1 nodes.
    assert (tokens, parents) == ([5, 6, 9, 4], [-1, 0, 0, -1])
    assert frequency_trie(branches, budget=100)[0] == [5, 6, 7, 8, 9, 1, 4, 2, 2]


def logits_for(rows):
    """rows of {token: probability} (the rest spread evenly over a 10-token vocabulary) -> [len(rows), 10] logits."""
    out = []
    for probs in rows:
        rest = (1 - sum(probs.values())) / (10 - len(probs))
        out.append([math.log(probs.get(t, rest)) for t in range(10)])
    return torch.tensor(out)


def test_conditional_rule_accepts_above_delta_and_eos():
    # node 0 -> draft 3 (p 0.3), node 1 -> draft 4 (p 0.15, but p(EOS=9) = 0.2), node 2 -> bonus argmax.
    logits = logits_for([{3: 0.3, 1: 0.5}, {4: 0.15, 9: 0.2, 5: 0.5}, {6: 0.9}])
    result = verify_conditional(None, [3, 4], logits, ConditionalRule(delta=0.1, eos_ids=(9,)))
    assert (result.num_accepted, result.next_token) == (1, 5)  # 3 accepted although not the argmax; 4 < p(EOS)
    result = verify_conditional(None, [3, 4], logits, ConditionalRule(delta=0.1))
    assert (result.num_accepted, result.next_token) == (2, 6)  # without an EOS id 0.15 > 0.1 passes
    result = verify_conditional(None, [3, 4], logits, ConditionalRule(delta=0.4))
    assert (result.num_accepted, result.next_token) == (0, 1)  # 0.3 < δ: the target's argmax instead


def test_rows_without_a_draft_take_the_shared_argmax_under_the_rule(monkeypatch):
    """The rule only judges draft nodes: a row with none takes the target's argmax from the step's one argmax, not
    a softmax of its own; a row with a draft is still judged by the rule."""
    judged = []
    monkeypatch.setattr(verification, "verify_conditional",
                        lambda *args: judged.append(args[1]) or verify_conditional(*args))
    logits = logits_for([{1: 0.6}, {3: 0.3, 1: 0.5}, {6: 0.9}])  # row 0: 1 node; row 1: 2 nodes
    rule = ConditionalRule(delta=0.1)
    drafts = [empty_draft(), Draft(tokens=[3], source="context")]
    results = verify_rows(drafts, logits, [SamplingParams()] * 2, [None, None], torch.tensor([[7, 0], [7, 3]]),
                          [rule, rule])
    assert judged == [[3]]
    assert (results[0].num_accepted, results[0].next_token) == (0, 1)
    assert (results[1].num_accepted, results[1].next_token) == (1, 6)  # 3 accepted by the rule, not the argmax


def test_top_k_and_several_eos_ids():
    logits = logits_for([{3: 0.12, 1: 0.2, 2: 0.2, 4: 0.2, 5: 0.2}, {6: 0.9}])
    assert verify_conditional(None, [3], logits, ConditionalRule(0.1)).num_accepted == 1
    assert verify_conditional(None, [3], logits, ConditionalRule(0.1, top_k=5)).num_accepted == 1  # 5th
    assert verify_conditional(None, [3], logits, ConditionalRule(0.1, top_k=4)).num_accepted == 0
    # Two EOS ids of 0.07 each: p(EOS) = 0.14 > 0.12, so 3 is refused; one of them alone (0.07) would not refuse it.
    eos = logits_for([{3: 0.12, 7: 0.07, 8: 0.07, 1: 0.5}, {6: 0.9}])
    assert verify_conditional(None, [3], eos, ConditionalRule(0.1, eos_ids=(7, 8))).num_accepted == 0
    assert verify_conditional(None, [3], eos, ConditionalRule(0.1, eos_ids=(7,))).num_accepted == 1


def test_conditional_rule_takes_the_deepest_acceptable_tree_path():
    # tree: 3 (root child) -> 4 ; 5 (root child) -> 6 -> 7. Node order: 1=3, 2=4, 3=5, 4=6, 5=7.
    parents = [-1, 0, -1, 2, 3]
    logits = logits_for([{3: 0.4, 5: 0.3}, {4: 0.6}, {1: 0.9}, {6: 0.5}, {7: 0.5}, {2: 0.8}])
    result = verify_conditional(parents, [3, 4, 5, 6, 7], logits, ConditionalRule(0.1))
    assert (result.path, result.next_token) == ((2, 3, 4), 2)
    # A child of a refused node is refused whatever its own probability.
    logits = logits_for([{3: 0.05, 5: 0.3}, {4: 0.9}, {1: 0.9}, {6: 0.05, 1: 0.5}, {7: 0.9}, {2: 0.8}])
    result = verify_conditional(parents, [3, 4, 5, 6, 7], logits, ConditionalRule(0.1))
    assert (result.path, result.next_token) == ((2,), 1)


def test_drafter_retrieves_a_tree_from_the_context():
    context = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 2, 3, 4, 5, 7]
    drafter = ContextTreeDrafter(node_budget=8, depth=3)
    drafter.start([8, 2, 3, 4], RequestContext(prompt_len=3, context_ids=context))
    draft = drafter.propose([8, 2, 3, 4], 10)
    # (2 3 4) occurs at 1, 6, 10: continuations 5 9 2 / 6 2 3 / 5 7; 5 is the most frequent first token.
    assert draft.tokens[0] == 5 and draft.source == "context" and draft.is_tree
    assert sorted(draft.tokens) == sorted([5, 9, 2, 6, 2, 3, 7])
    without_context = ContextTreeDrafter()
    without_context.start([1, 2, 3, 1, 2], RequestContext(prompt_len=4))
    assert without_context.propose([1, 2, 3, 1, 2], 10).tokens == [3, 1]  # from the prompt [1, 2, 3, 1]


def test_the_lossy_methods_spec_chooses_the_rule_and_it_refuses_sampling():
    """casd and casd_mixed verify by the conditional rule their spec builds from the options (the drafter only
    retrieves, as casd_strict's does); the engine gives it the target's EOS ids; a sampling request is refused."""
    from specdec_core.loop.verification import check_rule
    from specdec_core.methods import MethodOptions, get_method

    options = MethodOptions(casd_delta=0.2, casd_top_k=3)
    assert get_method("casd").verification(options) == ConditionalRule(0.2)
    assert get_method("casd_mixed").verification(options) == ConditionalRule(0.2, top_k=3)
    assert get_method("casd_strict").verification is None and get_method("pld").verification is None
    assert type(get_method("casd").build_drafter(options, None)) is ContextTreeDrafter
    with pytest.raises(BadRequestError, match="greedy"):
        check_rule(ConditionalRule(0.1), SamplingParams(temperature=0.7))
    check_rule(ConditionalRule(0.1), SamplingParams())
    check_rule(None, SamplingParams(temperature=0.7))
    target = tiny_llama()
    target.eos_token_ids = frozenset({2, 0})
    engine = Engine.from_runners(target)
    item = BatchItem(0, [1, 2, 3], DecodeParams(max_new_tokens=4))
    decoder = engine.decoder(batch_size=1)
    assert engine.request(item, "casd", options, decoder).rule == ConditionalRule(0.2, eos_ids=(0, 2))
    assert engine.request(item, "casd_strict", options, decoder).rule is None


@pytest.mark.slow
def test_lossy_casd_on_the_real_model_flags_its_rows_and_refuses_sampling(engine):
    """casd copies answers out of the context under its conditional rule: its rows are marked lossy, it accepts
    context tokens, and a sampling request is one clear error row (the batch goes on)."""
    context = ("The Zephyr bridge opened in 1931. It is 1,204 metres long and carries two railway tracks and a road. "
               "Its designer, Ada Brennan, also built the harbour lighthouse in 1925.")
    question = f"Passages:\n{context}\n\nQuestion: Who designed the Zephyr bridge, and what else did she build?"
    prompt = engine.prompt_ids(question)
    items = [BatchItem("greedy", prompt, DecodeParams(max_new_tokens=40), engine.context_ids(context)),
             BatchItem("sampled", prompt, DecodeParams(max_new_tokens=40, sampling=SamplingParams(temperature=0.8)),
                       engine.context_ids(context))]
    # The budget is off: its measured payoff depends on wall time, and the test counts context acceptances.
    results = dict(engine.decode_batch(items, "casd", batch_size=2, speculation_budget=False))
    assert "greedy decoding only" in results["sampled"]["error"]
    greedy = results["greedy"]
    assert greedy["error"] is None and greedy["lossy"] is True
    assert greedy["accepted_by_source"].get("context", 0) > 0
    assert greedy["mean_accepted_length"] > 1.0
