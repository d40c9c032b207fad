"""Build the demo tokenizer shipped in metrale/demo/tokenizer/.

The demo checkpoint needs a real tokenizer so that the whole serving path (chat template,
encode, incremental detokenization, tool-call and reasoning tags) runs without downloading
anything. This script trains a small byte-level BPE (the GPT-2/Qwen family: any byte sequence
is encodable, decoding is lossy UTF-8) on a corpus that every Python 3.11 install carries, so
rerunning it on the same Python gives byte-identical files.

Run from the repository root:  python scripts/build_demo_tokenizer.py
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

# Training is deterministic only on one thread: word counting is parallel and order-dependent.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 4096
OUTPUT_DIR = Path(__file__).resolve().parent.parent / "metrale" / "demo" / "tokenizer"

# Ids 0..8, in this order: the three ChatML specials, then the tags that must survive
# skip_special_tokens because the reasoning and tool-call parsers read them (as in Qwen3).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAG_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

# Qwen2/Qwen3's pre-tokenizer split: contractions, words with one leading non-letter, single
# digits, punctuation runs, newlines, and spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Stdlib modules whose docstrings form the English part of the corpus.
CORPUS_MODULES = (
    "argparse",
    "asyncio",
    "bisect",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "email.message",
    "enum",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "random",
    "re",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
)

# A few lines per script so that multi-byte characters get merges of their own.
MULTILINGUAL_LINES = (
    "Le café est très bon, mais la crème brûlée est déjà partie. Où est le garçon ?",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Schöne Grüße aus München!",
    "El niño comió piña en la montaña. ¿Dónde está la estación? ¡Qué día tan soleado!",
    "Ação, coração e informação são palavras comuns em português.",
    "Dziękuję bardzo! Zażółć gęślą jaźń. Čeština, slovenčina, hrvatski jezik.",
    "Привет, мир! Как дела? Москва — столица России.",
    "Γειά σου κόσμε! Η γλώσσα είναι ελληνική.",
    "你好，世界！我们今天去公园散步。中文分词需要多字节合并。",
    "人工智能模型可以生成文本、回答问题和调用工具。",
    "こんにちは、世界！東京は日本の首都です。ありがとうございます。",
    "안녕하세요, 세계! 오늘 날씨가 좋네요.",
    "مرحبا بالعالم! كيف حالك اليوم؟",
    "שלום עולם! מה שלומך?",
    "नमस्ते दुनिया! आप कैसे हैं?",
    "Emoji: 😀 😂 🤖 🚀 ✨ 👍 🎉 ❤️ 🔥 🌍 👋🏽 👨‍👩‍👧",
)

# Chat-shaped text: the demo model sees ChatML, JSON tool calls and reasoning tags most.
CHAT_LINES = (
    "You are a helpful assistant. Answer the user's question concisely.",
    "What is the weather like in Paris today?",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"type": "function", "function": {"name": "search", "description": "Search the web.", '
    '"parameters": {"type": "object", "properties": {"query": {"type": "string"}}, '
    '"required": ["query"]}}}',
    "Let me think about this step by step. First, I need to find the relevant facts.",
    "The answer is 42. Is there anything else I can help you with?",
    "def add(a: int, b: int) -> int:\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
)

CHAT_TEMPLATE = """\
{#- metrale demo chat template: ChatML in the style of Qwen3.
    Roles: system, user, assistant (content, reasoning_content, tool_calls) and tool.
    Tools go into the system turn; tool results are grouped into one user turn.
    Reasoning is shown only for assistant turns after the last user query, as in Qwen3;
    enable_thinking=false closes an empty <think> block in the generation prompt. -#}
{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(system='', last_query_index=-1) %}
{%- if messages and messages[0].role == 'system' %}
    {%- set ns.system = text_of(messages[0].content) %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query_index = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if ns.system %}
        {{- ns.system + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
    {{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif ns.system %}
    {{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = text_of(message.content) %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\\n' + content + '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query_index and (reasoning or loop.last) %}
            {{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}
            {%- set content = content.lstrip('\\n') %}
        {%- endif %}
        {{- content }}
        {%- for tool_call in message.tool_calls | default([], true) %}
            {%- set call = tool_call.function if tool_call.function is defined else tool_call %}
            {%- if content or not loop.first %}
                {{- '\\n' }}
            {%- endif %}
            {{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}
                {{- call.arguments }}
            {%- else %}
                {{- call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unknown message role "' ~ message.role ~ '": '
            ~ 'expected system, user, assistant or tool') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def stdlib_docstrings() -> list[str]:
    """Docstrings of CORPUS_MODULES and their public members, in a fixed order."""
    docs: list[str] = []
    for module_name in CORPUS_MODULES:
        module = importlib.import_module(module_name)
        docs.append(inspect.getdoc(module) or "")
        for name in sorted(vars(module)):
            member = getattr(module, name)
            if name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
                continue
            docs.append(inspect.getdoc(member) or "")
    return [doc for doc in docs if doc]


def corpus() -> list[str]:
    # Repeat the short hand-written lines so their pairs pass min_frequency.
    return stdlib_docstrings() + list(MULTILINGUAL_LINES) * 8 + list(CHAT_LINES) * 8


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[*SPECIAL_TOKENS, *TAG_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    # The trainer registers every reserved token as special; the tags must not be, or
    # skip_special_tokens would strip them before the reasoning and tool parsers see them.
    tokenizer_json = json.loads(tokenizer.to_str())
    for added in tokenizer_json["added_tokens"]:
        added["special"] = added["content"] in SPECIAL_TOKENS
    return Tokenizer.from_str(json.dumps(tokenizer_json))


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    added_tokens_decoder = {
        str(token_id): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for token_id, token in sorted(tokenizer.get_added_tokens_decoder().items())
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def check(tokenizer: Tokenizer) -> None:
    """Fail loudly if training produced something the demo cannot rely on."""
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise SystemExit(
            f"trained vocab has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}: "
            "the corpus is too small for VOCAB_SIZE"
        )
    for token_id, content in enumerate((*SPECIAL_TOKENS, *TAG_TOKENS)):
        if tokenizer.token_to_id(content) != token_id:
            raise SystemExit(
                f"{content} has id {tokenizer.token_to_id(content)}, expected {token_id}"
            )
    for text in (*MULTILINGUAL_LINES, *CHAT_LINES):
        if tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) != text:
            raise SystemExit(f"encode/decode does not round-trip: {text!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    output_dir: Path = parser.parse_args().output_dir
    if sys.version_info[:2] != (3, 11):
        print(
            f"warning: the corpus comes from Python 3.11's stdlib; on {sys.version.split()[0]} "
            "the trained vocabulary will differ from the shipped one",
            file=sys.stderr,
        )
    tokenizer = build_tokenizer()
    check(tokenizer)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(output_dir / "tokenizer.json"), pretty=True)
    config_json = json.dumps(tokenizer_config(tokenizer), indent=2, ensure_ascii=False)
    (output_dir / "tokenizer_config.json").write_text(config_json + "\n", encoding="utf-8")
    (output_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    print(f"wrote {output_dir} (vocab size {tokenizer.get_vocab_size(with_added_tokens=True)})")


if __name__ == "__main__":
    main()
