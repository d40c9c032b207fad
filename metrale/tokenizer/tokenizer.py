"""Text to token ids and back, for one checkpoint directory."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

from metrale.tokenizer.chat_template import ChatTemplate, resolve_chat_template
from metrale.tokenizer.token_bytes import TokenBytes

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _token_content(value: object, *, key: str, path: Path) -> str | None:
    """A special token entry as a string: configs write either "<s>" or {"content": "<s>", ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: {key} must be a string or an object with 'content', got {value!r}")


def _extra_special_tokens(raw: Mapping[str, Any], path: Path) -> tuple[str, ...]:
    """additional_special_tokens (transformers 4), extra_special_tokens (5; a list, or a dict of
    model-specific names like image_token)."""
    contents: list[str] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        entries = raw.get(key) or []
        if not isinstance(entries, list | dict):
            raise ValueError(f"{path}: {key} must be a list or an object, got {entries!r}")
        for entry in entries.values() if isinstance(entries, dict) else entries:
            content = _token_content(entry, key=key, path=path)
            if content is not None:
                contents.append(content)
    return tuple(contents)


def _added_token(entry: Mapping[str, Any], *, path: Path) -> tokenizers.AddedToken:
    if not isinstance(entry.get("content"), str):
        raise ValueError(f"{path}: added_tokens_decoder entry without 'content': {entry!r}")
    special = bool(entry.get("special", False))
    return tokenizers.AddedToken(
        entry["content"],
        single_word=bool(entry.get("single_word", False)),
        lstrip=bool(entry.get("lstrip", False)),
        rstrip=bool(entry.get("rstrip", False)),
        normalized=bool(entry.get("normalized", not special)),
        special=special,
    )


@dataclass(frozen=True)
class TokenizerConfig:
    """The parts of tokenizer_config.json that change encoding, decoding or chat rendering."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    # transformers>=5 ignores these once tokenizer.json exists; kept to warn when they disagree.
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    # Tokens the config declares but tokenizer.json may lack; transformers adds them.
    added_tokens: tuple[tokenizers.AddedToken, ...] = ()
    extra_special_tokens: tuple[str, ...] = ()
    # A string or a list of {name, template}; checked by resolve_chat_template.
    chat_template: object = None

    @classmethod
    def from_file(cls, path: Path) -> TokenizerConfig:
        """Parse ``path``; a missing file means no config, as for many base-model checkpoints."""
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from error
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        decoder = raw.get("added_tokens_decoder") or {}
        if not isinstance(decoder, dict) or not all(
            isinstance(key, str) and key.isdigit() and isinstance(entry, dict)
            for key, entry in decoder.items()
        ):
            raise ValueError(
                f"{path}: added_tokens_decoder must map token ids to token objects "
                '({"151643": {"content": ...}, ...})'
            )
        return cls(
            bos_token=_token_content(raw.get("bos_token"), key="bos_token", path=path),
            eos_token=_token_content(raw.get("eos_token"), key="eos_token", path=path),
            pad_token=_token_content(raw.get("pad_token"), key="pad_token", path=path),
            unk_token=_token_content(raw.get("unk_token"), key="unk_token", path=path),
            add_bos_token=raw.get("add_bos_token"),
            add_eos_token=raw.get("add_eos_token"),
            added_tokens=tuple(
                _added_token(entry, path=path)
                for _, entry in sorted(decoder.items(), key=lambda item: int(item[0]))
            ),
            extra_special_tokens=_extra_special_tokens(raw, path),
            chat_template=raw.get("chat_template"),
        )

    @property
    def named_special_tokens(self) -> dict[str, str]:
        """bos/eos/pad/unk that are set, under transformers' names: what chat templates see."""
        named = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }
        return {name: content for name, content in named.items() if content is not None}


def _apply_config_tokens(backend: tokenizers.Tokenizer, config: TokenizerConfig) -> None:
    """Add and mark tokens as transformers does on load, in its order, so that ids agree.

    First the config's added tokens that tokenizer.json lacks; then bos/eos/unk/pad become
    special added tokens (matched whole in text, dropped by skip_special_tokens), even where
    tokenizer.json has them as plain vocabulary or non-special; then the extra special tokens
    that tokenizer.json lacks are appended as special.
    """

    def contents(*, special_only: bool) -> set[str]:
        tokens = backend.get_added_tokens_decoder().values()
        return {token.content for token in tokens if token.special or not special_only}

    added_contents = contents(special_only=False)
    for token in config.added_tokens:
        if token.content in added_contents:
            continue
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        added_contents.add(token.content)
    special_contents = contents(special_only=True)
    for content in config.named_special_tokens.values():
        if content not in special_contents:
            backend.add_special_tokens(
                [tokenizers.AddedToken(content, special=True, normalized=False)]
            )
            special_contents.add(content)
    added_contents = contents(special_only=False)
    for content in config.extra_special_tokens:
        if content not in added_contents:
            backend.add_special_tokens(
                [tokenizers.AddedToken(content, special=True, normalized=False)]
            )
            added_contents.add(content)


def _has_byte_fallback_decoder(backend: tokenizers.Tokenizer) -> bool:
    if backend.decoder is None:
        return False
    return '"ByteFallback"' in backend.decoder.__getstate__().decode("utf-8")


def _decodes_token_bytes(backend: tokenizers.Tokenizer) -> bool:
    """Whether the decoder is ByteLevel alone (`token_bytes.py`)."""
    if backend.decoder is None:
        return False
    return json.loads(backend.decoder.__getstate__()).get("type") == "ByteLevel"


