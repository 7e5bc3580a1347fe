"""The fixed shapes a graph-ready step runs at (graph_step.py): a step of `rows` live rows, `width` tokens a row and
`keys` positions to attend runs in the smallest bucket that holds it, so a few captured graphs serve every step.

A bucket's extra rows are idle slots of the cache (its live rows are packed at the front, kv_cache.py), its extra
nodes are padding that sees only itself, and its extra keys are masked. Padding costs compute, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # beyond these, the cache's slot count is the last bucket
# decode (1), the chain widths the methods verify and the tree widths up to their largest trees
WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32)
# the widths a decoder times on a device that captures its steps, for its speculation budget (wider steps are priced
# by the fit through these, then by the steps themselves)
CALIBRATED_WIDTHS = (1, 2, 4, 8)
KEY_QUANTUM = 256  # keys attended grow in steps of this many positions (the cache grows in the same steps)


@dataclass(frozen=True)
class Bucket:
    rows: int  # B: cache slots the step computes, from slot 0 (rows past the live ones are idle)
    width: int  # T: nodes a row (1: a decode step; 1 + draft: a verify step)
    keys: int  # L: key positions each row attends over, masked past its own

    def __str__(self) -> str:
        return f"{self.rows}x{self.width}x{self.keys}"


def row_bucket(rows: int, most: int) -> int:
    """The row bucket that holds `rows` rows, at most `most` (a cache's slots, a batch size) but never below rows."""
    return max(rows, min(next((b for b in ROW_BUCKETS if b >= rows), most), most))


def bucket_for(rows: int, width: int, longest: int, slots: int, capacity: int) -> Bucket | None:
    """The smallest bucket for a step of `rows` rows, `width` nodes a row, the longest row holding `longest` cached
    positions, over a cache of `slots` x `capacity`; None where none fits (the eager forward serves the step).
    A bucket's padding nodes write keys past their row's own too: its keys cover the longest row + its width."""
    if rows < 1 or rows > slots or width < 1:
        return None
    bucket_rows = row_bucket(rows, slots)
    bucket_width = next((w for w in WIDTH_BUCKETS if w >= width), None)
    if bucket_width is None:
        return None
    needed = longest + bucket_width
    keys = min(-(-needed // KEY_QUANTUM) * KEY_QUANTUM, capacity)
    if keys < needed:
        return None
    return Bucket(bucket_rows, bucket_width, keys)
