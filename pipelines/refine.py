"""The corpus refinement pipeline (SPECTRA §3.2): read -> score perplexity under the target (actor pool) -> Parquet
parts; then, on the driver, keep the lowest-perplexity texts of the whole corpus and build the retrieval index.

    OUTPUT/
      refine.json             what the scores depend on (model, tokenizer, dtype, windows, source): --resume checks it
      scores/part-*.parquet   one file per finished scoring call (key, id, source, token_count, scored_tokens,
                              nll_sum, ppl, tokens, error); a killed job loses only the calls in flight
      corpus.parquet          the scored corpus: key, id, source, token_count, ppl, kept, error
      index/                  the retrieval index of the kept texts (specdec_core/drafters/retrieval_index.py) + manifest
      _SUCCESS                written last

A resumed job scores only texts without a score; the selection and the index are always rebuilt from all scores, so
`--resume` with another --keep re-selects without scoring anything.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field, model_validator

from operators.read_corpus import read_corpus
from operators.score_perplexity import SCORES_SCHEMA, ScorePerplexity
from specdec_core.drafters.retrieval_index import write_index
from specdec_core.errors import SpecbatchError
from specdec_core.model.model_registry import DEFAULT_MODEL

from .generate import allow_ray_remote_args
from .outputs import RunLock
from .parquet_sink import TEMPORARY_PREFIX, KeyedPartSink, write_atomically

LIGHT_TASK_CPUS = 0.25
SETTINGS_FILE, SCORES_DIR, CORPUS_FILE, INDEX_DIR, SUCCESS_MARKER = (
    "refine.json", "scores", "corpus.parquet", "index", "_SUCCESS")


class RefineConfig(BaseModel):
    input: str = Field(description="JSONL, Parquet file/dir, directory of text files, hf:DIR or corpus:NAME")
    output: str
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    device: str = "auto"
    text_field: str = "text"
    id_field: str = "id"
    glob: str = "*.txt"
    keep: int | None = Field(None, ge=1, description="keep this many texts (the lowest perplexities)")
    keep_fraction: float | None = Field(None, gt=0, le=1, description="keep this share of the scored texts")
    keep_tokens: int | None = Field(None, ge=1, description="keep texts, in selection order, while their tokens add "
                                                           "up to at most this (an index of a given size)")
    selection: Literal["lowest_ppl", "random"] = "lowest_ppl"
    seed: int = 0
    window: int = Field(1024, ge=2)
    overlap: int = Field(128, ge=0)
    tokens_per_forward: int = Field(1024, ge=1)
    max_text_tokens: int = Field(1 << 20, ge=2)
    # Texts per scoring call. Each call packs its texts by length into forwards, so a larger call pads less; a crash
    # loses at most the calls in flight (decisions.md: pipelines/refine.py).
    rows_per_call: int = Field(1024, ge=1)
    num_actors: int = Field(1, ge=1)
    cpus_per_actor: float | None = Field(None, gt=0)
    num_gpus_per_actor: float = Field(0.0, ge=0)
    limit: int | None = Field(None, ge=1)
    resume: bool = False

    @model_validator(mode="after")
    def _check(self) -> "RefineConfig":
        given = [name for name in ("keep", "keep_fraction", "keep_tokens") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of --keep, --keep-fraction, --keep-tokens, not {' and '.join(given)}")
        if not given:
            self.keep_fraction = 0.5
        if self.overlap > self.window - 2:
            raise ValueError(f"--overlap {self.overlap} must be at most --window - 2 ({self.window - 2})")
        return self

    def resolved_device_and_dtype(self) -> tuple[str, str]:
        """What "auto" becomes in the actors: scores under another dtype are other scores (see GenerationConfig)."""
        from specdec_core.model.hardware import cpu_supports_bf16  # lazy: torch, only when the dtype is 'auto'

        device = self.device if self.device != "auto" else ("cuda" if self.num_gpus_per_actor > 0 else "cpu")
        if self.dtype != "auto" or device.startswith("cuda"):
            return device, self.dtype
        return device, "bfloat16" if cpu_supports_bf16() else "float32"

    def score_settings(self, tokenizer_hash: str) -> dict:
        """Everything a text's score depends on: a resumed job must match it."""
        return {"input": self.input, "model": self.model, "tokenizer": tokenizer_hash,
                "dtype": self.resolved_device_and_dtype()[1], "window": self.window, "overlap": self.overlap,
                "text_field": self.text_field, "id_field": self.id_field, "glob": self.glob}

    def actor_cpus(self, cluster_cpus: float) -> float:
        if self.cpus_per_actor is not None:
            return self.cpus_per_actor
        if self.num_gpus_per_actor > 0:
            return 1.0
        return max(0.25, (cluster_cpus - 0.5) / self.num_actors)  # reads and writes keep a quarter CPU each


