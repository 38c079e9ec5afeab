"""Who is calling: proxy tokens, source addresses, container labels and agent processes, resolved
to one identity per request."""
