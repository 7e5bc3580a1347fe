"""Scoring stage of the corpus refinement job: text rows -> scored rows (token ids, token count, NLL, perplexity).

A Ray Data callable class on an actor pool; each actor loads the target once. A text that cannot be scored (too
short, too long, a tokenizer failure) is that row's error; the rest of the call is scored as usual.
"""

from __future__ import annotations

import pyarrow as pa

SCORES_SCHEMA = pa.schema([
    ("key", pa.string()), ("id", pa.string()), ("source", pa.string()),
    ("token_count", pa.int64()), ("scored_tokens", pa.int64()), ("nll_sum", pa.float64()), ("ppl", pa.float64()),
    ("tokens", pa.list_(pa.int32())), ("error", pa.string()),
])


class ScorePerplexity:
    """text rows (pandas) -> SCORES_SCHEMA rows (Arrow)."""

    def __init__(self, model: str, dtype: str = "auto", device: str = "auto", window: int = 1024,
                 overlap: int = 128, tokens_per_forward: int = 1024, max_text_tokens: int = 1 << 20,
                 torch_threads: int = 1):
        import torch

        from specdec_core.model.model_runner import ModelRunner  # lazy: torch, in the actor only

        from .perplexity import PerplexityScorer  # lazy: torch, in the actor only

        torch.set_num_threads(torch_threads)
        self.runner = ModelRunner.load(model, dtype=dtype, device=device)
        self.scorer = PerplexityScorer(self.runner, window, overlap, tokens_per_forward)
        self.max_text_tokens = max_text_tokens

    def tokenize(self, rows: list[dict]) -> list[list[int] | None]:
        """Token ids of every row without an error; a row that fails gets its error here."""
        tokenizer = self.runner.tokenizer
        todo = [i for i, r in enumerate(rows) if not r.get("error")]
        ids: list[list[int] | None] = [None] * len(rows)
        try:
            encoded = tokenizer([rows[i]["text"] for i in todo], add_special_tokens=False)["input_ids"]
        except Exception:  # one bad text fails the batched call: find it by encoding one by one
            encoded = []
            for i in todo:
                try:
                    encoded.append(tokenizer(rows[i]["text"], add_special_tokens=False)["input_ids"])
                except Exception as exc:
                    encoded.append(None)
                    rows[i]["error"] = f"cannot be tokenized: {type(exc).__name__}: {exc}"[:300]
        for i, token_ids in zip(todo, encoded):
            if token_ids is None:
                continue
            if len(token_ids) < 2:
                rows[i]["error"] = f"{len(token_ids)} token(s): too short to have a perplexity"
            elif len(token_ids) > self.max_text_tokens:
                rows[i]["error"] = f"{len(token_ids)} tokens, over --max-text-tokens {self.max_text_tokens}"
            else:
                ids[i] = token_ids
        return ids

    def __call__(self, batch) -> pa.Table:
        rows = batch.to_dict("records")
        for row in rows:  # pandas gives NaN for a missing value
            for name in ("text", "error"):
                if not isinstance(row.get(name), str):
                    row[name] = None
        ids = self.tokenize(rows)
        scoreable = [i for i, token_ids in enumerate(ids) if token_ids is not None]
        scores = dict(zip(scoreable, self.scorer.score([ids[i] for i in scoreable])))
        out = []
        for i, row in enumerate(rows):
            score = scores.get(i)
            out.append({"key": row["key"], "id": row["id"], "source": row["source"],
                        "token_count": None if ids[i] is None else len(ids[i]),
                        "scored_tokens": score.scored_tokens if score else None,
                        "nll_sum": score.nll_sum if score else None, "ppl": score.ppl if score else None,
                        "tokens": ids[i], "error": row["error"]})
        return pa.Table.from_pylist(out, schema=SCORES_SCHEMA)
