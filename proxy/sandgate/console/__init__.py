"""The web console of the admin listener (`/console/`): see docs/console.md.

app.py (routes, headers, login), auth.py (sessions, CSRF, roles), ring.py (recent decisions,
fed by the audit stream), source.py (this process or the workers), chart.py (the refusals
chart), worker.py (what a worker answers its supervisor's console), templates/, static/.
"""

PREFIX = "/console"


def is_console_path(path: str) -> bool:
    """Served by the console, which authenticates by its own session: the admin listener's
    token check lets these through (sandgate.admin.access)."""
    return path == PREFIX or path.startswith(PREFIX + "/")
