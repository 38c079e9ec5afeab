"""Policy review: lint, proofs, reach, reports, suggestions (policy loading: sandgate.policy)."""
