"""The corpus index (saved, memory-mapped, checked against the tokenizer) and the drafters that read it: `rest`
and `spectra+retrieval` equal HF greedy on a tiny model, alone and beside other drafters in one batch."""

import json

import numpy as np
import pytest

from specdec_core.drafters.base import NoDrafter
from specdec_core.drafters.retrieval import RetrievalTreeDrafter
from specdec_core.drafters.retrieval_index import (
    SEPARATOR,
    check_index_tokenizer,
    load_index,
    tokenizer_fingerprint,
    write_index,
)
from specdec_core.drafters.spectra import SpectraDrafter
from specdec_core.errors import BadRequestError
from specdec_core.loop.batch_decode import BatchDecoder, DecodeRequest
from specdec_core.loop.requests import DecodeParams
from specdec_core.loop.speculation_budget import SpeculationBudget
from tests.tiny_models import DigitsTokenizer, hf_greedy, repetitive_prompt, tiny_llama


def build(tmp_path, texts, name="index"):
    directory = tmp_path / name
    write_index(directory, texts, {"model": "tiny-llama", "tokenizer": tokenizer_fingerprint(DigitsTokenizer())})
    return load_index(str(directory))


def test_index_round_trip_and_continuations_stop_at_the_end_of_their_text(tmp_path):
    index = build(tmp_path, [[5, 6, 7, 8], [1, 5, 6, 9, 9], [5, 6]])
    assert index.tokens.tolist() == [5, 6, 7, 8, SEPARATOR, 1, 5, 6, 9, 9, SEPARATOR, 5, 6, SEPARATOR]
    assert isinstance(index.tokens, np.memmap) and isinstance(index.order, np.memmap)
    assert index.manifest["texts"] == 3 and index.manifest["tokens"] == 11
    length, lo, hi = index.longest_suffix_match(np.array([3, 5, 6]), 1)
    assert length == 2
    assert sorted(index.continuations(lo, hi, length, depth=5, limit=10)) == [[7, 8], [9, 9]]  # the third: none
    assert index.longest_suffix_match(np.array([8]), 1) is None  # 8 ends its text: nothing follows it
    assert not list(tmp_path.glob("index/.*partial"))


def test_a_foreign_or_unfinished_index_is_refused_with_one_line(tmp_path):
    build(tmp_path, [[1, 2, 3]])

    class OtherTokenizer(DigitsTokenizer):
        def get_vocab(self):
            return {**super().get_vocab(), "extra": 999}

    check_index_tokenizer(tmp_path / "index", DigitsTokenizer(), "tiny-llama")
    with pytest.raises(BadRequestError, match="built for the tokenizer of 'tiny-llama', not 'other'"):
        check_index_tokenizer(tmp_path / "index", OtherTokenizer(), "other")
    with pytest.raises(BadRequestError, match="no manifest.json"):
        check_index_tokenizer(tmp_path / "nothing", DigitsTokenizer(), "tiny-llama")
    manifest = tmp_path / "index" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": 99}))
    with pytest.raises(BadRequestError, match="rebuild it"):
        check_index_tokenizer(tmp_path / "index", DigitsTokenizer(), "tiny-llama")


def test_rest_and_spectra_retrieval_equal_hf_greedy_in_a_mixed_batch(tmp_path):
    runner = tiny_llama()
    prompts = [repetitive_prompt(seed, n) for seed, n in enumerate([12, 30, 21, 17])]
    answers = [hf_greedy(runner, prompt, 30) for prompt in prompts]
    # The corpus holds the second half of each answer (so retrieval finds matches mid-answer), and noise.
    index = build(tmp_path, [a[15:] for a in answers] + [[3, 4, 5, 6, 7] * 5])
    decoder = BatchDecoder(runner, max_batch=3, budget=SpeculationBudget(enabled=False))
    make = [lambda: RetrievalTreeDrafter(index), lambda: SpectraDrafter(n=4, pool_rows=3, max_guesses=4,
                                                                           retriever=RetrievalTreeDrafter(index)),
            NoDrafter, lambda: RetrievalTreeDrafter(index, node_budget=4)]
    for key, (prompt, factory) in enumerate(zip(prompts, make)):
        decoder.submit(DecodeRequest(key, prompt, DecodeParams(max_new_tokens=30), factory()))
    results = {request.key: result for request, result in decoder.run()}
    for key, answer in enumerate(answers):
        assert results[key].token_ids == answer, key
    for key in (0, 1, 3):
        assert results[key].metrics.accepted_by_source.get("retrieval", 0) > 0, key
        assert results[key].metrics.copied_tokens == 0  # the corpus is not the request's own text


def test_build_index_command_reads_a_directory_skips_bad_texts_and_refuses_a_foreign_output(tmp_path, capsys):
    from specdec_core.cli import main

    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n")
    (corpus / "pkg" / "b.py").write_text("print('hello')\n")
    (corpus / "empty.py").write_text("   \n")
    (corpus / "latin1.py").write_bytes(b"caf\xe9 = 1\n")
    assert main(["build-index", "--input", str(corpus), "--output", str(tmp_path / "idx"), "--glob", "*.py"]) == 0
    assert "2 texts" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["texts"] == 2 and manifest["skipped"] == 2 and manifest["refined"] is False
    assert load_index(str(tmp_path / "idx")).manifest["model"] == "smollm2-135m"
    # Rebuilding into an index directory is fine; a directory holding anything else is never touched.
    assert main(["build-index", "--input", str(corpus), "--output", str(tmp_path / "idx"), "--glob", "*.py"]) == 0
    assert main(["build-index", "--input", str(corpus), "--output", str(corpus)]) == 2
    assert "is not an index" in capsys.readouterr().err
    assert main(["build-index", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