class Tokenizer:
    """Encodes, decodes and renders chats for one model, exactly as transformers would.

    Owns a `tokenizers` backend built from tokenizer.json with tokenizer_config.json's tokens
    applied, and the model's ChatTemplate. Whether encode adds BOS/EOS is decided by
    tokenizer.json's post-processor, as in transformers>=5. Thread-safe: the backend is only
    read after construction.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        config: TokenizerConfig,
        chat_template: ChatTemplate,
    ) -> None:
        self._backend = backend
        self.config = config
        self.chat_template = chat_template
        self._has_byte_fallback_decoder = _has_byte_fallback_decoder(backend)
        # Where the text of some ids is the lossy UTF-8 decode of their tokens' bytes.
        self.token_bytes = (
            TokenBytes(backend, self.all_special_ids) if _decodes_token_bytes(backend) else None
        )

    @classmethod
    def from_dir(
        cls,
        model_dir: Path,
        *,
        chat_template_path: Path | None = None,
        model_type: str | None = None,
    ) -> Tokenizer:
        """Load ``model_dir``'s tokenizer.json and tokenizer_config.json.

        ``chat_template_path`` (``--chat-template``) and ``model_type`` (which selects our
        packaged template override, if any) feed chat template resolution; see
        resolve_chat_template.
        """
        tokenizer_path = model_dir / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise FileNotFoundError(
                f"{tokenizer_path} not found: metrale needs the fast-tokenizer file. If the "
                "checkpoint only has a slow tokenizer (tokenizer.model, vocab.json), convert it "
                "once with transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as error:  # the Rust side raises plain Exception
            raise ValueError(
                f"{tokenizer_path} is not a tokenizer the tokenizers library can load ({error}); "
                "the file is corrupt or truncated: re-download the checkpoint"
            ) from error
        config = TokenizerConfig.from_file(model_dir / TOKENIZER_CONFIG_FILE)
        _apply_config_tokens(backend, config)
        chat_template = resolve_chat_template(
            model_dir,
            config_template=config.chat_template,
            chat_template_path=chat_template_path,
            model_type=model_type,
        )
        tokenizer = cls(backend, config, chat_template)
        tokenizer._warn_on_ignored_bos_eos_flags()
        return tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_each(self, token_ids: Iterable[int]) -> list[str]:
        """Each token's text decoded alone, special tokens included."""
        return self._backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False)

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        """Vocabulary entries (byte-level ones read like 'Ġhello'), for logprobs and debugging."""
        tokens: list[str] = []
        for token_id in token_ids:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary of {self.vocab_size} tokens"
                )
            tokens.append(token)
        return tokens

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included: the smallest valid logits width."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def check_fits_vocab(self, model_vocab_size: int) -> None:
        """Refuse a tokenizer whose ordinary tokens have ids past the model's embedding rows.

        Such a tokenizer belongs to another model: plain text would encode to ids the model
        cannot embed. Added tokens past the embedding are a known quirk of real checkpoints (a
        pad token the config declares, never fed to the model), so they only warn; a prompt
        holding one is refused per request.
        """
        base_ids = self._backend.get_vocab(with_added_tokens=False).values()
        max_base_id = max(base_ids, default=-1)
        if max_base_id >= model_vocab_size:
            raise ValueError(
                f"the tokenizer's vocabulary has ids up to {max_base_id:,} but the model's "
                f"config.json has vocab_size={model_vocab_size:,}: tokenizer.json and "
                f"config.json come from different models"
            )
        beyond = [
            token.content
            for token_id, token in self._backend.get_added_tokens_decoder().items()
            if token_id >= model_vocab_size
        ]
        if beyond:
            logger.warning(
                "%d added token(s) have ids past the model's vocab_size=%d (%s): prompts "
                "holding them will be refused",
                len(beyond),
                model_vocab_size,
                ", ".join(beyond[:5]),
            )

    @property
    def bos_token_id(self) -> int | None:
        return None if self.config.bos_token is None else self.token_to_id(self.config.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.config.eos_token is None else self.token_to_id(self.config.eos_token)

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Ids that decode(skip_special_tokens=True) drops, in increasing order."""
        return tuple(
            sorted(
                token_id
                for token_id, token in self._backend.get_added_tokens_decoder().items()
                if token.special
            )
        )

    @property
    def has_byte_fallback_decoder(self) -> bool:
        """Whether <0xNN> byte tokens decode in all-or-nothing runs (Llama 2, Mistral).

        IncrementalDetokenizer needs to know: in such a run no boundary is final until the run is.
        """
        return self._has_byte_fallback_decoder

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` to prompt text; see ChatTemplate.render.

        The named special tokens (bos_token, eos_token, ...) are template variables, as in
        transformers; ``template_kwargs`` (e.g. enable_thinking=False) override them.
        """
        return self.chat_template.render(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **{**self.config.named_special_tokens, **template_kwargs},
        )

    def _warn_on_ignored_bos_eos_flags(self) -> None:
        """Say so when tokenizer_config.json asks for BOS/EOS that tokenizer.json does not add."""
        framing_ids = self.encode("", add_special_tokens=True)
        for flag, token_id, name in (
            (self.config.add_bos_token, self.bos_token_id, "bos"),
            (self.config.add_eos_token, self.eos_token_id, "eos"),
        ):
            if flag is None or token_id is None or flag == (token_id in framing_ids):
                continue
            logger.warning(
                "%s sets add_%s_token=%s but tokenizer.json's post-processor %s it; following "
                "tokenizer.json, as transformers>=5 does",
                TOKENIZER_CONFIG_FILE,
                name,
                str(flag).lower(),
                "does not add" if flag else "adds",
            )
