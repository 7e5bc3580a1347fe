"""Which tokens two tokenizers share: the map TLI and the union baseline draft through (heterogeneous-vocabulary
speculative decoding, Timor et al., §4).

Two tokens are the same when they stand for the same bytes: each token is turned into the bytes it decodes to, with
the tokenizer's own space marker undone (byte-level BPE's 'Ġ' and its whole byte alphabet, SentencePiece's '▁',
byte-fallback tokens '<0x0A>'), so a 'Ġthe' of one and a '▁the' of the other match. Comparing raw token strings, as
Hugging Face's universal assisted generation does after swapping the leading marker, misses tokens whose other bytes
are spelled differently (a byte-level 'Ċ' is '\\n'). Special tokens never match by bytes: they map by role (BOS to
BOS, EOS to EOS, ...) or by identical text.

The map is built once per pair and cached under $SPECBATCH_CACHE/vocab_maps/ by both tokenizers' fingerprints.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..defaults import cache_root
from ..prompts import tokenizer_fingerprint

BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
SPECIAL_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Bumped whenever build_mapping changes what it maps, so that a map cached by an older version is not reused.
# v2: several draft tokens with the same bytes all map (v1 mapped Gemma 3's byte-fallback '<0x2E>' instead of its '.').
MAPPING_VERSION = "v2"


@functools.lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _decoder_steps(tokenizer) -> list[dict]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]


def special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


def token_bytes(tokenizer) -> list[bytes | None]:
    """[vocab] the bytes each token stands for (None: a special token, or an id the tokenizer does not use)."""
    vocab = tokenizer.get_vocab()
    size = max(vocab.values()) + 1
    out: list[bytes | None] = [None] * size
    specials = special_ids(tokenizer)
    steps = _decoder_steps(tokenizer)
    byte_level = any(step.get("type") == "ByteLevel" for step in steps)
    replacements = [(step["pattern"].get("String"), step["content"]) for step in steps
                    if step.get("type") == "Replace" and step.get("pattern", {}).get("String") is not None]
    byte_fallback = any(step.get("type") == "ByteFallback" for step in steps)
    alphabet = byte_level_alphabet()
    for token, token_id in vocab.items():
        if token_id in specials:
            continue
        if byte_level:
            if all(ch in alphabet for ch in token):
                out[token_id] = bytes(alphabet[ch] for ch in token)
            continue
        match = BYTE_FALLBACK.match(token) if byte_fallback else None
        if match:
            out[token_id] = bytes([int(match.group(1), 16)])
            continue
        text = token
        for pattern, content in replacements:
            text = text.replace(pattern, content)
        if not steps:  # no backend description (a slow tokenizer): its own single-token decoding
            text = tokenizer.convert_tokens_to_string([token])
        out[token_id] = text.encode("utf-8")
    return out


@dataclass
class VocabMapping:
    """Token ids of a draft tokenizer (D) and a target tokenizer (T) that stand for the same thing."""

    draft_to_target: np.ndarray  # int64 [|D|]: the target id of each draft token, -1 outside the intersection
    target_to_draft: np.ndarray  # int64 [|T|]: the draft id of each target token, -1 outside the intersection
    # Tables built from this map for the pair's draft model (SLRS's first tokens, TLI's head), kept with it so that
    # every decoder of an engine reuses them: a decoder is built per batch of rows (jobs) or per prompt (the CLI).
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def shared(self) -> int:
        """|T ∩ D|: the target tokens some draft token stands for (several draft tokens may stand for one)."""
        return int((self.target_to_draft >= 0).sum())

    def overlap(self) -> dict:
        """The paper's Table 9: |T ∩ D| and its share of each vocabulary."""
        return {"shared": self.shared, "target_vocab": len(self.target_to_draft),
                "draft_vocab": len(self.draft_to_target),
                "shared_of_target": self.shared / max(1, len(self.target_to_draft)),
                "shared_of_draft": self.shared / max(1, len(self.draft_to_target))}

    def shared_draft_ids(self) -> np.ndarray:
        return np.flatnonzero(self.draft_to_target >= 0)

    @functools.cached_property
    def shared_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft ids [S], their target ids [S]) of the shared tokens, as tensors for indexing distributions
        (built once: drafters index with them at every draft position)."""
        draft_ids = self.shared_draft_ids()
        return torch.as_tensor(draft_ids), torch.as_tensor(self.draft_to_target[draft_ids])


def build_mapping(draft_tokenizer, target_tokenizer, draft_vocab: int | None = None,
                  target_vocab: int | None = None) -> VocabMapping:
    """`*_vocab`: the models' embedding sizes when they exceed the tokenizers' (padding ids map to nothing)."""
    draft_bytes, target_bytes = token_bytes(draft_tokenizer), token_bytes(target_tokenizer)
    draft_size = max(len(draft_bytes), draft_vocab or 0)
    target_size = max(len(target_bytes), target_vocab or 0)
    # Where one tokenizer has several tokens for the same bytes (Gemma 3 has '.' and its byte-fallback '<0x2E>'),
    # the ordinary token, the one its tokenizer emits, is the one the other side's token maps to.
    by_bytes = {}
    for target_id in _ordinary_first(target_tokenizer, len(target_bytes)):
        data = target_bytes[target_id]
        if data is not None and data not in by_bytes:
            by_bytes[data] = target_id
    draft_to_target = np.full(draft_size, -1, dtype=np.int64)
    target_to_draft = np.full(target_size, -1, dtype=np.int64)

    def link(draft_id: int, target_id: int) -> None:
        if draft_to_target[draft_id] < 0 and target_to_draft[target_id] < 0:
            draft_to_target[draft_id], target_to_draft[target_id] = target_id, draft_id

    for role in SPECIAL_ROLES:  # BOS to BOS, EOS to EOS, ... whatever each calls them
        draft_id, target_id = getattr(draft_tokenizer, f"{role}_id", None), getattr(target_tokenizer, f"{role}_id", None)
        if draft_id is not None and target_id is not None:
            link(int(draft_id), int(target_id))
    target_specials = {target_tokenizer.convert_ids_to_tokens(i): i for i in special_ids(target_tokenizer)}
    for draft_id in special_ids(draft_tokenizer):
        target_id = target_specials.get(draft_tokenizer.convert_ids_to_tokens(draft_id))
        if target_id is not None:
            link(draft_id, target_id)
    # Text tokens: every draft token maps to the target token with its bytes (several draft tokens may map to one:
    # the distributions of drafters/cross_vocab.py add their mass up); the target token maps back to the first of
    # them in _ordinary_first's order.
    for draft_id in _ordinary_first(draft_tokenizer, len(draft_bytes)):
        data = draft_bytes[draft_id]
        target_id = by_bytes.get(data) if data is not None else None
        if target_id is None or draft_to_target[draft_id] >= 0:
            continue
        draft_to_target[draft_id] = target_id
        if target_to_draft[target_id] < 0:
            target_to_draft[target_id] = draft_id
    return VocabMapping(draft_to_target, target_to_draft)


def _ordinary_first(tokenizer, size: int) -> list[int]:
    """Ids 0..size-1, byte-fallback tokens ('<0x2E>') after all the others."""
    fallback = {token_id for token, token_id in tokenizer.get_vocab().items()
                if token_id < size and BYTE_FALLBACK.match(token)}
    return [i for i in range(size) if i not in fallback] + sorted(fallback)


def load_or_build_mapping(draft_tokenizer, target_tokenizer, draft_vocab: int | None = None,
                          target_vocab: int | None = None, cache_dir: Path | None = None) -> VocabMapping:
    """The pair's mapping from the cache, else built and saved (atomically: a reader never sees half a file)."""
    directory = Path(cache_dir) if cache_dir is not None else cache_root() / "vocab_maps"
    name = (f"{MAPPING_VERSION}-{tokenizer_fingerprint(draft_tokenizer)}-{draft_vocab or 0}--"
            f"{tokenizer_fingerprint(target_tokenizer)}-{target_vocab or 0}.npz")
    path = directory / name
    if path.exists():
        with np.load(path) as saved:
            return VocabMapping(saved["draft_to_target"], saved["target_to_draft"])
    mapping = build_mapping(draft_tokenizer, target_tokenizer, draft_vocab, target_vocab)
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{name}.{os.getpid()}.partial.npz"
    np.savez(partial, draft_to_target=mapping.draft_to_target, target_to_draft=mapping.target_to_draft)
    os.replace(partial, path)
    return mapping


