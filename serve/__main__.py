"""`python -m serve`: the OpenAI-compatible server (serve/server.py)."""

from serve.server import entry

entry()
