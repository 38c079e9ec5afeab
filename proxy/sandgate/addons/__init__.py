"""The addons mitmproxy's master calls, and nothing else: gate.py (the hooks: each calls stages),
lifecycle.py (flows in flight, graceful drain), pinned.py (options pinned).

In the chain (sandgate.runner.build), after mitmproxy's own addons: Gate, then the two addons of the
patches below the hooks (sandgate.mitm: WireLimits, UpstreamPool), Lifecycle (a flow leaves it
only once the gate audited it), Pinned.
"""
