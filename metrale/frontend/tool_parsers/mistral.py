"""Mistral: ``[TOOL_CALLS]`` then the calls, in one of two spellings by tokenizer version.

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]   (before v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}   (v11 on)

Source: vLLM's ``mistral`` parser and mistral-common's tokenizer versions: before v11 one
``[TOOL_CALLS]`` is followed by a JSON array of call objects; from v11 each call is
``[TOOL_CALLS]`` + name + ``[ARGS]`` + a JSON object, and some versions put
``[CALL_ID]`` + an id between name and ``[ARGS]``. The model's ids are not kept: ids come
from the parser, so that every splitting of the output agrees. Both spellings are accepted
whatever follows the opener decides; a lone object instead of an array is accepted too.

The markers are special tokens in Mistral's tokenizers. No marker ends a call (the next call's
``[TOOL_CALLS]`` or the end of the array does), so no stop string can cut a reply after its
first call: with `parallel_tool_calls: false` the model writes on, and the chat output parser
keeps only the first call. The grammar that forces a
call offers both spellings, so that the model writes the one its tokenizer version taught it;
several calls are more elements of the array, or more ``[TOOL_CALLS]`` calls in the v11 form.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, auto

from metrale.frontend.tool_parsers.block_parser import BlockParser, BlockReader
from metrale.frontend.tool_parsers.grammar import (
    GrammarBuilder,
    arguments_schema,
    checked_name,
    literal,
    one_call_of,
    repeat_calls,
)
from metrale.frontend.tool_parsers.json_call import (
    ArgumentsStream,
    JsonCallsBlock,
    call_array_grammar,
    call_object_grammar,
)
from metrale.frontend.tool_parsers.json_scanner import Step
from metrale.frontend.tool_parsers.names import NameScan, scan_name
from metrale.frontend.tool_parsers.registry import register_tool_parser
from metrale.frontend.tool_parsers.schema import ToolSpec
from metrale.frontend.tool_parsers.sink import EventSink
from metrale.frontend.tool_parsers.tags import skip_space

CALLS_OPEN = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class _State(Enum):
    START = auto()  # JSON, or a v11 name, follows
    JSON = auto()
    NAME = auto()
    CALL_ID = auto()
    BEFORE_ARGUMENTS = auto()
    ARGUMENTS = auto()


class MistralBlock(BlockReader):
    def __init__(self, sink: EventSink) -> None:
        self._sink = sink
        self._state = _State.START
        self._json = JsonCallsBlock(sink)
        self._arguments = ArgumentsStream()
        self._named = False

    @property
    def committed(self) -> bool:  # type: ignore[override]
        return self._named or self._json.committed

    @property
    def closed(self) -> bool | None:  # type: ignore[override]
        # The v11 spelling has no closing marker: nothing after complete arguments tells a
        # call cut short from one that ended, so such a call counts as parsed.
        return self._json.closed if self._state is _State.JSON else None

    def read(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        while True:
            state = self._state
            if state is _State.START:
                start = skip_space(text, pos)
                if start == len(text):
                    return pos, final
                self._state = _State.JSON if text[start] in "[{" else _State.NAME
                pos = start
            elif state is _State.JSON:
                return self._json.read(text, pos, final)
            elif state is _State.NAME:
                status, name, at, delimiter = scan_name(text, pos, (ARGS, CALL_ID, "{"), final)
                if status is not NameScan.FOUND:
                    return pos, status is NameScan.INVALID
                self._sink.start_call(name)
                self._named = True
                pos = at if delimiter == "{" else at + len(delimiter)
                self._state = _State.CALL_ID if delimiter == CALL_ID else _State.BEFORE_ARGUMENTS
            elif state is _State.CALL_ID:
                status, _, at, delimiter = scan_name(text, pos, (ARGS, "{"), final)
                if status is NameScan.MORE:
                    return pos, False
                if status is NameScan.INVALID:
                    self._cut_call()
                    return pos, True
                pos = at if delimiter == "{" else at + len(delimiter)
                self._state = _State.BEFORE_ARGUMENTS
            elif state is _State.BEFORE_ARGUMENTS:
                start = skip_space(text, pos)
                if start == len(text) and not final:
                    return pos, False
                if start == len(text) or text[start] != "{":
                    self._cut_call()
                    return pos, True
                pos, self._state = start, _State.ARGUMENTS
            else:
                return self._read_arguments(text, pos, final)

    def _read_arguments(self, text: str, pos: int, final: bool) -> tuple[int, bool]:
        for at in range(pos, len(text)):
            step = self._arguments.push(text[at])
            if step is not Step.ACCEPTED:
                self._end_call()
                return (at + 1 if step is Step.COMPLETE else at), True
        if final:
            self._end_call()
            return len(text), True
        self._sink.arguments(self._arguments.drain_ready())
        return len(text), False

    def _end_call(self) -> None:
        self._arguments.send_final(self._sink)
        self._sink.end_call()

    def _cut_call(self) -> None:
        """End the call before its arguments: what follows the name is not ours."""
        self._sink.note_repair()
        self._sink.end_call()


@register_tool_parser("mistral")
class MistralToolParser(BlockParser):
    openers = (CALLS_OPEN,)
    markers = (CALLS_OPEN, ARGS, CALL_ID)

    def open_block(self, opener: str) -> BlockReader:
        return MistralBlock(self.sink)

    @classmethod
    def call_grammar(cls, tools: Sequence[ToolSpec], *, several: bool = False) -> str:
        grammar = GrammarBuilder()
        v11_call = one_call_of(
            tools,
            lambda tool: (
                f"{literal(checked_name(tool) + ARGS)} {grammar.json_value(arguments_schema(tool))}"
            ),
        )
        v11 = repeat_calls(grammar, v11_call, several=several, separator=literal(CALLS_OPEN))
        call_object = one_call_of(tools, lambda tool: call_object_grammar(grammar, tool))
        array = call_array_grammar(grammar, call_object, several=several)
        return grammar.build(f'{literal(CALLS_OPEN)} ({v11} | (" "? {array}))')
