"""`met bench serve` end to end against a scripted server with known delays: the first chunk
after TTFT_S, then one token every GAP_S, for each of the three endpoints."""

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from metrale import demo
from metrale.entrypoints.cli import main

TTFT_S, GAP_S = 0.10, 0.02
OUTPUT_LEN = 6


def scripted_app(fail_request: int | None = None, hang: bool = False) -> FastAPI:
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


@pytest.fixture
def serve_app():
    servers = []

    def start(app: FastAPI) -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(5)


def bench(url: str, tmp_path, *extra: str) -> dict:
    out = tmp_path / "r.json"
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            url,
            "--tokenizer",
            str(demo.ensure_checkpoint()),
            "--input-len",
            "16",
            "--output-len",
            str(OUTPUT_LEN),
            "--num-prompts",
            "6",
            "--disable-progress",
            "--result-file",
            str(out),
            *extra,
        ]
    )
    doc = json.loads(out.read_text())
    doc["exit_code"] = code
    return doc


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_metrics_match_the_scripted_delays(serve_app, tmp_path, endpoint):
    url = serve_app(scripted_app(fail_request=3))
    doc = bench(
        url,
        tmp_path,
        "--endpoint",
        endpoint,
        "--max-concurrency",
        "2",
        "--no-warmup",
        "--goodput",
        "ttft:1000",
        "tpot:1000",
    )
    (target,) = doc["targets"]
    assert target["model"] == "scripted"  # read off /v1/models
    (run,) = target["runs"]
    assert run["completed"] == 5 and run["failed"] == 1
    assert run["errors"] == {"HTTP 500": 1}
    assert run["total_output_tokens"] == 5 * OUTPUT_LEN  # the usage's count
    assert run["total_input_tokens"] == 5 * 16  # token-exact random prompts
    assert TTFT_S * 1e3 <= run["mean_ttft_ms"] < TTFT_S * 1e3 + 60
    assert GAP_S * 1e3 <= run["median_itl_ms"] < GAP_S * 1e3 + 15
    expected_e2el = 1e3 * (TTFT_S + (OUTPUT_LEN - 1) * GAP_S)
    assert expected_e2el <= run["mean_e2el_ms"] < expected_e2el + 80
    assert run["mean_tpot_ms"] == pytest.approx(
        (run["mean_e2el_ms"] - run["mean_ttft_ms"]) / (OUTPUT_LEN - 1), rel=1e-6
    )  # every request has the same token count, so the means commute
    assert run["request_goodput"] == pytest.approx(run["request_throughput"])
    assert doc["exit_code"] == 0


def test_the_deadline_bounds_a_run_of_hung_requests(serve_app, tmp_path):
    url = serve_app(scripted_app(hang=True))
    start = time.perf_counter()
    doc = bench(url, tmp_path, "--deadline", "1", "--no-warmup")
    assert time.perf_counter() - start < 10
    (run,) = doc["targets"][0]["runs"]
    assert run["completed"] == 0 and run["failed"] == 6
    assert 1.0 <= run["duration"] < 3
    assert doc["exit_code"] == 1  # a run with nothing completed fails the command


def test_a_sweep_and_two_targets_then_plots_and_compare(serve_app, tmp_path, capsys):
    a, b = serve_app(scripted_app()), serve_app(scripted_app())
    doc = bench(
        f"a={a}",
        tmp_path,
        "--base-url",
        f"b={b}",
        "--max-concurrency",
        "1,3",
        "--request-rate",
        "inf",
        "--plot",
        str(tmp_path / "plots"),
    )
    assert [t["name"] for t in doc["targets"]] == ["a", "b"]
    assert [r["max_concurrency"] for r in doc["targets"][0]["runs"]] == [1, 3]
    # three at once overlap: the run takes about a third of the one-at-a-time run
    one, three = doc["targets"][0]["runs"]
    assert three["duration"] < 0.7 * one["duration"]
    for name in ("latency_vs_request_rate", "throughput_vs_concurrency", "ttft_cdf"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 1000
    assert doc["git_sha"] is None or len(doc["git_sha"]) == 40
    capsys.readouterr()
    assert main(["bench", "serve", "--compare", str(tmp_path / "r.json")]) == 0
    table = capsys.readouterr().out
    assert table.count("\na ") == 2 and table.count("\nb ") == 2


def test_a_dead_server_is_a_clear_error(tmp_path, capsys):
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            "http://127.0.0.1:9",
            "--tokenizer",
            str(demo.ensure_checkpoint()),
            "--num-prompts",
            "1",
        ]
    )
    assert code == 2
    assert "is the server up" in capsys.readouterr().err
