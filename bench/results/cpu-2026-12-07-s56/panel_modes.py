"""A decode step's 33 panel products at ROWS rows, the modes of a temporary PANEL_MODE switch
alternating round by round (README.md, section 1)."""

import os
import statistics
import sys
import time

import torch

from metrale.kernels import cpu_extension

cpu_extension.enabled()
torch.set_num_threads(int(os.environ.get("TH", "2")))
SHAPES = [(1024, 512), (512, 512), (3072, 512), (512, 1536)] * 8 + [(8192, 512)]
ws = [cpu_extension.pack_panels(torch.randn(n, k)) for n, k in SHAPES]
rows = int(sys.argv[1])
modes = sys.argv[2].split(",")
cached = sys.argv[3] == "cached" if len(sys.argv) > 3 else False
if cached:
    ws = ws[:4] * 8 + [ws[-1]]
xs = {k: torch.randn(rows, k) for k in (512, 1536)}


def step():
    for (n, k), p in zip(SHAPES, ws, strict=False):
        torch.ops.metrale_cpu.panel_linear(xs[k], p, None, n)


ref = None
for m in modes:
    os.environ["PANEL_MODE"] = m
    out = torch.ops.metrale_cpu.panel_linear(xs[1536], ws[3], None, 512)
    if ref is None:
        ref = out
    assert torch.equal(out, ref), m
res = {m: [] for m in modes}
for _r in range(12):
    for m in modes:
        os.environ["PANEL_MODE"], os.environ["PANEL_DIST"] = ([*m.split(":"), "128"])[:2]
        step()
        t = time.perf_counter()
        for _ in range(4):
            step()
        res[m].append((time.perf_counter() - t) / 4 * 1e3)
for m in modes:
    v = sorted(res[m])
    print(
        f"rows {rows} {'cached' if cached else 'stream'} mode {m}:",
        f"median {statistics.median(v):.2f} ms, p20 {v[len(v) // 5]:.2f}, min {v[0]:.2f}",
    )
