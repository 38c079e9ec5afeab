"""Pattern 1 with the split: the agent and its bash tool in one sandbox, as two users whose
traffic the sandbox's own network namespace sends to different Sandgate listeners.

This package runs INSIDE the sandbox image (sandbox_images/agent, copied there by
sandbox_images/build.sh), so it uses the standard library only and imports nothing else of
Sandgate: `rules` (the network rules, pure), `entrypoint` (root, before anything untrusted runs:
CA, rules, runner, then the agent with no capability left) and `toolrunner` (the root-owned
runner that executes the agent's tool commands as the tool user, and its client).
Sandgate's side of the split is sandgate.identity.roles. See docs/pattern1.md.
"""
