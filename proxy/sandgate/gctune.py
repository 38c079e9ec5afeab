"""The cyclic garbage collector, set for a proxy: a large heap built once, then many short
connections whose objects (mitmproxy's layers, contexts and flows refer to each other) are
cyclic garbage when the connection ends.

Measured with `gc.callbacks` over 1,000 new passthrough tunnels (`bench/focus.py --phase
new_conn`): with CPython's defaults the collector took about 0.28 s, ~11% of the proxy's CPU,
most of it in two full collections that each walked the ~140,000 objects built at startup
(policy, addons, mitmproxy, libraries) and stopped the event loop for about 80 ms. After
`settle()` it took about 0.10 s, the full collections ~10 ms.

1. `gc.freeze()` once the proxy is built: those objects move to a permanent generation the
   collector no longer walks. What they refer to is untouched (reference counting still frees
   anything that stops being used); only a reference *cycle* among startup objects that
   becomes garbage later is never collected: bounded by the startup heap, once.
2. A young generation of 10,000 allocations instead of 700: a connection's objects mostly die
   by reference counting before a collection has to look at them.
"""

from __future__ import annotations

import gc

YOUNG = 10_000  # allocations between young-generation collections (CPython: 700)


def settle() -> None:
    """Call once the proxy is built, before it serves."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG, middle, old)
