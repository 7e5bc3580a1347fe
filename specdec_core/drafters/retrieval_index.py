"""A retrieval corpus in the target's tokens, searchable by prefix (REST; SPECTRA-RETRIEVAL, §3.2).

The texts are joined with a separator (-1, no token id) into one int32 array, a suffix array orders its suffixes,
and both are saved as .npy files that every decode actor memory-maps (the page cache holds one copy per machine).
`manifest.json` says what the index was built from and for which tokenizer; loading checks it, so an index built
for another tokenizer is refused with one clear line instead of drafting wrong ids.

    directory/
      tokens.npy        int32 [n]   texts in token ids, -1 between texts
      suffixes.npy      int64 [n]   suffix array over tokens.npy (drafters/suffix_array.py)
      manifest.json     format, model, tokenizer fingerprint, texts, tokens, source, created_at, ...
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from ..errors import BadRequestError
from ..prompts import tokenizer_fingerprint
from .suffix_array import SuffixArray, build_suffix_array

FORMAT = 1
SEPARATOR = -1  # between texts: no match or continuation crosses it
TOKENS_FILE, SUFFIXES_FILE, MANIFEST_FILE = "tokens.npy", "suffixes.npy", "manifest.json"


def join_texts(texts: Iterable[Sequence[int]]) -> np.ndarray:
    """Token lists -> one int32 array with SEPARATOR after each text."""
    pieces = []
    for ids in texts:
        pieces.append(np.asarray(ids, dtype=np.int32))
        pieces.append(np.array([SEPARATOR], dtype=np.int32))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def write_index(directory: str | Path, texts: Iterable[Sequence[int]], manifest: dict) -> dict:
    """Build and save an index; files are written under temporary names and renamed, so a reader never sees a half
    index. -> the manifest written (with sizes and created_at filled in)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokens = join_texts(texts)
    suffixes = build_suffix_array(tokens.astype(np.int64))
    (directory / MANIFEST_FILE).unlink(missing_ok=True)  # a rebuild: readers refuse the index until it is whole
    manifest = {**manifest, "format": FORMAT, "texts": int((tokens == SEPARATOR).sum()),
                "tokens": int((tokens != SEPARATOR).sum()), "created_at": datetime.now(timezone.utc).isoformat()}
    for name, array in ((TOKENS_FILE, tokens), (SUFFIXES_FILE, suffixes)):
        partial = directory / f".{name}.partial"
        with open(partial, "wb") as handle:
            np.save(handle, array)
        os.replace(partial, directory / name)
    partial = directory / f".{MANIFEST_FILE}.partial"
    partial.write_text(json.dumps(manifest, indent=1))
    os.replace(partial, directory / MANIFEST_FILE)  # last: its presence means the index is complete
    return manifest


class RetrievalIndex(SuffixArray):
    """A saved index, memory-mapped; a SuffixArray whose continuations stop at the end of their text."""

    def __init__(self, tokens: np.ndarray, order: np.ndarray, manifest: dict):
        self.tokens, self.order, self.manifest = tokens, order, manifest

    # Among the suffixes that start with a match, those followed by the end of the array or by SEPARATOR sort first
    # (shorter suffixes first, -1 below every token): the ones with a continuation are a tail of [lo, hi), found by
    # binary search instead of reading every occurrence (a common 2-gram occurs ~1e5 times in a large corpus).

    def _followed(self, index: int, length: int) -> bool:
        after = int(self.order[index]) + length
        return after < len(self.tokens) and int(self.tokens[after]) != SEPARATOR

    def _first_followed(self, lo: int, hi: int, length: int) -> int:
        while lo < hi:
            mid = (lo + hi) // 2
            if self._followed(mid, length):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _has_continuation(self, lo: int, hi: int, length: int) -> bool:
        return hi > lo and self._followed(hi - 1, length)

    def continuations(self, lo: int, hi: int, length: int, depth: int, limit: int) -> list[list[int]]:
        lo = self._first_followed(lo, hi, length)
        cut = []
        for branch in super().continuations(lo, hi, length, depth, limit):
            end = branch.index(SEPARATOR) if SEPARATOR in branch else len(branch)
            cut.append(branch[:end])  # non-empty: every occurrence from lo on is followed by a token
        return cut


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST_FILE
    if not path.exists():
        raise BadRequestError(f"retrieval index {directory}: no {MANIFEST_FILE} (not an index, or its build did not "
                              "finish)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise BadRequestError(f"retrieval index {directory}: format {manifest.get('format')}, this version reads "
                              f"{FORMAT}: rebuild it")
    return manifest


def check_index_tokenizer(directory: str | Path, tokenizer, model_name: str) -> None:
    """One clear error when the index's token ids are not the target's."""
    manifest = read_manifest(directory)
    if manifest.get("tokenizer") != tokenizer_fingerprint(tokenizer):
        raise BadRequestError(f"retrieval index {directory} was built for the tokenizer of "
                              f"{manifest.get('model')!r}, not {model_name!r}'s: rebuild it for this model")


def load_index(directory: str) -> RetrievalIndex:
    """Memory-mapped, once per process and build (every request of an actor shares it; a rebuilt index, with a
    new manifest, is loaded afresh)."""
    manifest_path = Path(directory) / MANIFEST_FILE
    stamp = manifest_path.stat().st_mtime_ns if manifest_path.exists() else None
    return _load_index(str(Path(directory).resolve()), stamp)


@functools.lru_cache(maxsize=4)
def _load_index(directory: str, stamp: int | None) -> RetrievalIndex:
    manifest = read_manifest(directory)
    tokens = np.load(Path(directory) / TOKENS_FILE, mmap_mode="r")
    order = np.load(Path(directory) / SUFFIXES_FILE, mmap_mode="r")
    return RetrievalIndex(tokens, order, manifest)
