"""`fxrewrite generate [MODEL] --prompt TEXT [--chat | --chat-template FILE_OR_TEXT]`: complete prompts offline
and print the texts."""

from __future__ import annotations

import argparse

from fxrewrite.commands.engine_args import add_engine_arguments, add_model_argument
from fxrewrite.commands.sampling_args import add_sampling_arguments, load_chat_template, load_llm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text (repeat for a batch)")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the model's chat template")
    parser.add_argument("--chat-template", default=None,
                        help="chat template replacing the tokenizer's, as in `serve`: a file path, or the template "
                             "text itself (implies --chat)")
    add_sampling_arguments(parser)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    chat_template = load_chat_template(args.chat_template)
    llm, params = load_llm(args)
    if args.chat or chat_template is not None:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=False, chat_template=chat_template)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs):
        for completion in output.outputs:
            if len(args.prompt) > 1:
                print(f"### {prompt}")
            print(completion.text, flush=True)
    return 0
