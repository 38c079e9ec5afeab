"""A throwaway CA and server certificates for the loopback upstreams of the tests (the same code
`sandgate demo` uses for its stand-in API)."""

from sandgate.demo.pki import Pki, make_pki

__all__ = ["Pki", "make_pki"]
