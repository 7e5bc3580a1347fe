"""A step's suffix proposals drafted together (suffix_batch.py) give each row the draft it proposes alone: serial and
parallel passes, a job memory shared by the rows, a long catch-up, a tree that outgrows its size, a slot reused."""

import random

import pytest

from specdec_core.drafters.base import RequestContext
from specdec_core.drafters.job_memory import JobMemory
from specdec_core.drafters.suffix import SuffixDrafter
from specdec_core.drafters.suffix_batch import PARALLEL_MIN_ROWS, SuffixBatch


def _texts(generator, count):
    """Rows that share phrases (so the memory and the rows' own trees both have something to offer)."""
    phrases = [[generator.randrange(40) for _ in range(generator.randrange(3, 9))] for _ in range(12)]
    return [sum((generator.choice(phrases) for _ in range(generator.randrange(40, 90))), []) for _ in range(count)]


class Side:
    """One way of proposing: rows in a decoder's batch, or each row alone; each side has its own job memory, kept
    equal to the other's by the same calls in the same order."""

    def __init__(self, batched: bool, seed_outputs):
        self.pools = {} if batched else None
        self.memory = JobMemory(max_tokens=3000)
        for output in seed_outputs:
            self.memory.add(output)
        self.rows: dict[int, SuffixDrafter] = {}

    def start(self, key, tokens, tokens_left):
        drafter = SuffixDrafter(factor=2.0, min_prob=0.05)
        drafter.start(tokens, RequestContext(prompt_len=len(tokens), job_memory=self.memory, tokens_left=tokens_left,
                                             row_pools=self.pools))
        self.rows[key] = drafter

    def propose(self, tokens_by_key: dict, max_tokens: int) -> dict:
        if self.pools is None:
            return {key: self.rows[key].propose(tokens, max_tokens) for key, tokens in tokens_by_key.items()}
        [batch] = self.pools.values()
        with batch.collecting_proposals():
            drafts = {key: self.rows[key].propose(tokens, max_tokens) for key, tokens in tokens_by_key.items()}
        batch.flush()
        return drafts

    def commit(self, tokens_by_key: dict) -> None:
        for key, tokens in tokens_by_key.items():
            self.rows[key].while_verifying(tokens)

    def finish(self, key) -> None:
        self.rows.pop(key).finish()


@pytest.mark.parametrize("rows", [3, 2 * PARALLEL_MIN_ROWS])
def test_a_batch_drafts_what_each_row_drafts_alone(rows):
    generator = random.Random(rows)
    texts = _texts(generator, rows + 3)
    batched, alone = Side(True, texts[-2:]), Side(False, texts[-2:])
    tokens = {}
    for key in range(rows):
        prompt_len = len(texts[key]) // 2
        tokens[key] = texts[key][:prompt_len]
        left = 0 if key == 0 else len(texts[key]) - prompt_len  # row 0's tree outgrows its size as it decodes
        for side in (batched, alone):
            side.start(key, tokens[key], left)
    [batch] = batched.pools.values()
    assert isinstance(batch, SuffixBatch)
    drafted, steps, next_key = 0, 0, rows
    while tokens:
        steps += 1
        mine, theirs = batched.propose(tokens, 12), alone.propose(tokens, 12)
        for key in tokens:
            got, want = mine[key], theirs[key]
            assert (got.tokens, got.parents, got.confidence, got.source, got.from_context) == (
                want.tokens, want.parents, want.confidence, want.source, want.from_context), (key, steps)
            drafted += len(got.tokens)
        for key in list(tokens):
            text = texts[key] if key < len(texts) else texts[key % rows]
            step = 300 if key == 1 and steps == 2 else generator.randrange(1, 4)  # row 1: a long catch-up
            tokens[key] = text[:len(tokens[key]) + step]
        for side in (batched, alone):
            side.commit(tokens)
        for key in [k for k, t in tokens.items() if len(t) >= len(texts[k % len(texts)])]:
            del tokens[key]
            for side in (batched, alone):
                side.finish(key)
            if next_key < rows + 2:  # a new row takes the finished one's slot
                tokens[next_key] = texts[next_key % rows][:30]
                for side in (batched, alone):
                    side.start(next_key, tokens[next_key], 200)
                next_key += 1
    assert drafted > 50 * rows and next_key == rows + 2
    assert batched.rows == {} and batch.pending == [] and sorted(batch.free_slots) == list(range(len(batch.owners)))


def test_a_bad_token_fails_its_own_proposal_only():
    batched = Side(True, [])
    batched.start(0, [1, 2, 3, 1, 2], 10)
    batched.start(1, [1, 2, 3, 1, 2], 10)
    [batch] = batched.pools.values()
    with batch.collecting_proposals():
        with pytest.raises(ValueError, match="token ids"):
            batched.rows[0].propose([1, 2, 3, 1, 2, -4], 4)
        draft = batched.rows[1].propose([1, 2, 3, 1, 2, 3], 4)
    batch.flush()
    assert draft.tokens == [1, 2, 3][: len(draft.tokens)] and draft.tokens


def test_a_wrapped_suffix_drafter_proposes_alone():
    """Under auto's cascade the proposals are compared as they come: the wrapped drafter keeps out of the batch."""
    from specdec_core.drafters.fallback import FallbackDrafter
    from specdec_core.drafters.prompt_lookup import PromptLookupDrafter

    pools = {}
    wrapper = FallbackDrafter([SuffixDrafter(), PromptLookupDrafter()])
    wrapper.start([1, 2, 3, 1, 2], RequestContext(prompt_len=5, row_pools=pools))
    assert pools == {} and wrapper.drafters[0].pool is None
    assert wrapper.propose([1, 2, 3, 1, 2], 4).tokens[:1] == [3]


def test_the_loop_drafts_its_suffix_rows_together_before_it_plans_and_their_tokens_equal_ars():
    """The decoder flushes the batch once the step's proposals are in: the plan reads whole drafts (an unflushed
    draft is empty, and the rows would verify nothing). Tiny random Llama, fp32."""
    from specdec_core.engine import BatchItem, Engine
    from specdec_core.loop.requests import DecodeParams
    from tests.tiny_models import repetitive_prompt, tiny_llama

    engine = Engine.from_runners(tiny_llama(0))
    items = [BatchItem(key, repetitive_prompt(key, 60), DecodeParams(max_new_tokens=24)) for key in range(4)]
    plain = {key: result["output_token_ids"] for key, result in engine.decode_batch(items, "ar", batch_size=4)}
    decoder = engine.decoder(4, method="suffix")
    decoder.budget.enabled = False  # (every proposal is verified: the plan cannot hide an empty draft)
    planned: list[int] = []
    plan = decoder._plan

    def recording_plan(*args):
        planned.append(sum(len(row.draft) for row in decoder.rows))
        return plan(*args)

    decoder._plan = recording_plan
    for item in items:
        decoder.submit(engine.request(item, "suffix", None, decoder))
    got = {request.key: result.token_ids for request, result in decoder.run()}
    [batch] = decoder.row_pools.values()
    assert isinstance(batch, SuffixBatch) and len(batch.owners) == 4
    assert got == plain
    assert sum(planned) > 0 and decoder.stats.accepted_tokens > 0
