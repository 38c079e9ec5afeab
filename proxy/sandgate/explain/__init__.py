"""`sandgate explain` and `POST /v1/explain`: what the policy says about one request."""
