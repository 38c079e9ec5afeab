"""A fake api.anthropic.com for the compose CI stack (docker-compose.ci.yml).

Makes a throwaway CA and a server certificate for the given names and address, publishes ONLY
the CA certificate (for `sandgate run --upstream-ca`), and serves tests/support/upstream.py's
app over TLS. For every request it logs one line with the SHA-256 of the x-api-key it received,
never the key itself:

    FAKE-UPSTREAM POST /v1/messages x-api-key-sha256=<hex>

    python -m tests.compose.fake_upstream --ip 172.30.121.20 --ca-out /shared/ca.pem
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import ssl
import sys
import tempfile
from pathlib import Path

from aiohttp import web

from tests.support.pki import make_pki
from tests.support.upstream import Upstream


def key_digest(request: web.Request) -> str:
    key = request.headers.get("x-api-key")
    return "none" if key is None else hashlib.sha256(key.encode()).hexdigest()


@web.middleware
async def log_key_digest(request: web.Request, handler: web.Handler) -> web.StreamResponse:
    print(f"FAKE-UPSTREAM {request.method} {request.path} "
          f"x-api-key-sha256={key_digest(request)}", flush=True)
    return await handler(request)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ip", required=True, help="the address in the certificate and to listen on")
    p.add_argument("--port", type=int, default=443)
    p.add_argument("--name", action="append", default=[], help="DNS names in the certificate")
    p.add_argument("--ca-out", type=Path, required=True, help="where to write the CA certificate")
    args = p.parse_args(argv)
    names = args.name or ["api.anthropic.com"]

    pki = make_pki(Path(tempfile.mkdtemp(prefix="fake-upstream-")), names, [args.ip])
    args.ca_out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.ca_out.with_name(f".{args.ca_out.name}.{os.getpid()}")
    shutil.copyfile(pki.ca_cert, tmp)  # the certificate only: the CA key is never written
    tmp.chmod(0o644)
    tmp.replace(args.ca_out)

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(pki.cert), str(pki.key))
    app = Upstream().app()
    app.middlewares.append(log_key_digest)
    print(f"fake upstream for {', '.join(names)} on https://{args.ip}:{args.port}", flush=True)
    web.run_app(app, host=args.ip, port=args.port, ssl_context=ctx, access_log=None,
                print=None, handle_signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
