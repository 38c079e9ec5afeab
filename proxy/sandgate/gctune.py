"""The cyclic garbage collector, set for a proxy: a large heap built once, then many short
connections whose objects (mitmproxy's layers, contexts and flows refer to each other) are
cyclic garbage when the connection ends.

Measured with `gc.callbacks` over 1,000 new passthrough tunnels (`bench/focus.py --phase
new_conn`): with CPython's defaults the collector took about 0.28 s, ~11% of the proxy's CPU,
most of it in two full collections that each walked the ~140,000 objects built at startup
(policy, addons, mitmproxy, libraries) and stopped the event loop for about 80 ms.

`gc.freeze()` once the proxy is built: those objects move to a permanent generation the
collector no longer walks. What they refer to is untouched (reference counting still frees
anything that stops being used); only a reference *cycle* among startup objects that becomes
garbage later is never collected: bounded by the startup heap, once.

Measured and not kept: a young generation of 10,000 allocations instead of CPython's 700
(collections less often). It let connections' cyclic garbage pile up between collections: the
abuse soak test (`tests/integration/soak/test_abuse.py`, 2,000 idle and hostile clients) saw
the proxy's RSS end 26% above its warm-up figure (the bound is 10%).
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Call once the proxy is built, before it serves."""
    gc.collect()
    gc.freeze()
