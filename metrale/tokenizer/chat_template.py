"""Chat template resolution and rendering.

A checkpoint's chat template is untrusted Jinja code from the Hub, so it compiles and renders in
`TemplateSandbox` (jinja2's immutable sandbox with a time and size budget per render), with the
globals and filters Hugging Face templates expect. Rendering matches transformers'
``apply_chat_template(..., tokenize=False)``: same message normalization, same variables, same
``continue_final_message`` cut.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from metrale.tokenizer.template_sandbox import (
    ChatTemplateBudgetError,
    ChatTemplateError,
    ChatTemplateSecurityError,
    RenderLimits,
    TemplateSandbox,
)

__all__ = [
    "ChatTemplate",
    "ChatTemplateBudgetError",
    "ChatTemplateError",
    "ChatTemplateSecurityError",
    "RenderLimits",
    "TemplateSource",
    "package_template_path",
    "resolve_chat_template",
]

CHECKPOINT_TEMPLATE_FILE = "chat_template.jinja"
PACKAGE_TEMPLATES_DIR = "jinja-templates"

# transformers copies a message's reasoning under all of these names, so a template may read any.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Appended to the final message to find where its content ends in the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


@dataclass(frozen=True)
class TemplateSource:
    """One template's text and where it came from, so errors can point at the file to fix."""

    text: str
    origin: str


def _plain_data(value: Any) -> Any:
    """A deep copy made of JSON types only.

    The template must not reach methods of caller objects (the sandbox cannot know which are
    dangerous), and the continue tag is appended to the copy, never to the caller's message.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain_data(item) for item in value]
    raise TypeError(
        f"chat template inputs must be JSON-like (dict, list, str, number, bool, None), "
        f"got {type(value).__name__}"
    )


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop None fields (OpenAI clients send content=None) and alias the reasoning field names."""
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be mappings, got {type(message).__name__}")
    normalized = {key: _plain_data(value) for key, value in message.items() if value is not None}
    reasoning = next((normalized[key] for key in _REASONING_FIELDS if key in normalized), None)
    if reasoning is not None:
        normalized = {"thinking": reasoning, **normalized, "reasoning_content": reasoning}
    return normalized


def _tag_final_content(message: dict[str, Any]) -> str:
    """Append the continue tag to the final message's text; return that text untagged."""
    content = message.get("content")
    if isinstance(content, str):
        message["content"] = content + _CONTINUE_TAG
        return content
    if isinstance(content, list):
        for block in reversed(content):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
    raise ChatTemplateError(
        "continue_final_message is set but the final message has no text content to continue"
    )


def _cut_after_final_content(rendered: str, final_text: str, origin: str) -> str:
    tag_index = rendered.rfind(_CONTINUE_TAG.strip())
    if tag_index < 0 or final_text.strip() not in rendered:
        raise ChatTemplateError(
            f"continue_final_message is set but the chat template from {origin} does not render "
            "the final message's content verbatim, so there is no place to continue from"
        )
    if rendered[tag_index : tag_index + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:tag_index]
    # The template trimmed whitespace after the content; trim the continued text the same way.
    return rendered[:tag_index].rstrip()


