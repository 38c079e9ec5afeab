"""mitmproxy addons and what they install beneath the hooks: the gate, the pinned options, the
lifecycle, the replacements of mitmproxy internals and the helpers the stages call."""
