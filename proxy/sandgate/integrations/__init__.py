"""Agent-framework integrations: agent hosts whose tools run in Sandgate-governed sandboxes.

Each integration imports its framework lazily, so `sandgate.integrations` itself imports where
the agent frameworks are not installed (the Sandgate image: requirements/proxy.lock has none;
the dev environment has them, for the tests).
"""
