"""Policy files: loading and compiling them into the Policy the proxy decides with, and the
review tools over them (lint, proofs, reach, report, suggest, traffic)."""
