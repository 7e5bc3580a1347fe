"""The job memory: its bound and eviction, rows drafting from each other's outputs, seeding from earlier runs'
Parquet (no model: token ids by hand)."""

from datetime import datetime, timedelta, timezone

import pyarrow.parquet as pq
import pytest

from contract.schema import generations_table
from specdec_core.drafters.base import Draft, RequestContext
from specdec_core.drafters.suffix import MEMORY_SOURCE, SUFFIX_SOURCE, SuffixDrafter
from specdec_core.drafters.suffix_tree import APPEND_CHUNK, Cursor
from specdec_core.errors import SpecbatchError
from specdec_core.drafters.job_memory import JobMemory, read_outputs


def test_the_bound_holds_and_the_oldest_output_is_evicted_whole():
    memory = JobMemory(max_tokens=10, depth=4)
    for first in (100, 200, 300):
        memory.add([first, 1, 2, 3])
    assert memory.tokens == 8 and memory.evicted == 1
    assert 100 not in memory.tree.children(0) and {200, 300} <= set(memory.tree.children(0))
    assert memory.tree.count(memory.tree.node([1])) == 2  # the evicted output's counts went with it


def test_a_running_row_is_never_evicted_and_a_full_memory_leaves_new_rows_out():
    memory = JobMemory(max_tokens=6, depth=4)
    running, late = memory.begin(), memory.begin()
    memory.append(running, [1, 2, 3, 4, 5, 6])
    memory.append(late, [7, 8])  # nothing finished to evict: this output stays out
    assert late.dropped and memory.tokens == 6 and 7 not in memory.tree.children(0)
    memory.finish(running)
    memory.add([9, 9])  # now the finished one goes
    assert memory.tokens == 2 and memory.evicted == 1


def test_a_zero_bound_keeps_nothing():
    memory = JobMemory(max_tokens=0)
    memory.add([1, 2, 3])
    assert memory.tokens == 0 and not memory.tree.children(0)


def start(drafter, tokens, prompt_len, memory):
    drafter.start(tokens, RequestContext(prompt_len=prompt_len, job_memory=memory))


def test_a_row_drafts_what_another_row_is_writing_and_its_own_text():
    memory = JobMemory(max_tokens=1000)
    writer, reader = SuffixDrafter(), SuffixDrafter()
    start(writer, [1, 2, 50], prompt_len=2, memory=memory)
    written = [1, 2, 50, 51, 52, 53, 54]
    writer.observe(written, None, 0)
    assert memory.tokens == 1  # a commit hands the memory nothing: the next step's verify does
    writer.while_verifying(written)  # its output so far enters the memory as it is decoded
    start(reader, [9, 9, 50, 51], prompt_len=2, memory=memory)
    draft = reader.propose([9, 9, 50, 51], max_tokens=8)
    assert draft.tokens == [52, 53] and draft.source == MEMORY_SOURCE  # factor 1 x a match of 2 (50 51) nodes
    assert memory.tokens == 5 + 2  # outputs only: neither prompt is in the memory
    own = SuffixDrafter()
    start(own, [4, 5, 6, 7, 4, 5, 6], prompt_len=7, memory=memory)
    draft = own.propose([4, 5, 6, 7, 4, 5, 6], max_tokens=8)
    assert draft.tokens == [7, 4, 5] and draft.source == SUFFIX_SOURCE and draft.from_context
    written.append(55)
    writer.observe(written, None, 0)
    writer.finish()  # the last commit's tokens too
    assert memory.sequences[0].finished and memory.sequences[0].tokens == written[2:]


def advanced(tree, cursor, tokens):
    """A copy of `cursor` advanced by `tokens` (the cursor itself unchanged)."""
    copy = Cursor(len(cursor.nodes) - 1)
    copy.nodes[:], copy.lengths[:], copy.size[:] = cursor.nodes, cursor.lengths, cursor.size
    tree.advance(copy, tokens)
    return copy


class SeparateCalls(SuffixDrafter):
    """SuffixDrafter.propose made of the trees' separate calls, the memory always searched: each tree's cursor
    copied and advanced by the tokens since the last step, then each tree's draft. What the one compiled call
    (SuffixTree.best_draft, which looks the new tokens up only from the suffixes its search reaches) must equal."""

    def propose(self, tokens, max_tokens):
        new = tokens[self.indexed:]
        own = advanced(self.own, self.own_cursor, new)
        best, source = self.own.draft(own, max_tokens, self.factor, self.min_prob), SUFFIX_SOURCE
        if self.memory is not None:
            cursor = advanced(self.memory.tree, self.memory_cursor, new)
            remembered = self.memory.tree.draft(cursor, max_tokens, self.factor, self.min_prob)
            if remembered.score > best.score:
                best, source = remembered, MEMORY_SOURCE
        return Draft(tokens=best.tokens, source=source, parents=best.parents, confidence=best.probs)


