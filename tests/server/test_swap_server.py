"""`met serve --swap-space-gb`: concurrent streams through a KV pool too small for them are
swapped to host memory and back, answer what each gives alone, and `/memory` and `/metrics` say
what moved."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai

from tests.server.conftest import MODEL_NAME, serving

PROMPTS = [[10 + 37 * i + j for j in range(5 + 7 * i)] for i in range(8)]


def completion(client: openai.AsyncOpenAI, prompt: list[int]):
    return client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=48,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def test_a_swap_storm_through_the_server(qwen3_dir, tmp_path):
    # 16 blocks of 16 tokens hold 256; the eight requests reach 580 together.
    flags = ("--num-kv-blocks", "16", "--swap-space-gb", "0.01", "--preemption-mode", "swap")
    with serving(qwen3_dir, tmp_path / "server.log", *flags, "--no-prefix-caching") as server:
        client = openai.AsyncOpenAI(base_url=server.api_url, api_key="unused", max_retries=0)

        async def main() -> tuple[list[str], list[str]]:
            alone = [(await completion(client, p)).choices[0].text for p in PROMPTS]
            together = await asyncio.gather(*(completion(client, p) for p in PROMPTS))
            return alone, [c.choices[0].text for c in together]

        alone, together = asyncio.run(main())
        assert together == alone
        memory = httpx.get(server.base_url + "/memory").json()
        swap = memory["swap"]
        assert swap["blocks_out"] > 0 and swap["blocks_in"] > 0, swap
        assert swap["blocks_used"] == 0 and swap["requests_swapped"] == 0
        assert swap["bytes_out"] == swap["blocks_out"] * swap["bytes_per_block"]
        assert swap["measured_copy_bytes_per_s"] > 0
        assert memory["requests"]["recomputed_tokens"] == 0
        assert memory["kv_cache"]["blocks_used"] == 0
        metrics = httpx.get(server.base_url + "/metrics").text
        out = re.search(r'metrale:swapped_blocks_total\{[^}]*direction="out"[^}]*\} (\S+)', metrics)
        assert out is not None and float(out.group(1)) == swap["blocks_out"], metrics[-2000:]
