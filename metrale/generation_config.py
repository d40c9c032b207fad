"""What a checkpoint's `generation_config.json` says: its EOS ids and default sampling."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    @classmethod
    def from_dir(cls, model_dir: Path) -> GenerationDefaults:
        path = model_dir / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e}): fix or delete it") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        for eos_id in eos_ids:
            if not isinstance(eos_id, int) or isinstance(eos_id, bool) or eos_id < 0:
                raise ValueError(
                    f"{path}: eos_token_id {eos_id!r} is not a token id (a non-negative "
                    f"integer): fix or delete the file"
                )
        sampled = raw.get("do_sample", True)
        return cls(
            eos_token_ids=eos_ids,
            temperature=raw.get("temperature") if sampled else 0.0,
            top_k=raw.get("top_k") if sampled else None,
            top_p=raw.get("top_p") if sampled else None,
            min_p=raw.get("min_p") if sampled else None,
        )

    def sampling_overrides(self) -> dict[str, Any]:
        """The defaults that differ from SamplingParams' own, as keyword arguments."""
        fields = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
        }
        return {k: v for k, v in fields.items() if v is not None}
