"""warm_up.freeze_heap: what a decode actor calls once warm, so that its loop's full collections do not scan the
objects of its imports and its model."""

import gc
import weakref

from specdec_core.warm_up import freeze_heap


class _Node:
    pass


def test_a_frozen_heap_leaves_the_full_collections_what_comes_after_and_still_frees_it():
    before = len(gc.get_objects())
    try:
        frozen = freeze_heap()
        assert frozen > before // 2  # the test process's imports: torch, numba, ...
        assert len(gc.get_objects()) < before // 10  # what a full collection still scans
        node = _Node()
        node.self = node  # a cycle made after the freeze: the collector still frees it
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()
    assert len(gc.get_objects()) >= frozen
