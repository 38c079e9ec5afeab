"""The Docker labels that say who a container is: written by the launcher, trusted by the proxy.

Only containers on a watched sandbox network are read, and only the host's Docker engine (not
the sandbox) can set a container's labels, which is why the proxy may trust them.
"""

LABEL_IDENTITY = "sandgate.identity"  # required: the policy identity of the sandbox
LABEL_SANDBOX = "sandgate.sandbox"  # optional: the sandbox id (default: the container name)
LABEL_MANAGED = "sandgate.managed"  # "launcher": created by sandgate.sandbox (cleanup listings)
LABEL_SPLIT = "sandgate.split"  # "uid": pattern 1 with the split (docs/pattern1.md); "none"
