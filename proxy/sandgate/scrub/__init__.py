"""Scrubbing secret values from what comes back: the scrubber and every helper it needs."""
