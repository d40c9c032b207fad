"""Tokenization: text to ids, ids to streamed text, and chat templates."""

from metrale.tokenizer.chat_template import (
    ChatTemplate,
    ChatTemplateBudgetError,
    ChatTemplateError,
    ChatTemplateSecurityError,
    RenderLimits,
    resolve_chat_template,
)
from metrale.tokenizer.detokenizer import IncrementalDetokenizer
from metrale.tokenizer.tokenizer import Tokenizer, TokenizerConfig

__all__ = [
    "ChatTemplate",
    "ChatTemplateBudgetError",
    "ChatTemplateError",
    "ChatTemplateSecurityError",
    "IncrementalDetokenizer",
    "RenderLimits",
    "Tokenizer",
    "TokenizerConfig",
    "resolve_chat_template",
]
