"""Turn what the user named (a directory or a Hugging Face id) into a local directory.

A Hugging Face id is looked up offline first in the hub cache (`HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`), as huggingface_hub lays it out:
`models--ORG--NAME/snapshots/<commit>/`, the commit named by `refs/main`. Only when it is not
there, and the network is allowed, is it downloaded with huggingface_hub.
"""

from __future__ import annotations

import os
from pathlib import Path

from metrale.checkpoint import gguf


class ModelNotFoundError(FileNotFoundError):
    pass


def hub_cache_dir() -> Path:
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache)
    if home := os.environ.get("HF_HOME"):
        return Path(home) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def find_cached_snapshot(
    repo_id: str, revision: str = "main", gguf_file: str | None = None
) -> Path | None:
    """A complete snapshot: one with config.json, or with `gguf_file` when one is named."""
    marker = gguf_file or "config.json"
    repo_dir = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    ref_file = repo_dir / "refs" / revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else revision
    snapshot = repo_dir / "snapshots" / commit
    if (snapshot / marker).is_file():
        return snapshot
    # A cache filled by hand or by an older client may lack refs/: take a complete snapshot.
    snapshots = sorted((repo_dir / "snapshots").glob(f"*/{marker}")) if repo_dir.is_dir() else []
    return snapshots[-1].parent if snapshots else None


def resolve_model_dir(
    model: str | None, model_from_path: str | Path | None = None, gguf_file: str | None = None
) -> Path:
    """The checkpoint directory for `--model-from-path DIR` or a model id / path argument; a
    GGUF file (named, or the one in a directory without config.json, or `gguf_file`) becomes
    the directory made of it (`checkpoint/gguf.py`)."""
    if model_from_path is not None:
        path = Path(model_from_path).expanduser()
        if not path.is_dir() and not gguf.is_gguf(path):
            raise ModelNotFoundError(f"--model-from-path {path}: no such directory")
        return _with_gguf(path, gguf_file)
    if model is None:
        raise ModelNotFoundError("no model named: pass a Hugging Face id or --model-from-path DIR")
    as_path = Path(model).expanduser()
    if as_path.is_dir() or gguf.is_gguf(as_path):
        return _with_gguf(as_path, gguf_file)
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"{model!r} is neither a directory, a .gguf file nor a Hugging Face id of the form "
            f"ORG/NAME"
        )
    snapshot = find_cached_snapshot(model, gguf_file=gguf_file) or _download(model, gguf_file)
    return _with_gguf(snapshot, gguf_file)


def _with_gguf(path: Path, gguf_file: str | None) -> Path:
    """`path` as a checkpoint directory: a GGUF file's own, when the weights are GGUF."""
    try:
        if gguf.is_gguf(path):
            return gguf.gguf_model_dir(path)
        if gguf_file is not None or not (path / "config.json").is_file():
            found = gguf.find_gguf(path, gguf_file)
            if found is not None:
                return gguf.gguf_model_dir(found)
    except gguf.CheckpointError as e:
        raise ModelNotFoundError(str(e)) from None
    return path


def _download(repo_id: str, gguf_file: str | None = None) -> Path:
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    where = hub_cache_dir()
    if offline:
        raise ModelNotFoundError(
            f"{repo_id} is not in the Hugging Face cache ({where}) and HF_HUB_OFFLINE is set: "
            f"download it on a machine with network access or pass --model-from-path DIR"
        )
    from huggingface_hub import snapshot_download

    try:
        # A GGUF repository holds many quantizations of one model, gigabytes each: only the
        # one named is fetched.
        weights = [gguf_file] if gguf_file else ["*.safetensors"]
        return Path(
            snapshot_download(
                repo_id,
                allow_patterns=[*weights, "*.json", "*.jinja", "*.model", "*.txt", "MODEL.toml"],
            )
        )
    except Exception as e:  # the hub client raises many kinds; all mean the same to the user
        raise ModelNotFoundError(
            f"{repo_id} is not in the Hugging Face cache ({where}) and could not be downloaded "
            f"({type(e).__name__}: {e}); check the id and network, or pass --model-from-path DIR"
        ) from e
