"""slotwise: a measuring, scheduling reverse proxy for llama-server."""

__version__ = "0.1.0"
