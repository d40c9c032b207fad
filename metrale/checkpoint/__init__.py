"""Finding a checkpoint on disk, checking it, and streaming its tensors into a model."""
