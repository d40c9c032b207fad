"""Finding a checkpoint on disk, checking it, and streaming its tensors into a model."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be served as it is: missing or mismatched tensors, a bad file."""
