"""The engine alone on peer_cpu.py's 32 requests, 16 streams at a time and one (the server's
256-token prompt chunks, prefix cache off), as `offline_streams.py` runs it: one round of the
metrale importable in this process (run it with PYTHONPATH=<a tree> to measure another). Prints
a JSON line; `tree_ab.sh` alternates two trees."""

import json
import subprocess
import sys

sys.path.insert(0, "/work/main/bench")
import offline_streams
from requests16 import chunked_engine, token_prompts

import metrale

prompts = token_prompts()
llm = chunked_engine()
offline_streams.run(llm, prompts[:4], 4, 16)
root = metrale.__file__.rsplit("/metrale/", 1)[0]
sha = (
    subprocess.run(
        ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    or root
)
print(
    json.dumps(
        {
            "tree": sha,
            "16_streams": offline_streams.run(llm, prompts, 16, 128),
            "1_stream": offline_streams.run(llm, prompts[:4], 1, 128),
        }
    ),
    flush=True,
)
