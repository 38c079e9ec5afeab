"""Agent-framework integrations: agent hosts whose tools run in Sandgate-governed sandboxes.

Each integration imports its framework lazily, so `sandgate.integrations` itself imports in the
proxy's venv (which never has the agent frameworks installed).
"""
