"""`sandgate demo`: Sandgate's main job, offline, in under a minute.

Starts an embedded OpenBao dev server with demo secrets, a local TLS stand-in for an LLM API, and
`sandgate run` with a demo policy; shows an agent call with the key injected, the bash tool
refused, a reflected key scrubbed, and `explain` for the same requests; then stops everything and
removes its temporary directory, also on an error, Ctrl-C or SIGTERM.

This module stays light: `sandgate --help` imports it to register the subcommand.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any


def register(sub: Any) -> None:
    """Add `sandgate demo` (the CLI family interface: a subparser whose `handler` runs it)."""
    p = sub.add_parser("demo", help="show Sandgate at work, offline: a local OpenBao, a stand-in "
                       "LLM API and Sandgate, stopped and removed afterwards")
    p.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    from sandgate.demo.stack import demo_stack
    from sandgate.demo.tour import DemoFailed, run_tour

    def out(line: str) -> None:
        print(line, flush=True)

    t0 = time.monotonic()
    out("sandgate demo: everything runs on this machine, in a temporary directory; nothing "
        "leaves it.")
    try:
        with demo_stack() as stack:
            run_tour(stack, out)
    except KeyboardInterrupt:
        # Everything is stopped and removed by now: a further SIGINT (a second Ctrl-C, or one
        # arriving while the interpreter shuts down, when Python has put back the default
        # action) must not turn this clean exit into a death by signal.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("sandgate demo: interrupted; everything it started is stopped and removed",
              file=sys.stderr)
        return 130
    except (DemoFailed, RuntimeError, OSError) as e:
        print(f"sandgate demo: failed: {e}; everything it started is stopped and removed",
              file=sys.stderr)
        return 1
    out(f"Done in {time.monotonic() - t0:.0f}s: Sandgate, OpenBao and the stand-in API are "
        "stopped, the temporary directory removed.")
    return 0
