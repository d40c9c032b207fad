"""Where a CPU engine step goes (issue 17, item 1): the offline engine on the 33.6M-parameter Llama
of ../shared/peers.md (hidden 512, 8 layers, 8/4 heads of 64, intermediate 1536, vocab 8192),
fp32, 128-token prompts, 128 greedy tokens, at 1 stream and at 16.

For each: wall ms per decode step; cProfile's split of a step among the engine's parts
(scheduling, input preparation, the forward, sampling, output handling); the torch profiler's
top operators by self CPU time, and how many operators a step dispatches; then the step's
one-row products alone against the machine's read bandwidth. Writes a text report.

    python bench/profile_cpu.py [--enforce-eager] [--out bench/results/profile_cpu-DATE.txt]
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from metrale import LLM, SamplingParams
from metrale.engine.messages import EngineRequest

ROOT = Path(__file__).resolve().parent
SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 8192,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}


def _parts() -> dict[str, object]:
    """The functions whose cumulative times split a step."""
    from metrale.engine.scheduler import Scheduler
    from metrale.models.llama import LlamaForCausalLM
    from metrale.runner import sampler
    from metrale.runner.model_runner import ModelRunner
    from metrale.runner.sampling_inputs import SamplingInputs

    return {
        "schedule": Scheduler.schedule,
        "prepare inputs": ModelRunner._prepare_inputs,
        "forward": LlamaForCausalLM.forward,
        "logits": LlamaForCausalLM.compute_logits,
        "sampling metadata": SamplingInputs.metadata,
        "sample": sampler.sample,
        "update (stops, outputs)": Scheduler.update,
    }


def checkpoint(path: Path) -> Path:
    if not (path / "model.safetensors").is_file():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(path)
        tokenizer_dir = ROOT.parent / "metrale" / "demo" / "tokenizer"
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    return path


def add(llm: LLM, streams: int, tag: str, prompt_len: int = 128) -> None:
    g = torch.Generator().manual_seed(streams)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for i in range(streams):
        prompt = torch.randint(10, 4000, (prompt_len,), generator=g).tolist()
        llm.engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params, 0.0))


def decode_steps(llm: LLM, streams: int, tag: str, prompt_len: int = 128) -> list[float]:
    """Wall seconds of each step after the prompts are in (decode steps only: the engine's
    prefill budget must hold all the prompts)."""
    add(llm, streams, tag, prompt_len)
    return timed_decode_steps(llm)


def timed_decode_steps(llm: LLM, prefilled: Callable[[], object] | None = None) -> list[float]:
    """Wall seconds of each step after the next one, which prefills the prompts just added (the
    engine's prefill budget must hold them all); `prefilled` is called after that one."""
    llm.engine.step()
    if prefilled is not None:
        prefilled()
    times = []
    while llm.engine.has_unfinished_requests():
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    return times


def parts_of(stats: pstats.Stats, steps: int) -> dict[str, float]:
    """{part: ms a step}, each a function's cumulative time."""
    out = {}
    for label, fn in _parts().items():
        code = fn.__code__  # type: ignore[attr-defined]
        key = (code.co_filename, code.co_firstlineno, code.co_name)
        row = stats.stats.get(key)  # type: ignore[attr-defined]
        out[label] = 1e3 * row[3] / steps if row else 0.0
    return out


def report(llm: LLM, streams: int, lines: list[str]) -> None:
    decode_steps(llm, streams, f"warm{streams}")
    times = sorted(decode_steps(llm, streams, f"t{streams}"))
    median = times[len(times) // 2]
    lines.append(f"## {streams} stream(s): {1e3 * median:.2f} ms per decode step (median)")
    lines.append(f"   = {streams / median:.0f} output tok/s in decode steps\n")

    profiler = cProfile.Profile()
    profiler.enable()
    steps = len(decode_steps(llm, streams, f"c{streams}"))
    profiler.disable()
    stats = pstats.Stats(profiler)
    step_ms = 1e3 * stats.total_tt / steps  # type: ignore[attr-defined]
    lines.append(f"cProfile, {steps} decode steps, {step_ms:.2f} ms a step under the profiler:")
    for label, ms in parts_of(stats, steps).items():
        lines.append(f"  {label:20s} {ms:7.2f} ms  ({100 * ms / step_ms:4.1f}%)")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    lines.append("top functions by own time:")
    lines += ["  " + line for line in text.getvalue().splitlines()[6:26]]

    add(llm, streams, f"p{streams}")
    llm.engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(16):
            llm.engine.step()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    events = prof.key_averages()
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    lines.append(f"\ntorch profiler, 16 decode steps: {calls / 16:.0f} aten operator calls a step")
    table = events.table(sort_by="self_cpu_time_total", row_limit=18)
    lines += ["  " + line for line in table.splitlines()]
    lines.append("")


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each linear layer's dense weight (read back out of oneDNN's layout where it was
    prepacked and dropped)."""
    from metrale.layers.linear import Linear

    return [
        m.weight.detach() if m.weight is not None else m.onednn.to_dense()
        for m in model.modules()
        if isinstance(m, Linear)
    ]


def matmul_chain(llm: LLM, lines: list[str]) -> None:
    """A decode step's 33 one-row products alone, over the model's own weights in order (each
    read once a step, from memory, as in the engine), against the machine's read bandwidth."""
    weights = linear_weights(llm.engine.runner.model)

    def chain(dtype: torch.dtype, threads: int, onednn: bool = False) -> float:
        ws = [w.detach().to(dtype) for w in weights]
        xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=dtype) for w in ws}
        if onednn:  # oneDNN's own weight layout, as its prepacked linear reads it
            packed = [(w.shape[1], torch.ops.mkldnn._reorder_linear_weight(w, 1)) for w in ws]

            def products() -> None:
                for k, w in packed:
                    torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")
        else:

            def products() -> None:
                for w in ws:
                    torch.nn.functional.linear(xs[w.shape[1]], w)

        torch.set_num_threads(threads)
        try:
            for _ in range(5):
                products()
            start = time.perf_counter()
            for _ in range(40):
                products()
            return (time.perf_counter() - start) / 40
        finally:
            torch.set_num_threads(2)

    nbytes = sum(w.numel() * 4 for w in weights)
    big = torch.randn(2**26)  # 256 MiB, past every cache
    big.sum()
    start = time.perf_counter()
    for _ in range(10):
        big.sum()
    read = 10 * big.numel() * 4 / (time.perf_counter() - start)
    lines.append(f"## A step's {len(weights)} one-row products alone ({nbytes / 1e6:.0f} MB fp32)")
    lines.append(f"read bandwidth (sum of 256 MiB, 2 threads): {read / 1e9:.1f} GB/s")
    variants = [(torch.float32, 2, False), (torch.float32, 1, False), (torch.bfloat16, 2, False)]
    for dtype, threads, onednn in [*variants, (torch.float32, 2, True)]:
        seconds = chain(dtype, threads, onednn)
        size = nbytes * (2 if dtype == torch.bfloat16 else 4) // 4
        how = "oneDNN prepacked" if onednn else "F.linear"
        lines.append(
            f"  {how:16s} {str(dtype).removeprefix('torch.'):8s} {threads} thread(s): "
            f"{1e3 * seconds:.2f} ms a step, {size / seconds / 1e9:.1f} GB/s"
        )
    lines.append("")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    date = datetime.date.today().isoformat()
    parser.add_argument("--out", type=Path, default=ROOT / "results" / f"profile_cpu-{date}.txt")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="no compiled one-row decode steps"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="what the engine computes in",
    )
    args = parser.parse_args()
    path = checkpoint(ROOT / ".cache" / "llama-34m")
    llm = LLM(
        model_from_path=str(path),
        dtype=args.dtype,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        max_prefill_tokens=2048,  # every prompt in one step: the steps timed after it are decodes
    )
    model = llm.engine.runner.model
    params = (
        sum(w.numel() for w in linear_weights(model)) + model.model.embed_tokens.weight.numel()
    ) / 1e6
    compiled = "eager" if llm.engine.runner.compiled is None else "one-row steps compiled"
    lines = [
        f"# CPU engine step profile, {date}: {torch.get_num_threads()} torch threads, "
        f"torch {torch.__version__}, {path.name} ({params:.1f}M parameters, {args.dtype}), "
        f"{compiled}",
        "",
    ]
    for streams in (1, 16):
        report(llm, streams, lines)
    matmul_chain(llm, lines)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
