"""The floor of an intercepting proxy built on mitmproxy: its core with no addon doing anything.

    python bench/mitm_floor.py HOST PORT CONFDIR UPSTREAM_CA

Not Sandgate: mitmproxy's Master with only the addons an intercepting HTTP proxy cannot run
without (core, the proxy server, next_layer, tlsconfig), none of mitmdump's other ~30 default
addons, and no Sandgate. Every flow still goes through mitmproxy's connection handler, layers
and hooks, which is the part any addon built on mitmproxy pays: its CPU per request and its
added latency bound Sandgate's from below. `bench/run.py` and `bench/focus.py` run it as the
`mitm-floor` variant (docs/performance.md, "The unmet targets", issue 29).
"""

from __future__ import annotations

import asyncio
import sys

from mitmproxy import master, options
from mitmproxy.addons import core, next_layer, proxyserver, tlsconfig


async def main(host: str, port: int, confdir: str, upstream_ca: str) -> None:
    opts = options.Options(listen_host=host, listen_port=port, confdir=confdir,
                           ssl_verify_upstream_trusted_ca=upstream_ca)
    m = master.Master(opts)
    m.addons.add(core.Core(), proxyserver.Proxyserver(), next_layer.NextLayer(),
                 tlsconfig.TlsConfig())
    await m.run()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]))
