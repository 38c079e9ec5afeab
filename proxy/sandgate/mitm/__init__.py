"""Sandgate's replacements of mitmproxy (h11, h2, wsproto, pyOpenSSL) internals, in one place."""
