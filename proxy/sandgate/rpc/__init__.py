"""JSON-RPC 2.0 and MCP: the calls a request body carries, MCP's headers and sessions."""
