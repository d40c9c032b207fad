"""That every tensor-parallel rank runs the same model the same way, checked once at startup.

Ranks on other nodes read their own copy of the checkpoint and their own flags; a rank whose
copy or flags differ would compute garbage in lockstep with the others, or wait forever on a
collective of another shape. So right after joining the group, before loading, each rank hashes
what it is about to run and the hashes are compared on every rank: the checkpoint (each weight
file's name, size, header and its first and last MiB: names, shapes, dtypes and a sample of the
bytes, without reading 100 GB) and the config (the model's, the dtypes, the step's sizes, the
attention backend, the seed of dummy weights). A difference is a ValueError on every rank that
names the ranks and which of the two differs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

from metrale.engine_config import EngineConfig

SAMPLE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin")


def checkpoint_digest(model_dir: Path, load_format: str) -> bytes:
    """The checkpoint's files, as far as a rank reads them (dummy weights: none)."""
    h = hashlib.sha256()
    model_dir = Path(model_dir)
    files = [model_dir] if model_dir.is_file() else sorted(model_dir.iterdir())
    for path in files:
        if path.name == "config.json" or (path.suffix == ".json" and path.stem.endswith("index")):
            h.update(path.name.encode() + path.read_bytes())
        elif path.suffix in WEIGHT_SUFFIXES and load_format != "dummy":
            size = path.stat().st_size
            h.update(f"{path.name}:{size}".encode())
            with path.open("rb") as f:
                h.update(f.read(SAMPLE_BYTES))
                f.seek(max(size - SAMPLE_BYTES, 0))
                h.update(f.read(SAMPLE_BYTES))
    return h.digest()


def config_digest(config: EngineConfig) -> bytes:
    """The settings every rank's forward and buffers depend on."""
    scheduler, cache = config.scheduler, config.cache
    settings = {
        "model": repr(config.model),
        "dtype": str(config.dtype),
        "load_format": config.load_format,
        "quantization": config.quantization,
        "seed": config.seed,
        "block_size": cache.block_size,
        "kv_dtype": str(cache.dtype),
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "max_batch_size": scheduler.max_batch_size,
        "max_seq_len": scheduler.max_seq_len,
        "attention_backend": config.attention_backend,
        "nnodes": config.launch.nnodes,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).digest()


def check_same_setup(config: EngineConfig) -> None:
    """Compare this rank's digests with every other rank's (a collective: every rank calls it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = checkpoint_digest(config.model_dir, config.load_format) + config_digest(config)
    tensor = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(config.device)
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    digests = [bytes(t.cpu().tolist()) for t in gathered]
    reference = digests[0]
    differ = {
        what: [rank for rank, d in enumerate(digests) if d[part] != reference[part]]
        for what, part in (("checkpoint", slice(0, 32)), ("config", slice(32, 64)))
    }
    if any(differ.values()):
        found = "; ".join(f"{what}: ranks {ranks}" for what, ranks in differ.items() if ranks)
        raise ValueError(
            f"tensor-parallel ranks disagree with rank 0 on what they run ({found}): every "
            "node needs the same checkpoint files and the same flags"
        )