@pytest.mark.parametrize("with_memory", [True, False])
def test_one_compiled_call_a_step_drafts_as_the_separate_calls(with_memory):
    """Rows decoding small-alphabet text side by side (own drafts and memory drafts both win at times, catch-ups
    longer than a compiled chunk included, steps whose tokens the trees never got): the drafter's one call a step
    (both drafts from cursors a step behind, the memory searched only where it could win) drafts what the separate
    calls do, and the trees hold the same."""
    import random

    def run(drafter_class) -> tuple[list, list]:
        """Six rows' drafts over 40 steps, and what the trees hold after each step (tokens, nodes)."""
        rng = random.Random(3)
        memory = JobMemory(max_tokens=4000) if with_memory else None
        script = [rng.randrange(40) for _ in range(600)]  # what every row writes, each from its own place
        rows = []
        for row in range(6):
            tokens = [rng.randrange(6) for _ in range(30)]  # prompts of few distinct tokens: own drafts too
            drafter = drafter_class()
            start(drafter, tokens, prompt_len=30, memory=memory)
            rows.append((drafter, tokens, [12 * row]))
        drafts, held = [], []
        for step in range(40):
            for drafter, tokens, place in rows:
                draft = drafter.propose(tokens, max_tokens=8 if step % 7 else 0)
                drafts.append((draft.tokens, draft.parents, draft.source if draft.tokens else None,
                               draft.confidence or None))
                held.append((drafter.own.tokens, drafter.own.node_count) + (
                    (memory.tree.tokens, memory.tree.node_count) if memory is not None else ()))
                assert drafter.own.tokens == drafter.indexed
                if step % 5 != 3:  # (else the next step catches up two steps' tokens)
                    drafter.while_verifying(tokens)  # as the loop calls it: after the proposals, before the commit
                    assert drafter.own.tokens == len(tokens)
                taken = rng.randrange(1, 4) if step != 19 else APPEND_CHUNK + 5  # step 20 catches up, drafting
                tokens.extend(script[place[0]: place[0] + taken] if rng.random() < 0.7 else [rng.randrange(6)])
                place[0] += taken
                drafter.observe(tokens, draft, 0)
        return drafts, held

    (separate, held), (fused, fused_held) = run(SeparateCalls), run(SuffixDrafter)
    assert fused == separate and fused_held == held
    sources = {source for _, _, source, _ in separate}
    assert sources >= ({SUFFIX_SOURCE, MEMORY_SOURCE} if with_memory else {SUFFIX_SOURCE})
    assert sum(1 for tokens, *_ in separate if tokens) > 100


def write_run(directory, run_id, model, rows, started):
    path = directory / "generations" / f"run_id={run_id}" / "method=ar"
    path.mkdir(parents=True)
    table = generations_table([{"run_id": run_id, "method": "ar", "model": model, "started_at": started + timedelta(
        seconds=i), **row} for i, row in enumerate(rows)]).drop(["run_id", "method"])
    pq.write_table(table, path / "part-0.parquet")


def test_seeding_keeps_the_newest_output_of_each_request_that_fits(tmp_path):
    from transformers import PreTrainedTokenizerFast  # (no weights: the tokenizer is only compared)

    night = datetime(2026, 11, 24, tzinfo=timezone.utc)
    write_run(tmp_path, "old", "m", [{"request_id": "a", "output_token_ids": [1, 1, 1]},
                                     {"request_id": "b", "output_token_ids": [2, 2]},
                                     {"request_id": "c", "error": "boom"}], night)
    write_run(tmp_path, "new", "m", [{"request_id": "a", "output_token_ids": [3, 3, 3]},
                                     {"request_id": "d", "output_token_ids": [4]}], night + timedelta(days=1))
    tokenizer = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)  # never read: one model only
    assert read_outputs(str(tmp_path), tokenizer, "m", max_tokens=100) == [[2, 2], [3, 3, 3], [4]]
    assert read_outputs(str(tmp_path / "generations"), tokenizer, "m", max_tokens=4) == [[3, 3, 3], [4]]
    with pytest.raises(SpecbatchError, match="whose tokenizer is not 'other'"):
        read_outputs(str(tmp_path), tokenizer, "other", max_tokens=100)


def test_a_missing_seed_is_an_error_unless_it_is_the_jobs_own_first_output(tmp_path):
    with pytest.raises(SpecbatchError, match="no such directory"):
        read_outputs(str(tmp_path / "nope"), None, "m", 100)
    assert read_outputs(str(tmp_path / "nope"), None, "m", 100, missing_ok=True) == []
