"""The HTTP server: one router per API family, over the `AsyncLLM` of the API process."""
