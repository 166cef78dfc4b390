"""The embedded default model (SmolLM2-135M-Instruct) -- placeholder, being written."""

EMBEDDED_ALIASES = ("embedded", "smollm2")


def resolve_model(model: str) -> str:
    """Map the embedded-model alias to its local folder; any other value passes through."""
    return model
