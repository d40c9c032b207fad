"""A tiny Qwen3 checkpoint whose weights spell fixed replies, for end-to-end tests.

`build_scripted_checkpoint(out, {keyword: reply_text, ...})` writes a real Hugging Face Qwen3
checkpoint (one decoder layer, the demo tokenizer and chat template) that greedy-decodes, after a
chat prompt rendered with the generation prompt, exactly the canonical tokens of the reply whose
keyword token appears in the prompt, then ``<|im_end|>``. So a test can drive the whole server
(engine included) and know the model's text byte for byte. `after_tool={keyword: text}` gives a
keyword a second reply, written when the prompt's last turn is a tool result: an agent's loop
(call a tool, send its result back) then gets a final answer instead of the same call again.

Why not "the next token is a function of the current token" (one-hot embeddings, attention and
MLP zeroed, an lm_head mapping each token to its successor)? Reply tokens repeat with different
successors, and no choice of text avoids it: ``\n`` (the vocabulary's one lone-newline token)
is the generation prompt's last token, so it must lead to the reply's first token, and it also
follows ``<tool_call>``; ``": "`` leads to the function name and to an argument value; a second
call repeats the first call's opening. The state is therefore the shortest suffix of the token
history that tells the successor apart, and the weights are a lookup table over such suffixes.
Token identities stay one-hot, but only for the few dozen tokens the replies and the generation
prompt use (every other token embeds to the constant dimension alone), so the hidden size stays
in the hundreds.

* Context. Head ``o`` (o = 1 .. C-1) attends to the token ``o`` positions back and copies its
  identity into block ``o`` of the residual stream; the embedding puts the current token in
  block 0. The aim is by rotary phase alone: every key is the same vector (built from a
  constant residual dimension), and the query is that vector turned back by ``o`` steps on the
  twelve fastest rotary pairs, so the score peaks at distance ``o`` with a margin of about 45
  over every other distance up to 4,096 (all other positions together weigh below 1e-16).
* Which reply. One more head attends by content only (on the slowest rotary pair, which turns
  by about 1e-3 rad over 1,000 positions) to the keyword tokens and writes which keyword it saw.
  The prompt must hold exactly one keyword; without one, nothing matches (see below).
* The table. For each state of each reply, the shortest suffix of its history that no other
  state of the same reply shares with a different successor becomes one MLP unit:
  ``silu(G * (sum of the suffix's slots - (len - 0.5) * const)) * keyword_slot`` is about 40
  times its scale when the whole suffix and the keyword match, and below 1e-15 when any token
  differs; `down_proj` writes the successor's own output dimension, and `lm_head` maps that
  dimension to the successor's row alone. Any unit that fires agrees on the successor, by the
  choice of suffix lengths. Histories start at the prompt's last ``<|im_end|>`` (the rest of
  the prompt varies), so a reply that needs more look-back than that is refused.
* After a tool result. The demo template ends a tool turn with ``</tool_response><|im_end|>``
  and no other turn ends so, so the token before the last ``<|im_end|>`` tells the two replies
  of a keyword apart. Such a keyword's histories start one token earlier: ``</tool_response>``
  for its after-tool reply, "any token but ``</tool_response>``" for its plain one, and the
  table is built over the states of both, so a state they share (the generation prompt, a
  common opening) gets a suffix that reaches that token. A unit needs ``</tool_response>``
  there like any other token; a plain one weighs that token's slot at ``-G`` instead, so it
  fires without it and falls to ``-40`` with it. Keywords without a second reply keep their
  histories and write their reply after a tool result too.
* A fallback. The constant dimension feeds ``<|im_end|>``'s logit a little: in a state no
  unit knows (no keyword, a continuation past the script), the reply ends at once.

The successor's logit is about 50 and every other one is 0 (``<|im_end|>`` about 6), so
sampling at any temperature picks it too. For the server tests' five replies the checkpoint is
about 30 MB in fp32 (mostly the embedding and lm_head rows of the 4,096-token vocabulary) and
builds in a tenth of a second.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from metrale.config import ModelConfig
from metrale.models import model_class_for
from metrale.tokenizer import Tokenizer
from tests.conftest import TOKENIZER_FILES, demo_tokenizer_dir

HEAD_DIM = 128
ROPE_THETA = 1e6
AIM_PAIRS = range(12)  # the fastest rotary pairs: neighbouring distances differ most there
KEYWORD_PAIR = HEAD_DIM // 2 - 1  # the slowest rotary pair
QK_NORM_WEIGHT = 6.0
GATE_MARGIN = 40.0  # a unit's pre-activation: +40 on a match, -40 or less on a miss
OUTPUT_SCALE = 10.0  # the successor's dimension against the residual's ones
SUCCESSOR_LOGIT = 50.0
FALLBACK_LOGIT = 20.0


@dataclass(frozen=True)
class ScriptedReply:
    keyword: str
    keyword_id: int
    text: str
    token_ids: tuple[int, ...]  # the reply's canonical tokens, without the final <|im_end|>
    after_tool: bool = False  # written when the prompt's last turn is a tool result


@dataclass(frozen=True)
class ScriptedCheckpoint:
    path: Path
    replies: dict[str, ScriptedReply]  # by keyword
    after_tool_replies: dict[str, ScriptedReply]  # by keyword; those with a second reply only
    context_len: int  # the longest suffix any state needs: the number of look-back heads + 1


@dataclass(frozen=True)
class _Except:
    """A history position that holds any token but `token_id` (what precedes a plain reply's
    ``<|im_end|>`` when the keyword also has an after-tool reply: anything but
    ``</tool_response>``)."""

    token_id: int


_Token = int | _Except


@dataclass(frozen=True)
class _Unit:
    keyword_index: int
    context: tuple[_Token, ...]  # oldest first; the last one is the current token
    successor: int


def generation_prompt_tail(tokenizer: Tokenizer) -> list[int]:
    """The token ids every chat prompt ends with: the last turn's end and the generation prompt."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    ids = tokenizer.encode(text, add_special_tokens=False)
    end_id = tokenizer.token_to_id("<|im_end|>")
    return ids[len(ids) - 1 - ids[::-1].index(end_id) :]


