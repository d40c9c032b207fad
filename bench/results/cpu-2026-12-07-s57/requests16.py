"""What `prefill_attention_engine.py` and `tree_ab.py` share: peer_cpu.py's 32 requests as token
ids, and the engine alone over peers.md's Llama prefilling them in the server's 256-token chunks
(prefix cache off)."""

import sys
from pathlib import Path

sys.path.insert(0, "/work/main/bench")
from peer_cpu import text_prompts
from profile_cpu import checkpoint

from metrale import LLM
from metrale.tokenizer import Tokenizer

MODEL = checkpoint(Path("/work/main/bench/.cache/llama-34m"))


def token_prompts() -> list[list[int]]:
    tok = Tokenizer.from_dir(MODEL)
    return [tok.encode(p, add_special_tokens=False) for p in text_prompts(MODEL, 32)]


def chunked_engine() -> LLM:
    return LLM(
        str(MODEL),
        dtype="float32",
        max_seq_len=2048,
        enable_prefix_caching=False,
        max_prefill_tokens=256,
    )
