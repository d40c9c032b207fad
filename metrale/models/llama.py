"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3.

They share one decoder; a family differs only in flags: Qwen2 adds biases to q/k/v, Qwen3 adds
an RMSNorm over each query and key head before the rotary embedding. The model works on the flat
token batch of a step: `forward(input_ids [num_tokens], positions [num_tokens], meta)`.

Checkpoint tensors keep their Hugging Face names; q/k/v and gate/up are fused into one matrix
each at load time, so a layer runs two matmuls where the checkpoint has five.

Under tensor parallelism (`config.tensor_parallel_size` ranks, the group joined first) each rank
builds the same module from layers that know their split: its query heads and their KV heads,
its share of the MLP, its slice of the vocabulary; it loads only those parts of each tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from metrale.config import ModelConfig
from metrale.distributed.parallel_state import tp_rank, tp_size
from metrale.distributed.sharding import TensorSlice, even_slice, head_slice
from metrale.layers.activation import silu_and_mul
from metrale.layers.attention import Attention, AttentionMetadata
from metrale.layers.embedding import VocabParallelEmbedding
from metrale.layers.layernorm import RMSNorm
from metrale.layers.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    silu_and_mul_linear,
)
from metrale.layers.packed_weight import PackedWeight
from metrale.layers.rotary import FusedRotary, RotaryAngles, RotaryEmbedding
from metrale.models.registry import register_model

# Checkpoint projection -> (fused parameter, index of its shard in the fused matrix).
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class AttentionBiases(NamedTuple):
    """Which of a layer's attention projections carry a bias."""

    qkv: bool
    o: bool


