"""`met generate "text"`: one quick generation from the shell."""

from __future__ import annotations

import argparse

from metrale.engine_args import EngineArgs
from metrale.entrypoints.cli import Subcommand, register


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument(
        "--model", help="a Hugging Face id or a directory (default: the built-in demo model)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user message with the chat template",
    )
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--sampling-seed", type=int, help="seed for sampling")
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    from metrale import LLM, SamplingParams

    engine_args = vars(EngineArgs.from_cli(args))
    llm = LLM(**engine_args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    print(output.outputs[0].text)
    return 0


register(Subcommand("generate", "generate text for one prompt and print it", add_arguments, run))
