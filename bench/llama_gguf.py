"""A Hugging Face Llama checkpoint written as a float32 GGUF file that llama.cpp serves: the same
weights (q/k rows in llama.cpp's rotary order), the same byte-level BPE tokenizer (Qwen2's split
regex, which llama.cpp knows as the `qwen2` pre-tokenizer), for running llama.cpp on the model
the other peers serve (`peer_cpu.py`). gguf's writer does the file; Metrale's GGUF loader reads it
back (a check: `python bench/llama_gguf.py DIR OUT.gguf --check`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _llama_cpp_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows in llama.cpp's order: within a head, the two rotary halves interleaved (the
    inverse of `metrale.checkpoint.gguf._unpermute`)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(weight.shape)


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.<module>.weight
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{NAMES[module]}.{kind}"


def write_f32_gguf(model_dir: Path, path: Path) -> Path:
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    # The tokenizer: byte-level BPE, padded to the model's vocabulary as llama.cpp's converter
    # pads it.
    vocab = tokenizer["model"]["vocab"]
    special = {t["id"]: t["content"] for t in tokenizer.get("added_tokens", [])}
    by_id = {i: t for t, i in vocab.items()} | special
    tokens, types = [], []
    for i in range(config["vocab_size"]):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        types.append(
            gguf.TokenType.CONTROL
            if i in special
            else gguf.TokenType.NORMAL
            if i in by_id
            else gguf.TokenType.USER_DEFINED
        )
    merges = tokenizer["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        weight = tensor.float()
        if name.endswith("q_proj.weight"):
            weight = _llama_cpp_rows(weight, heads)
        elif name.endswith("k_proj.weight"):
            weight = _llama_cpp_rows(weight, kv_heads)
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(weight.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--check", action="store_true", help="greedy tokens equal from both")
    args = parser.parse_args()
    write_f32_gguf(args.model_dir, args.out)
    if args.check:
        from metrale import LLM, SamplingParams

        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        prompt = [list(range(10, 60))]
        ours = [
            LLM(model_from_path=str(p), dtype="float32", enforce_eager=True)
            .generate(prompt, params, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
            for p in (args.model_dir, args.out)
        ]
        assert ours[0] == ours[1], ours
        print("same greedy tokens from the directory and the file:", ours[0][:12], "...")


if __name__ == "__main__":
    main()