def _table(
    tokenizer: Tokenizer,
    tail: Sequence[int],
    replies: Sequence[ScriptedReply],
    after_tool: Mapping[str, ScriptedReply],
) -> list[_Unit]:
    """One unit per (reply, state), with the shortest suffix that decides its successor.

    A keyword's states are those of its plain reply and of its after-tool reply, if any; then
    both histories start one token before the prompt's last ``<|im_end|>``, where only the
    after-tool one has ``</tool_response>``.
    """
    eos_id = tokenizer.token_to_id("<|im_end|>")
    tool_end_id = tokenizer.token_to_id("</tool_response>")
    units: dict[tuple[int, tuple[_Token, ...]], int] = {}
    for k, reply in enumerate(replies):
        second = after_tool.get(reply.keyword)
        scripts: list[tuple[ScriptedReply, list[_Token]]] = [(reply, [*tail])]
        if second is not None:
            scripts = [(reply, [_Except(tool_end_id), *tail]), (second, [tool_end_id, *tail])]
        states = [
            (script, seq[: i + 1], seq[i + 1])
            for script, prefix in scripts
            for seq in [[*prefix, *script.token_ids, eos_id]]
            for i in range(len(prefix) - 1, len(seq) - 1)
        ]
        for script, history, successor in states:
            for length in range(1, len(history) + 1):
                suffix = history[-length:]
                clash = any(
                    other_next != successor and _may_meet(suffix, other)
                    for _, other, other_next in states
                )
                if not clash:
                    break
            else:
                text = tokenizer.decode(
                    [t for t in history if isinstance(t, int)], skip_special_tokens=False
                )
                rivals = {
                    rival.after_tool
                    for rival, other, other_next in states
                    if other_next != successor and _may_meet(history, other)
                }
                if rivals == {script.after_tool}:
                    which = "after-tool reply" if script.after_tool else "reply"
                    raise ValueError(
                        f"{which} {script.keyword!r} continues {text!r} in two ways even with "
                        "all of its history: make the repeated stretches of the reply differ "
                        "sooner"
                    )
                raise ValueError(
                    f"the reply and the after-tool reply of {script.keyword!r} continue {text!r} "
                    "in two ways even with all of their history: make their repeated stretches "
                    "differ sooner"
                )
            units[(k, tuple(suffix))] = successor
    return [_Unit(k, context, successor) for (k, context), successor in units.items()]


