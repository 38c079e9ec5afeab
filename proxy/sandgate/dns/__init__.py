"""The policy DNS (`sandgate run --dns HOST:PORT`): the sandboxes' only resolver.

A query is judged by `sandgate.decision.decide_name` for the identity its source address
belongs to: a name some rule of that identity could reach is resolved by Sandgate's own
resolver and answered (bounded TTL and count, CNAMEs followed, only dialable addresses); any
other name is refused (NXDOMAIN or REFUSED) and audited, and never leaves Sandgate, so a lookup
of `<data>.attacker.example` carries nothing out. docs/dns.md.

- `server.py`: the UDP and TCP listeners and the one `answer(query bytes, source)` path
- `resolver.py`: Sandgate's resolver (a recursive server: --dns-upstream, else resolv.conf)
  with its answer cache
- `cache.py`: the addresses Sandgate answered, which the dialer pins (netguard.resolve)
- `bounds.py`: sizes, counts, TTLs and the per-source rate limit
"""