class DecoderAttention(nn.Module):
    """This rank's query heads and the KV heads they read (all of them on one rank): q/k/v
    column-parallel, o row-parallel, so attention itself needs no collective."""

    def __init__(
        self, config: ModelConfig, *, biases: AttentionBiases, qk_norm: bool, fused: bool
    ) -> None:
        super().__init__()
        self.q_size, self.kv_size = config.q_size_per_rank, config.kv_size_per_rank
        self.head_dim = head_dim = config.head_dim
        rank, size = tp_rank(), tp_size()
        q_rows = head_slice(
            "num_attention_heads", config.num_heads, head_dim, rank, size, replicable=False
        )
        kv_rows = head_slice(
            "num_key_value_heads", config.num_kv_heads, head_dim, rank, size, replicable=True
        )
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [q_rows, kv_rows, kv_rows], bias=biases.qkv, fused=fused
        )
        self.o_proj = RowParallelLinear(q_rows, config.hidden_size, bias=biases.o, fused=fused)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(head_dim, eps, fused) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps, fused) if qk_norm else None
        self.attn = Attention(config.num_heads_per_rank, config.num_kv_heads_per_rank, head_dim)

    def forward(
        self,
        rope: RotaryAngles | FusedRotary,
        x: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Every row's keys and values stored; the output at `rows` (None: every row)."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, -1, self.head_dim)
        k = k.view(num_tokens, -1, self.head_dim)
        v = v.view(num_tokens, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            rope = rope.with_head_norms(self.q_norm, self.k_norm)
        out = self.attn(q, k, v, meta, rope)  # [num_tokens, num_heads_per_rank, head_dim]
        out = out.reshape(num_tokens, self.q_size)
        if rows is not None:
            out = out[rows]
            if not len(rows):  # (o_proj's all-reduce skipped alike on every rank)
                return out.new_empty(0, self.o_proj.out_features)
        return self.o_proj(out)


class DecoderMLP(nn.Module):
    """gate/up column-parallel, down row-parallel: this rank's share of the intermediate
    features, one all-reduce."""

    def __init__(self, config: ModelConfig, fused: bool) -> None:
        super().__init__()
        self.act = silu_and_mul
        if fused:
            from metrale.kernels.silu_and_mul import silu_and_mul as fused_silu_and_mul

            self.act = fused_silu_and_mul
        features = even_slice("intermediate_size", config.intermediate_size, tp_rank(), tp_size())
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, [features, features], bias=False, fused=fused
        )
        self.down_proj = RowParallelLinear(features, config.hidden_size, bias=False, fused=fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_linear(self.gate_up_proj(x), self.down_proj, self.act)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, *, biases: AttentionBiases, qk_norm: bool, fused: bool
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.self_attn = DecoderAttention(config, biases=biases, qk_norm=qk_norm, fused=fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, fused)
        self.mlp = DecoderMLP(config, fused)

    def forward(
        self,
        rope: RotaryAngles | FusedRotary,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual) at `rows` (None: every row); every row's keys and values are
        stored either way."""
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta, rows)
        if rows is not None:
            residual = residual[rows]
            if not len(rows):
                return x, residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(
        self, config: ModelConfig, *, biases: AttentionBiases, qk_norm: bool, fused: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope, fused
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, biases=biases, qk_norm=qk_norm, fused=fused)
            for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(rope, x, residual, meta, rows if i == last else None)
        if rows is not None and not len(rows):
            return x
        return self.norm(x, residual)[0]


@register_model("LlamaForCausalLM")
class LlamaForCausalLM(nn.Module):
    """Llama 2/3 and Mistral; the base of the family.

    `fused_kernels`: RMSNorm, SiLU-and-mul and rotary run as Triton kernels (GPU) instead of
    chains of torch ops, and one-row matrix products as the Triton `gemv`.
    """

    qkv_bias_always = False
    attention_bias_on: tuple[str, ...] = ("qkv", "o")  # what `attention_bias` puts a bias on
    qk_norm = False

    def __init__(self, config: ModelConfig, fused_kernels: bool = False) -> None:
        super().__init__()
        if config.tensor_parallel_size != tp_size():
            raise ValueError(
                f"the model config is split over tensor_parallel_size="
                f"{config.tensor_parallel_size} ranks but this process's tensor-parallel group "
                f"has {tp_size()}: join the group (distributed.init_tensor_parallel) and split "
                f"the config (ModelConfig.with_tensor_parallel) with the same size"
            )
        self.config = config
        self.fused_kernels = fused_kernels
        self.model = DecoderModel(
            config, biases=self.biases(config), qk_norm=self.qk_norm, fused=fused_kernels
        )
        tied = config.tie_word_embeddings
        # Tied: the head's weight is the embedding's (one parameter, model.embed_tokens.weight),
        # so its own is never allocated.
        with torch.device("meta") if tied else contextlib.nullcontext():
            self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, fused_kernels)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def biases(cls, config: ModelConfig) -> AttentionBiases:
        """Which attention projections carry a bias: q/k/v always (Qwen2), and those the
        family ties to `attention_bias` (Llama and Qwen3: q/k/v and o; Mistral: none)."""
        on = config.attention_bias
        return AttentionBiases(
            qkv=cls.qkv_bias_always or (on and "qkv" in cls.attention_bias_on),
            o=on and "o" in cls.attention_bias_on,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] of the step's flat batch, or only those at
        `rows` (the rows that sample: a prompt chunk's last). Every row's keys and values are
        stored either way, and the last layer works past its attention on `rows` alone: the
        other rows' outputs there feed nothing (llama.cpp's `inp_out_ids`). A row's result is
        the same either way, up to the products' rounding at another row count."""
        return self.model(input_ids, positions, meta, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits at `hidden`'s rows; under tensor parallelism on rank 0 only (None past it)."""
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor a Hugging Face checkpoint of this config holds, by name."""
        h, i = config.hidden_size, config.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
        for n in range(config.num_layers):
            p = f"model.layers.{n}."
            shapes[p + "self_attn.q_proj.weight"] = (config.q_size, h)
            shapes[p + "self_attn.k_proj.weight"] = (config.kv_size, h)
            shapes[p + "self_attn.v_proj.weight"] = (config.kv_size, h)
            biases = cls.biases(config)
            if biases.qkv:
                shapes[p + "self_attn.q_proj.bias"] = (config.q_size,)
                shapes[p + "self_attn.k_proj.bias"] = (config.kv_size,)
                shapes[p + "self_attn.v_proj.bias"] = (config.kv_size,)
            shapes[p + "self_attn.o_proj.weight"] = (h, config.q_size)
            if biases.o:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if cls.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, h)
        return shapes

    def _locate(self, name: str) -> tuple[str, str, int | None]:
        """(module, parameter kind, shard) a checkpoint tensor fills: q/k/v and gate/up one
        shard of their fused layer, any other tensor its own module's parameter (None)."""
        module_name, _, param_kind = name.rpartition(".")
        parent_name, _, proj = module_name.rpartition(".")
        if proj not in _FUSED_SHARDS:
            return module_name, param_kind, None
        fused, shard = _FUSED_SHARDS[proj]
        return f"{parent_name}.{fused}", param_kind, shard

    def weight_target(self, name: str) -> tuple[str, int | None]:
        """(parameter, first row) a checkpoint tensor fills: q/k/v and gate/up fill a shard of
        their fused matrix (first row its offset on this rank), any other tensor its own
        (None)."""
        module_name, param_kind, shard = self._locate(name)
        target = f"{module_name}.{param_kind}"
        if shard is None:
            return target, None
        return target, self.get_submodule(module_name).shard_offset(shard)

    def weight_slice(self, name: str) -> TensorSlice | None:
        """The part of checkpoint tensor `name` this rank holds; None: all of it."""
        module_name, param_kind, shard = self._locate(name)
        slice_of = getattr(self.get_submodule(module_name), "checkpoint_slice", None)
        return None if slice_of is None else slice_of(param_kind, shard or 0)

    @torch.no_grad()
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor | PackedWeight]]) -> None:
        """Copy checkpoint tensors (this rank's slices of them, `weight_slice`) into the model,
        fusing q/k/v and gate/up as they come. A `PackedWeight` fills a linear layer that was
        packed (`Linear.pack_`) before loading. A vocabulary slice shorter than its padded
        parameter fills the parameter's first rows."""
        params = dict(self.named_parameters())
        for name, tensor in tensors:
            target, first_row = self.weight_target(name)
            if isinstance(tensor, PackedWeight):
                layer = self.get_submodule(target.rpartition(".")[0])
                layer.packed.copy_rows_(first_row or 0, tensor)
            elif target in params:
                param = params[target]
                if first_row is not None or param.shape != tensor.shape:
                    param = param.narrow(0, first_row or 0, tensor.shape[0])
                param.copy_(tensor)


@register_model("MistralForCausalLM")
class MistralForCausalLM(LlamaForCausalLM):
    attention_bias_on = ()  # transformers' Mistral has no attention biases at all


@register_model("Qwen2ForCausalLM")
class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_always = True
    attention_bias_on = ()  # q/k/v always; o never


@register_model("Qwen3ForCausalLM")
class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
