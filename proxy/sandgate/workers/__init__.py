"""`sandgate run --workers N`: N proxy processes behind one listening port.

mitmproxy is one process on one core. With N > 1 a supervisor (`supervisor.py`) prepares what
all workers must share (the confdir CA and token key, a dev Vault), checks the listening address,
and starts N `sandgate run` worker processes. Each worker is today's single-process proxy with
three differences: it binds the proxy port with SO_REUSEPORT so that the kernel spreads
connections across workers (`listen.py`), every audit event carries its `worker` id and is one
`write()` on an O_APPEND file (`sandgate.audit.workerlog`), and instead of a TCP admin listener
it serves the admin API on a private Unix socket (`control.py`). The supervisor owns the one
admin listener (`admin_front.py`): it aggregates `/metrics` and `/readyz` over the workers
(`aggregate.py`) and fans reloads out to all of them.
"""
