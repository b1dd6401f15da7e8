"""The OpenAI-compatible HTTP server. A request goes app.py (route) -> completions.py / chat.py
(parse and validate into a Job, via protocol.py) -> serving.py (submit, read Deltas, detokenize
with detokenize.py, stream or assemble) -> async_engine.py (the thread that steps LLMEngine)."""
from runtime.server.app import create_app
from runtime.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "create_app"]
