"""The OpenAI-compatible routes."""
