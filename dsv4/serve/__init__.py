"""Serving DeepSeek-V4: the chat format, the engine and the OpenAI-compatible HTTP API."""