def check_output(config: RefineConfig, settings: dict) -> None:
    """Before Ray starts: refuse to mix two corpora's or two models' scores in one output directory."""
    out = Path(config.output)
    saved = out / SETTINGS_FILE
    if not saved.exists():
        if out.exists() and any(p.name not in ("_locks", "logs") for p in out.iterdir()):
            raise SpecbatchError(f"{out} exists and is not a refinement output: choose an empty or new directory")
        return
    if not config.resume:
        raise SpecbatchError(f"{out} already holds a refinement: pass --resume to continue it (or re-select), or "
                             "choose another --output")
    before = json.loads(saved.read_text())
    changed = [k for k in settings if before.get(k) != settings[k]]
    if changed:
        differences = ", ".join(f"{k}: {before.get(k)!r}" for k in changed)
        raise SpecbatchError(f"--resume: {out} was scored with other settings ({differences}); "
                             "use the same ones or another --output")


def read_scores(output: str | Path, columns: list[str] | None = None) -> pa.Table:
    """All scored rows, one per key (a text scored twice keeps its successful score)."""
    files = sorted((Path(output) / SCORES_DIR).glob("part-*.parquet"))
    names = columns or [n for n in SCORES_SCHEMA.names if n != "tokens"]
    if not files:
        return SCORES_SCHEMA.empty_table().select(names)
    table = pa.concat_tables(pq.read_table(f, columns=names) for f in files)
    frame = table.to_pandas()
    frame = frame.assign(_failed=frame["error"].notna()).sort_values(["key", "_failed"], kind="stable")
    frame = frame.drop_duplicates("key").drop(columns="_failed")
    return pa.Table.from_pandas(frame, preserve_index=False)


def done_keys(output: str | Path) -> frozenset[str]:
    """Texts already scored successfully (error rows are retried on --resume: they fail again fast)."""
    table = read_scores(output, ["key", "error"])
    return frozenset(k for k, e in zip(table.column("key").to_pylist(), table.column("error").to_pylist()) if e is None)


def select_kept(ppl: np.ndarray, keys: list[str], keep: int | None, keep_fraction: float | None,
                selection: str = "lowest_ppl", seed: int = 0, keep_tokens: int | None = None,
                token_counts: np.ndarray | None = None) -> np.ndarray:
    """-> bool [n]: which scored texts to keep. `ppl` is NaN for error rows, which are never kept. lowest_ppl keeps
    exactly min(keep, scored) texts with the lowest perplexity (ties by key, so the choice is reproducible);
    random keeps as many, drawn uniformly (the paper's unrefined baseline). With keep_tokens, the texts are taken
    in that order (lowest perplexity first, or a random order) while their `token_counts` add up to at most
    keep_tokens: a refined and a random index of the same size in tokens, which is what an index costs."""
    valid = np.flatnonzero(~np.isnan(ppl))
    kept = np.zeros(len(ppl), dtype=bool)
    rng = np.random.default_rng(seed)
    if keep_tokens is None and selection == "random":  # drawn as before --keep-tokens existed: same seed, same texts
        count = keep if keep is not None else int(round(keep_fraction * len(valid)))
        kept[rng.choice(valid, size=min(max(count, 0), len(valid)), replace=False)] = True
        return kept
    order = rng.permutation(valid) if selection == "random" else \
        np.array(sorted(valid, key=lambda i: (ppl[i], keys[i])), dtype=np.int64)
    if keep_tokens is not None:
        count = int(np.searchsorted(np.cumsum(token_counts[order]), keep_tokens, side="right"))
    else:
        count = keep if keep is not None else int(round(keep_fraction * len(valid)))
    kept[order[:max(count, 0)]] = True
    return kept


def finish(config: RefineConfig, settings: dict) -> dict:
    """Select over all scores, write corpus.parquet and the index. -> the index manifest."""
    out = Path(config.output)
    scores = read_scores(out)
    keys = scores.column("key").to_pylist()
    ppl = np.array([np.nan if p is None else p for p in scores.column("ppl").to_pylist()], dtype=np.float64)
    token_counts = np.array([c or 0 for c in scores.column("token_count").to_pylist()], dtype=np.float64)
    kept = select_kept(ppl, keys, config.keep, config.keep_fraction, config.selection, config.seed,
                       config.keep_tokens, token_counts)
    corpus = scores.select(["key", "id", "source", "token_count", "ppl", "error"]).append_column(
        "kept", pa.array(kept))
    write_atomically(corpus, out / CORPUS_FILE)
    kept_keys = [keys[i] for i in np.flatnonzero(kept)[np.argsort(ppl[kept], kind="stable")]]  # lowest ppl first
    with_tokens = read_scores(out, ["key", "tokens", "error"]) if kept_keys else None
    tokens_of = dict(zip(with_tokens.column("key").to_pylist(), with_tokens.column("tokens").to_pylist())) \
        if kept_keys else {}
    valid = ~np.isnan(ppl)
    manifest = write_index(out / INDEX_DIR, (tokens_of[k] for k in kept_keys), {
        "model": config.model, "tokenizer": settings["tokenizer"], "dtype": settings["dtype"],
        "source": config.input, "refined": config.selection == "lowest_ppl", "selection": config.selection,
        "seed": config.seed if config.selection == "random" else None, "keep": config.keep,
        "keep_fraction": config.keep_fraction, "keep_tokens": config.keep_tokens, "scored": int(valid.sum()),
        "errors": int((~valid).sum()),
        "window": config.window, "overlap": config.overlap,
        "max_kept_ppl": float(ppl[kept].max()) if kept.any() else None,
        "median_scored_ppl": float(np.median(ppl[valid])) if valid.any() else None})
    (out / SUCCESS_MARKER).write_text("")
    return manifest


