"""`serve_app`: run a FastAPI app on a free loopback port for the test; its base URL."""

import gc
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI


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

    # The scripted servers keep known delays in a thread of this process, whose heap (every test
    # so far) a full collection walks for long enough to stretch those delays while the bench
    # times them: out of the collector's sweeps while they run, as `met serve` keeps its own.
    gc.collect()
    gc.freeze()
    try:
        yield start
    finally:
        gc.unfreeze()
    for server, thread in servers:
        server.should_exit = True
        thread.join(5)