def build_first_tokens(draft_tokenizer, target_tokenizer, mapping: VocabMapping) -> np.ndarray:
    """int64 [|D|]: the first target token of each draft token's text tokenized alone with the target's tokenizer
    (SLRS with a one-token lookahead proposes it), -1 where there is none: a byte-fallback or partial-UTF-8 token
    that is no text on its own, an unused id. Special tokens go where the vocabulary map sends them."""
    first = np.full(len(mapping.draft_to_target), -1, dtype=np.int64)
    ids, texts = [], []
    for draft_id, data in enumerate(token_bytes(draft_tokenizer)):
        if data is None:
            continue
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        ids.append(draft_id)
    encoded = target_tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for draft_id, target_ids in zip(ids, encoded):
        if target_ids:
            first[draft_id] = target_ids[0]
    for draft_id in special_ids(draft_tokenizer):
        if draft_id < len(first):
            first[draft_id] = mapping.draft_to_target[draft_id]
    return first


def load_or_build_first_tokens(draft_tokenizer, target_tokenizer, mapping: VocabMapping, draft_vocab: int | None = None,
                               target_vocab: int | None = None, cache_dir: Path | None = None) -> np.ndarray:
    """build_first_tokens, cached beside the pair's vocabulary map."""
    directory = Path(cache_dir) if cache_dir is not None else cache_root() / "vocab_maps"
    name = (f"first-{tokenizer_fingerprint(draft_tokenizer)}-{draft_vocab or 0}--"
            f"{tokenizer_fingerprint(target_tokenizer)}-{target_vocab or 0}.npy")
    path = directory / name
    if path.exists():
        return np.load(path)
    first = build_first_tokens(draft_tokenizer, target_tokenizer, mapping)
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f".{name}.{os.getpid()}.partial.npy"
    np.save(partial, first)
    os.replace(partial, path)
    return first
