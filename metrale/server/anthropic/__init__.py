"""The Anthropic-compatible routes: the Messages API, served by the chat route's machinery."""
