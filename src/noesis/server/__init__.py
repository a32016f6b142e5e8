"""The OpenAI-compatible server: wire types, routes, SSE streaming, errors, metrics."""
