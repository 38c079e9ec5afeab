"""gctune.settle(): the startup heap frozen, the thresholds left alone; the collector still
collects what is built after it."""

from __future__ import annotations

import gc
import weakref

import pytest

from sandgate import gctune

pytestmark = pytest.mark.unit


def test_settle_freezes_the_heap_and_still_collects_new_cycles() -> None:
    saved = gc.get_threshold()
    try:
        gctune.settle()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == saved  # a larger young generation grew the RSS: not kept

        class Node:
            other: Node

        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after settle(): garbage once dropped
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)
