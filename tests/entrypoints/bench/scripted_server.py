"""A scripted OpenAI/Anthropic streaming server with known delays: the first chunk after
TTFT_S, then one token every GAP_S, on each of the three endpoints; no /metrics."""

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TTFT_S, GAP_S = 0.10, 0.02
OUTPUT_LEN = 6


def scripted_app(
    fail_request: int | None = None, hang: bool = False, bodies: list | None = None
) -> FastAPI:
    """`bodies`, when given, collects every generating request's JSON body."""
    app = FastAPI()
    seen = {"n": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    async def events(kind: str, n: int):
        if hang:
            await asyncio.sleep(60)
        if kind == "chat":  # a role chunk at once: not output, so not the TTFT
            yield {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        if kind == "messages":
            yield {"type": "message_start", "message": {"usage": {"input_tokens": 3}}}
        await asyncio.sleep(TTFT_S)
        for i in range(n):
            if i:
                await asyncio.sleep(GAP_S)
            if kind == "completions":
                yield {"choices": [{"index": 0, "text": f" t{i}"}]}
            elif kind == "chat":
                yield {"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}
            else:
                yield {
                    "type": "content_block_delta",
                    "delta": {"type": "text_delta", "text": f" t{i}"},
                }
        if kind == "messages":
            yield {"type": "message_delta", "usage": {"output_tokens": n}}
        else:
            yield {"choices": [], "usage": {"completion_tokens": n}}

    def streamed(kind: str):
        async def handler(request: Request):
            body = await request.json()
            seen["n"] += 1
            if bodies is not None:
                bodies.append(body)
            if seen["n"] == fail_request:
                return JSONResponse({"error": {"message": "scripted failure"}}, 500)
            n = body.get("max_tokens") or body.get("max_completion_tokens")

            async def sse():
                async for event in events(kind, n):
                    yield f"data: {json.dumps(event)}\n\n"
                if kind != "messages":
                    yield "data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")

        return handler

    app.post("/v1/completions")(streamed("completions"))
    app.post("/v1/chat/completions")(streamed("chat"))
    app.post("/v1/messages")(streamed("messages"))
    return app
