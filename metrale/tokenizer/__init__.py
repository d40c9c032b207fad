"""Tokenization: text to ids, ids to streamed text, and chat templates."""

from metrale.tokenizer.chat_template import ChatTemplate, ChatTemplateError, resolve_chat_template
from metrale.tokenizer.detokenizer import IncrementalDetokenizer
from metrale.tokenizer.tokenizer import Tokenizer, TokenizerConfig

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerConfig",
    "resolve_chat_template",
]
