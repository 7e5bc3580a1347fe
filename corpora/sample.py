"""The small bundled sample (samples/requests.jsonl) that drives the README's main command."""

from __future__ import annotations

import json
from pathlib import Path

SAMPLE_PATH = Path(__file__).resolve().parents[1] / "samples" / "requests.jsonl"


def sample_rows() -> list[dict]:
    return [json.loads(line) for line in SAMPLE_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
