"""OpenAI-compatible server pieces: protocol, serving, metrics, errors, app."""