def _may_meet(suffix: Sequence[_Token], history: Sequence[_Token]) -> bool:
    """Whether one prompt can end with both: a history says nothing before its first token."""
    n = min(len(suffix), len(history))
    return all(_may_be_one(a, b) for a, b in zip(suffix[-n:], history[-n:], strict=True))


def _may_be_one(a: _Token, b: _Token) -> bool:
    if isinstance(a, _Except):
        return isinstance(b, _Except) or b != a.token_id
    if isinstance(b, _Except):
        return a != b.token_id
    return a == b


def _token_id(token: _Token) -> int:
    return token.token_id if isinstance(token, _Except) else token


def build_scripted_checkpoint(
    out: Path, replies: Mapping[str, str], after_tool: Mapping[str, str] | None = None
) -> ScriptedCheckpoint:
    """Write the checkpoint to `out`: for a prompt holding keyword K, it replies `replies[K]`,
    or `after_tool[K]` where K has one and the prompt's last turn is a tool result.

    Each keyword must be one token of the demo tokenizer (``" harmonic"``, with its space, as
    it follows another word) and appear in no reply. A keyword without an after-tool reply
    writes its reply after a tool result too.
    """
    tokenizer = Tokenizer.from_dir(demo_tokenizer_dir())
    eos_id = tokenizer.token_to_id("<|im_end|>")
    tail = generation_prompt_tail(tokenizer)
    after_tool = after_tool or {}
    if unknown := sorted(set(after_tool) - set(replies)):
        raise ValueError(
            f"after-tool keywords {unknown} have no reply: add what they write before a tool "
            "result to `replies`"
        )
    scripted = [
        _scripted_reply(tokenizer, k, text, after_tool=False) for k, text in replies.items()
    ]
    seconds = {
        k: _scripted_reply(tokenizer, k, text, after_tool=True) for k, text in after_tool.items()
    }
    units = _table(tokenizer, tail, scripted, seconds)

    context_len = max(len(u.context) for u in units)
    used = sorted({_token_id(t) for u in units for t in u.context})  # tokens some context reads
    successors = sorted({u.successor for u in units})
    keyword_ids = [r.keyword_id for r in scripted]
    written = {t for r in [*scripted, *seconds.values()] for t in r.token_ids}
    clashing = set(keyword_ids) & (written | set(tail) | set(used))
    if clashing or len(set(keyword_ids)) != len(keyword_ids):
        raise ValueError(f"keywords must be distinct and in no reply: {clashing or keyword_ids}")
    if len(used) > HEAD_DIM or len(scripted) > HEAD_DIM:
        raise ValueError(f"{len(used)} context tokens; a head copies at most {HEAD_DIM}")

    # Residual layout: [const | context blocks 0..C-1, one slot per used token | keywords | out].
    slot = {t: i for i, t in enumerate(used)}
    n_used, n_keywords = len(used), len(scripted)
    const = 0

    def block(offset: int, token: int) -> int:
        return 1 + offset * n_used + slot[token]

    keyword_dim = 1 + context_len * n_used
    out_dim = {t: keyword_dim + n_keywords + i for i, t in enumerate(successors)}
    hidden = _round_up(keyword_dim + n_keywords + len(successors), 16)
    num_heads = context_len  # C-1 look-back heads and the keyword head
    q_size = num_heads * HEAD_DIM
    intermediate = _round_up(len(units), 16)
    vocab = tokenizer.vocab_size

    # A token's normalized embedding holds sqrt(hidden / 2) in each of its two dimensions; the
    # MLP and the final norm see at most `context_len + 2` dimensions of about one.
    source_scale = math.sqrt(hidden / 2)
    mlp_scale = math.sqrt(hidden / (context_len + 2))

    embed = torch.zeros(vocab, hidden)
    embed[:, const] = 1.0
    for t in used:
        embed[t, block(0, t)] = 1.0
    for k, t in enumerate(keyword_ids):
        embed[t, keyword_dim + k] = 1.0

    q_proj, k_proj, v_proj = (torch.zeros(q_size, hidden) for _ in range(3))
    o_proj = torch.zeros(hidden, q_size)
    half = HEAD_DIM // 2
    for offset in range(1, context_len):
        base = (offset - 1) * HEAD_DIM
        for j in AIM_PAIRS:
            freq = ROPE_THETA ** (-2 * j / HEAD_DIM)
            q_proj[base + j, const] = math.cos(freq * offset)
            q_proj[base + half + j, const] = -math.sin(freq * offset)
            k_proj[base + j, const] = 1.0
        for t in used:
            v_proj[base + slot[t], block(0, t)] = 1.0
            o_proj[block(offset, t), base + slot[t]] = 1.0 / source_scale
    base = (num_heads - 1) * HEAD_DIM
    q_proj[base + KEYWORD_PAIR, const] = 1.0
    for k in range(n_keywords):
        k_proj[base + KEYWORD_PAIR, keyword_dim + k] = 1.0
        v_proj[base + k, keyword_dim + k] = 1.0
        o_proj[keyword_dim + k, base + k] = 1.0 / source_scale

    gate = 2 * GATE_MARGIN / mlp_scale
    gate_proj, up_proj = torch.zeros(intermediate, hidden), torch.zeros(intermediate, hidden)
    down_proj = torch.zeros(hidden, intermediate)
    for n, unit in enumerate(units):
        for offset, token in enumerate(reversed(unit.context)):
            # An excepted token costs a whole match: the unit falls to -GATE_MARGIN with it.
            sign = -1.0 if isinstance(token, _Except) else 1.0
            gate_proj[n, block(offset, _token_id(token))] = sign * gate
        num_required = sum(isinstance(t, int) for t in unit.context)
        gate_proj[n, const] = -gate * (num_required - 0.5)
        up_proj[n, keyword_dim + unit.keyword_index] = 1.0
        down_proj[out_dim[unit.successor], n] = OUTPUT_SCALE / (GATE_MARGIN * mlp_scale)

    lm_head = torch.zeros(vocab, hidden)
    for t, dim in out_dim.items():
        lm_head[t, dim] = SUCCESSOR_LOGIT / math.sqrt(hidden)
    lm_head[eos_id, const] = FALLBACK_LOGIT / mlp_scale

    prefix = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": embed,
        prefix + "self_attn.q_proj.weight": q_proj,
        prefix + "self_attn.k_proj.weight": k_proj,
        prefix + "self_attn.v_proj.weight": v_proj,
        prefix + "self_attn.o_proj.weight": o_proj,
        prefix + "self_attn.q_norm.weight": torch.full((HEAD_DIM,), QK_NORM_WEIGHT),
        prefix + "self_attn.k_norm.weight": torch.full((HEAD_DIM,), QK_NORM_WEIGHT),
        prefix + "mlp.gate_proj.weight": gate_proj,
        prefix + "mlp.up_proj.weight": up_proj,
        prefix + "mlp.down_proj.weight": down_proj,
        prefix + "input_layernorm.weight": torch.ones(hidden),
        prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": lm_head,
    }
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "torch_dtype": "float32",
        "eos_token_id": eos_id,
        "bos_token_id": None,
    }
    model_config = ModelConfig.from_hf(config)
    shapes = model_class_for(model_config.architecture).checkpoint_shapes(model_config)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id]}) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(demo_tokenizer_dir() / name, out / name)
    return ScriptedCheckpoint(
        path=out,
        replies={r.keyword: r for r in scripted},
        after_tool_replies=seconds,
        context_len=context_len,
    )


def _scripted_reply(
    tokenizer: Tokenizer, keyword: str, text: str, *, after_tool: bool
) -> ScriptedReply:
    keyword_ids = tokenizer.encode(keyword, add_special_tokens=False)
    if len(keyword_ids) != 1:
        raise ValueError(f"keyword {keyword!r} is {len(keyword_ids)} tokens; it must be one")
    token_ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == text
    return ScriptedReply(keyword, keyword_ids[0], text, token_ids, after_tool)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
