"""`LLM`: offline batched generation through the engine, in vLLM's shape."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Sequence

import msgspec
from tqdm import tqdm

from metrale import demo
from metrale.engine.core import EngineCore
from metrale.engine.heap import freeze_startup_heap, thaw_heap
from metrale.engine_args import EngineArgs
from metrale.frontend.input_processor import InputProcessor, Prompt
from metrale.frontend.output_processor import OutputProcessor, fold
from metrale.outputs import CompletionOutput, RequestOutput
from metrale.sampling_params import SamplingParams
from metrale.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLM:
    """Generate from a checkpoint with Metrale's engine, in this process.

    `LLM()` runs the built-in demo model; `LLM("org/name")` a Hugging Face id (local cache first)
    and `LLM(model_from_path=DIR)` a directory. Other keyword arguments are engine flags
    (`EngineArgs`: max_num_seqs, max_prefill_tokens, kv_cache_memory, dtype, ...).
    """

    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        self.config = EngineArgs(model=model, **engine_args).create_config()  # type: ignore[arg-type]
        if self.config.is_demo:
            logger.log(*demo.notice())
        self.tokenizer = Tokenizer.from_dir(
            self.config.model_dir,
            chat_template_path=self.config.chat_template,
            model_type=self.config.model.model_type,
        )
        self.engine = EngineCore.from_config(self.config)
        self._inputs = InputProcessor(self.tokenizer)
        self._outputs = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        # Out of the collector's sweeps while this engine runs; back in once it is gone, so
        # that a notebook's or a test's next `LLM` does not keep this one's model for good
        # (parts of it hold reference cycles, which only the collector frees).
        if freeze_startup_heap():
            weakref.finalize(self, thaw_heap)

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (a no-op at one rank)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults."""
        return SamplingParams(**self.config.generation.sampling_overrides())

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of the prompts.

        `priority` (one per prompt, lower first) needs `scheduler="priority"`, as in vLLM.
        Every request is validated before any is queued, so one bad request raises
        `ValueError` and leaves the engine as it was.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts: give "
                    f"one, or one per prompt"
                )

        priorities = self._priorities(priority, len(prompts))
        processed = []
        groups = []  # (request id, the ids of its engine requests)
        for prompt, params, rank in zip(prompts, params_list, priorities, strict=True):
            request_id = str(next(self._request_counter))
            text, engine_request = self._inputs.process(request_id, prompt, params)
            engine_request = msgspec.structs.replace(engine_request, priority=rank)
            children = []
            for child_id, child_params in _fan_out(request_id, params):
                child = msgspec.structs.replace(
                    engine_request, request_id=child_id, sampling_params=child_params
                )
                self.engine.validate(child)
                processed.append((text, child))
                children.append(child_id)
            groups.append((request_id, children))

        results: dict[str, RequestOutput] = {}
        for text, request in processed:
            self.engine.add_request(request)
            params = request.sampling_params
            self._outputs.add_request(
                request.request_id, len(request.prompt_token_ids), params, whole=True
            )
            completion = CompletionOutput(
                0, "", [], logprobs=None if params.logprobs is None else []
            )
            results[request.request_id] = RequestOutput(
                request.request_id, text, request.prompt_token_ids, [completion]
            )
        self._run(len(processed), results, use_tqdm)
        return [
            _merge(request_id, [results[c] for c in children]) for request_id, children in groups
        ]

    def _priorities(self, priority: Sequence[int] | None, num_prompts: int) -> list[int]:
        if priority is None:
            return [0] * num_prompts
        if self.config.scheduler.policy != "priority":
            raise ValueError(
                f"priority is served by the priority policy only; this engine schedules "
                f"{self.config.scheduler.policy}: pass scheduler='priority'"
            )
        priority = list(priority)
        if len(priority) != num_prompts:
            raise ValueError(f"got {len(priority)} priorities for {num_prompts} prompts")
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in priority):
            raise ValueError("priorities must be integers")
        return priority

    def _run(self, num_requests: int, results: dict[str, RequestOutput], use_tqdm: bool) -> None:
        bar = tqdm(total=num_requests, desc="Generating", unit="req", disable=not use_tqdm)
        with bar:
            while self.engine.has_unfinished_requests():
                for engine_output in self.engine.step():
                    delta = self._outputs.process(engine_output)
                    if delta is None:
                        continue
                    fold(results[delta.request_id], delta)
                    if delta.abort_in_engine:
                        self.engine.abort_request(delta.request_id)
                    if delta.finished:
                        bar.update()


def _fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """One engine request per wanted completion (`n`), each with its own seed when seeded."""
    if params.n == 1:
        return [(request_id, params)]
    return [
        (
            f"{request_id}-{i}",
            dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i),
        )
        for i in range(params.n)
    ]


def _merge(request_id: str, children: list[RequestOutput]) -> RequestOutput:
    merged = children[0]
    merged.request_id = request_id
    merged.outputs = [child.outputs[0] for child in children]
    for index, completion in enumerate(merged.outputs):
        completion.index = index
    return merged