class ChatTemplate:
    """The named templates of one model, compiled once, and the choice between them.

    Most checkpoints have one template, named "default". A tokenizer_config.json may list
    several; "tool_use" is then preferred when the request carries tools. A syntax error
    surfaces at construction, so a broken template fails at startup, not on the first request.
    """

    def __init__(
        self,
        sources: Mapping[str, TemplateSource],
        *,
        missing_hint: str = "the model has no chat template; pass --chat-template FILE",
        limits: RenderLimits | None = None,
    ) -> None:
        """``missing_hint`` is the error for rendering when ``sources`` is empty; ``limits``
        bound each render's time and size (RenderLimits' defaults if None)."""
        self.sources = dict(sources)
        self._missing_hint = missing_hint
        self._sandbox = TemplateSandbox(limits)
        self._templates: dict[str, jinja2.Template] = {
            name: self._sandbox.compile_template(source.text, source.origin)
            for name, source in self.sources.items()
        }

    @classmethod
    def from_string(cls, text: str, *, origin: str = "string") -> ChatTemplate:
        return cls({"default": TemplateSource(text, origin)})

    @property
    def is_available(self) -> bool:
        return bool(self._templates)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render the prompt text for ``messages``.

        ``continue_final_message`` renders without a generation prompt and cuts the text right
        after the final message's content, so the model continues that message; it overrides
        ``add_generation_prompt``. ``template_kwargs`` become template variables (the special
        tokens, ``enable_thinking``, ...). Raises ChatTemplateError when the template rejects
        the conversation or cannot render it, and a ChatTemplateBudgetError (a subclass) when
        the render runs past its time or size budget.
        """
        name = self._select(tools)
        template, origin = self._templates[name], self.sources[name].origin
        chat = [_normalize_message(message) for message in messages]
        final_text: str | None = None
        if continue_final_message:
            if not chat:
                raise ChatTemplateError("continue_final_message is set but there are no messages")
            final_text = _tag_final_content(chat[-1])
            add_generation_prompt = False
        variables = {
            "documents": None,
            **_plain_data(template_kwargs),
            "messages": chat,
            "tools": _plain_data(tools),
            "add_generation_prompt": add_generation_prompt,
        }
        rendered = self._sandbox.render_template(template, variables, origin)
        if final_text is None:
            return rendered
        return _cut_after_final_content(rendered, final_text, origin)

    def _select(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        if not self._templates:
            raise ChatTemplateError(self._missing_hint)
        if tools is not None and "tool_use" in self._templates:
            return "tool_use"
        if "default" in self._templates:
            return "default"
        names = ", ".join(sorted(self._templates))
        raise ChatTemplateError(
            f"the model's chat templates ({names}) include no 'default' to render this request "
            "with; pass --chat-template FILE"
        )


def package_template_path(model_type: str) -> Path | None:
    """Our own template for ``model_type``, shipped as package data, if there is one.

    These override a checkpoint's template where the checkpoint's is known to be wrong or to
    lack features (tools, reasoning) that the server relies on.
    """
    path = Path(__file__).resolve().parent.parent / PACKAGE_TEMPLATES_DIR / f"{model_type}.jinja"
    return path if path.is_file() else None


def _config_sources(config_template: object, config_path: Path) -> dict[str, TemplateSource]:
    origin = f"{config_path} (chat_template)"
    if config_template is None:
        return {}
    if isinstance(config_template, str):
        return {"default": TemplateSource(config_template, origin)}
    if isinstance(config_template, list) and all(
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("template"), str)
        for entry in config_template
    ):
        return {
            entry["name"]: TemplateSource(entry["template"], f"{origin}[{entry['name']!r}]")
            for entry in config_template
        }
    raise ValueError(
        f"{origin} must be a string or a list of {{name, template}} objects, "
        f"got {type(config_template).__name__}; pass --chat-template FILE"
    )


def resolve_chat_template(
    model_dir: Path,
    *,
    config_template: object,
    chat_template_path: Path | None = None,
    model_type: str | None = None,
) -> ChatTemplate:
    """Find the model's chat template, first match wins.

    1. ``chat_template_path`` (``--chat-template FILE``): the operator knows best;
    2. ``metrale/jinja-templates/<model_type>.jinja``: our fix for a known-bad checkpoint template;
    3. ``<model_dir>/chat_template.jinja``: newer checkpoints ship the template as a file;
    4. ``config_template``, tokenizer_config.json's ``chat_template`` (a string, or a list of
       named templates of which "default" and "tool_use" are used).

    Finding none is not an error here, since a model serves completions without a template;
    rendering then raises ChatTemplateError with what to do.
    """
    if chat_template_path is not None:
        if not chat_template_path.is_file():
            raise FileNotFoundError(f"--chat-template {chat_template_path}: no such file")
        return _from_file(chat_template_path)
    override_path = package_template_path(model_type) if model_type else None
    if override_path is not None:
        return _from_file(override_path)
    checkpoint_path = model_dir / CHECKPOINT_TEMPLATE_FILE
    if checkpoint_path.is_file():
        return _from_file(checkpoint_path)
    config_path = model_dir / "tokenizer_config.json"
    return ChatTemplate(
        _config_sources(config_template, config_path),
        missing_hint=(
            f"checkpoint {model_dir} has no chat template (no {CHECKPOINT_TEMPLATE_FILE}, no "
            "chat_template in tokenizer_config.json); pass --chat-template FILE"
        ),
    )


def _from_file(path: Path) -> ChatTemplate:
    return ChatTemplate.from_string(path.read_text(encoding="utf-8"), origin=str(path))
