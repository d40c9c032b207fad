"""Model definitions, registered by the Hugging Face `architectures` name."""

from metrale.models import llama as _llama  # noqa: F401  (registers the Llama family)
from metrale.models.registry import model_class_for, supported_architectures

__all__ = ["model_class_for", "supported_architectures"]