def run_refinement(config: RefineConfig, settings: dict) -> dict:
    """Score what is not scored yet, then select and index. -> a summary (texts, tokens, timings, manifest)."""
    import ray
    import ray.data



    out = Path(config.output)
    started = time.perf_counter()
    with RunLock(out, "refine"):
        check_output(config, settings)
        scores_dir = out / SCORES_DIR
        scores_dir.mkdir(parents=True, exist_ok=True)
        for stale in scores_dir.glob(f"{TEMPORARY_PREFIX}*.tmp"):  # half-written by a killed job
            stale.unlink(missing_ok=True)
        (out / SUCCESS_MARKER).unlink(missing_ok=True)
        (out / SETTINGS_FILE).write_text(json.dumps(settings, indent=1))
        done = done_keys(out) if config.resume else frozenset()
        before = read_scores(out, ["key", "scored_tokens", "error"]).num_rows
        cpus = config.actor_cpus(float(ray.cluster_resources().get("CPU", 1)))
        texts = read_corpus(config.input, config.text_field, config.id_field, config.glob, config.limit, done,
                            LIGHT_TASK_CPUS)
        allow_ray_remote_args()
        scored = texts.map_batches(
            ScorePerplexity, batch_format="pandas", batch_size=config.rows_per_call,
            fn_constructor_kwargs={"model": config.model, "dtype": config.dtype, "device": config.device,
                                   "window": config.window, "overlap": config.overlap,
                                   "tokens_per_forward": config.tokens_per_forward,
                                   "max_text_tokens": config.max_text_tokens,
                                   "torch_threads": max(1, round(cpus))},
            compute=ray.data.ActorPoolStrategy(size=config.num_actors),
            num_cpus=cpus, num_gpus=config.num_gpus_per_actor or None,
            # A lost actor is restarted and its call redone (its rows are written only when the call finishes);
            # a call that crashes its actor again and again fails the job rather than looping.
            max_restarts=-1, max_task_retries=3)
        with ScoreProgress(scores_dir):
            scored.write_datasink(KeyedPartSink(str(scores_dir)), ray_remote_args={"num_cpus": LIGHT_TASK_CPUS})
        scoring_s = time.perf_counter() - started
        totals = read_scores(out, ["key", "scored_tokens", "token_count", "error"])
        manifest = finish(config, settings)
    return {"texts": totals.num_rows, "scored_this_run": totals.num_rows - before,
            "errors": totals.num_rows - totals.column("error").null_count,
            "tokens": int(np.nansum(np.array(totals.column("token_count").to_pylist(), dtype=np.float64))),
            "kept": manifest["texts"], "kept_tokens": manifest["tokens"], "max_kept_ppl": manifest["max_kept_ppl"],
            "scoring_s": scoring_s, "wall_s": time.perf_counter() - started, "index": str(out / INDEX_DIR)}


class ScoreProgress:
    """A progress line for the scoring: texts and tokens scored so far, read from the parts as they appear."""

    def __init__(self, directory: Path, interval_s: float | None = None):
        import sys

        self.directory = directory
        self.interval_s = interval_s or (2.0 if sys.stderr.isatty() else 30.0)
        self.seen: set[Path] = set()
        self.texts = self.tokens = self.errors = 0

    def poll(self) -> None:
        for path in sorted(self.directory.glob("part-*.parquet")):
            if path in self.seen:
                continue
            try:
                table = pq.read_table(path, columns=["scored_tokens", "error"])
            except Exception:  # being replaced: the next poll reads it
                continue
            self.seen.add(path)
            self.texts += table.num_rows
            self.errors += table.num_rows - table.column("error").null_count
            self.tokens += int(np.nansum(np.array(table.column("scored_tokens").to_pylist(), dtype=np.float64)))

    def __enter__(self) -> "ScoreProgress":
        import sys
        import threading

        from tqdm import tqdm

        self.poll()
        self._base, self._started = self.tokens, time.perf_counter()
        self._bar = tqdm(total=None, unit="text", desc="texts scored", file=sys.stderr, mininterval=0)
        self._stop = threading.Event()

        def run():
            while not self._stop.wait(self.interval_s):
                self.poll()
                self._draw()

        self._thread = threading.Thread(target=run, name="specbatch-refine-progress", daemon=True)
        self._thread.start()
        return self

    def _draw(self, refresh: bool = True) -> None:
        rate = (self.tokens - self._base) / max(time.perf_counter() - self._started, 1e-9)
        self._bar.n = self.texts
        self._bar.set_postfix_str(f"{rate:.0f} tok/s, {self.errors} error rows", refresh=refresh)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()
        self._draw(refresh=False)
        self._bar.close()
