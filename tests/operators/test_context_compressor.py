"""The self-information compressor (CASD's prompt compression, standing in for LLMLingua-2): windowed scoring equals
the model's own log-probabilities, the most informative words are kept in order, the requested ratio is reached
(± 10 %) on real passages with the default model, and a question row's prompt keeps its question whole."""

import numpy as np
import pytest
import torch

from operators.compress_context import CompressContext
from operators.context_compressor import WORD, SelfInformationCompressor
from operators.task_prompts import compose_prompt
from tests.tiny_models import tiny_llama


def reference_information(model, ids, begin, position):
    """-log p(ids[position] | ids[begin:position]) from one plain forward."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids[begin:position]])).logits[0, -1]
    return float(-torch.log_softmax(logits, -1)[ids[position]])


def test_windowed_scoring_conditions_each_token_on_the_half_window_before_its_chunk():
    model = tiny_llama().model
    ids = [int(i) for i in torch.randint(1, 90, (37,), generator=torch.Generator().manual_seed(0))]
    whole = SelfInformationCompressor(model, tokenizer=None, window=128).token_information(ids)
    for position in (1, 5, 36):
        assert whole[position] == pytest.approx(reference_information(model, ids, 0, position), abs=1e-4)
    windowed = SelfInformationCompressor(model, tokenizer=None, window=8).token_information(ids)  # step 4
    for position in (1, 3, 4, 7, 8, 21, 36):
        chunk_start = position // 4 * 4
        assert windowed[position] == pytest.approx(
            reference_information(model, ids, max(0, chunk_start - 4), position), abs=1e-4)
    assert whole[0] == whole.max() and windowed[0] == windowed.max()  # nothing predicts the first token: kept


@pytest.fixture(scope="module")
def default_model(engine):
    return engine.target  # the real default model in fp32 (tests/conftest.py)


@pytest.fixture(scope="module")
def default_tokenizer():
    """The default model's tokenizer alone (no weights)."""
    from transformers import AutoTokenizer

    from specdec_core.model.model_registry import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))


class FixedInformation(SelfInformationCompressor):
    """Scores set by hand per word (spread over its tokens), to test the selection alone."""

    def __init__(self, tokenizer, word_scores):
        super().__init__(model=None, tokenizer=tokenizer)
        self.word_scores = word_scores

    def token_information(self, ids):
        text = self.text
        offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        starts = [m.start() for m in WORD.finditer(text)]
        owner = np.searchsorted(starts, [s for s, _ in offsets], side="right") - 1
        return np.array([self.word_scores[w] for w in owner], dtype=float)


def test_the_most_informative_words_are_kept_in_their_order(default_tokenizer):
    text = "one two three four five six seven eight"
    scores = [1.0, 9.0, 2.0, 8.0, 3.0, 7.0, 0.5, 6.0]  # per word: two, four, six, eight are the best half
    compressor = FixedInformation(default_tokenizer, scores)
    compressor.text = text
    per_word = [len(default_tokenizer(m.group(), add_special_tokens=False)["input_ids"])
                for m in WORD.finditer(text)]
    assert per_word == [per_word[0]] * 8, "test needs words of equal token counts"  # then density = score
    assert compressor.compress(text, 2.0) == "two four six eight"


def test_paragraph_breaks_survive_dropped_words():
    keep = np.array([True, False, True])
    text = "first\n\nsecond third"
    words = [(m.start(), m.end()) for m in WORD.finditer(text)]
    assert SelfInformationCompressor.join(text, words, keep) == "first\n third"


class ScoredOnce(SelfInformationCompressor):
    """Scores a text's tokens once: the ratios below select from the same scores (scoring is tested above)."""

    def token_information(self, ids):
        self.scored = getattr(self, "scored", {})
        if tuple(ids) not in self.scored:
            self.scored[tuple(ids)] = super().token_information(ids)
        return self.scored[tuple(ids)]


@pytest.mark.slow
def test_real_passages_reach_the_requested_ratio(default_model):
    from corpora.aclsum import rag_rows

    passages = rag_rows(limit=1)[0]["context"][:6000]
    compressor = ScoredOnce(default_model.model, default_model.tokenizer)
    for ratio in (3.0, 5.0):
        result = compressor.compress_measured(passages, ratio)
        assert result.original_tokens > 1000
        assert abs(result.ratio - ratio) <= 0.1 * ratio, (ratio, result.ratio)
        original_words = passages.split()
        kept_words = result.text.split()
        iterator = iter(original_words)
        assert all(word in iterator for word in kept_words)  # a subsequence: order kept, nothing invented
    assert compressor.compress(passages, 1.0) == passages
    with pytest.raises(ValueError, match=">= 1"):
        compressor.compress(passages, 0.5)


@pytest.mark.slow
def test_the_stage_compresses_question_rows_only_and_the_prompt_keeps_the_question(default_model, monkeypatch):
    import pandas as pd

    from specdec_core.model.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "load", classmethod(lambda cls, *a, **k: default_model))
    stage = CompressContext("smollm2-135m", ratio=3.0, max_context_chars=2000)
    context = ("The Harbor Bridge opened in 1932 after eight years of construction. It carries eight lanes of "
               "traffic, two railway tracks and a footpath. ") * 12
    question = "When did the Harbor Bridge open, and what does it carry?"
    rows = pd.DataFrame([
        {"id": "q", "question": question, "context": context},
        {"id": "p", "prompt": "Summarize.", "context": context},  # a ready prompt: its context only feeds drafters
        {"id": "bad", "question": question, "context": context, "input_error": "already broken"},
    ])
    out = {r["id"]: r for r in stage(rows).to_pylist()}
    compressed = out["q"]["prompt_context"]
    assert out["p"]["prompt_context"] is None and out["bad"]["prompt_context"] is None
    assert out["q"]["context"] == context  # the copy drafters' source stays whole
    assert len(default_model.tokenizer(compressed)["input_ids"]) < 0.45 * len(
        default_model.tokenizer(context[:2000])["input_ids"])
    prompt = compose_prompt(out["q"], max_context_chars=2000)
    assert prompt.endswith(f"Question: {question}") and compressed in prompt
