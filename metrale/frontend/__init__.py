"""The text side of a request: prompts in, detokenized outputs back. Runs in the API process."""
