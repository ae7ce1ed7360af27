"""Every bad flag value of `kvrelay serve | router | worker | generate | chat` is one line naming
the flag, exit code 2, before anything starts (issue 40): the real CLI entry in-process, and
real subprocesses that show no Ray, no torch and no model were touched."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvrelay.cli import build_parser, main
from kvrelay.engine.args import ATTENTION_BACKENDS, QUANTIZATIONS, EngineArgs

MISSING = "/nonexistent/kvrelay-test.pem"
# What each command needs besides the flag under test.
BASE = {
    "generate": ["generate", "hi"],
    "chat": ["chat"],
    "serve": ["serve"],
    "router": ["router", "--ray-address", "auto"],
    "worker": ["worker", "--role", "decode"],
}
ENGINE_COMMANDS = tuple(BASE)
SERVING = ("serve", "router")
POOLS = ("serve", "router", "worker")
SAMPLING = ("generate", "chat")

# (commands, the flag named in the error, the bad arguments, a piece of the message)
CASES: list[tuple[tuple[str, ...], str, list[str], str]] = [
    (ENGINE_COMMANDS, "--block-size", ["--block-size", "3"], "power of two in [1, 128], got 3"),
    (ENGINE_COMMANDS, "--block-size", ["--block-size", "x"], "invalid int value: 'x'"),
    (ENGINE_COMMANDS, "--num-blocks", ["--num-blocks", "0"], "must be >= 1, got 0"),
    (ENGINE_COMMANDS, "--kv-cache-memory", ["--kv-cache-memory", "0"], "must be > 0"),
    (ENGINE_COMMANDS, "--kv-cache-memory", ["--kv-cache-memory", "lots"], "512MiB"),
    (ENGINE_COMMANDS, "--gpu-memory-utilization", ["--gpu-memory-utilization", "0"], "(0, 1]"),
    (ENGINE_COMMANDS, "--gpu-memory-utilization", ["--gpu-memory-utilization", "1.5"], "(0, 1]"),
    (ENGINE_COMMANDS, "--gpu-memory-utilization", ["--gpu-memory-utilization", "nan"], "number"),
    (ENGINE_COMMANDS, "--max-num-batched-tokens", ["--max-num-batched-tokens", "0"], ">= 1"),
    (ENGINE_COMMANDS, "--max-num-seqs", ["--max-num-seqs", "-1"], "must be >= 1, got -1"),
    (
        ENGINE_COMMANDS,
        "--long-prefill-token-threshold",
        ["--long-prefill-token-threshold", "-1"],
        ">= 0",
    ),
    (ENGINE_COMMANDS, "--max-model-len", ["--max-model-len", "0"], "must be >= 1, got 0"),
    (ENGINE_COMMANDS, "--dtype", ["--dtype", "float8"], "invalid choice: 'float8'"),
    (ENGINE_COMMANDS, "--quantization", ["--quantization", "q2_k"], "invalid choice"),
    (ENGINE_COMMANDS, "--device", ["--device", "tpu"], "cpu, cuda, cuda:N or meta, got 'tpu'"),
    (ENGINE_COMMANDS, "--seed", ["--seed", "-1"], "got -1"),
    (ENGINE_COMMANDS, "--num-threads", ["--num-threads", "0"], "must be >= 1, got 0"),
    (ENGINE_COMMANDS, "--attention-backend", ["--attention-backend", "flash"], "invalid choice"),
    (ENGINE_COMMANDS, "--model", ["--model", "./no/such/folder"], "not found"),
    (ENGINE_COMMANDS, "--model", ["--model", "a/b/c"], "ORG/NAME[@REVISION]"),
    (ENGINE_COMMANDS, "--model", ["--model", "Org/Name@"], "name a revision after '@'"),
    (ENGINE_COMMANDS, "--model", ["--model", "/"], "has no config.json"),
    (ENGINE_COMMANDS, "--int8-activations", ["--int8-activations"], "--quantization"),
    (SERVING, "--http-port", ["--http-port", "70000"], "port in [0, 65535], got 70000"),
    (SERVING, "--grpc-port", ["--grpc-port", "-1"], "port in [0, 65535], got -1"),
    (SERVING, "--http-host", ["--http-host", " "], "must not be empty"),
    (SERVING, "--grpc-host", ["--grpc-host", ""], "must not be empty"),
    (SERVING, "--api-key-env", ["--api-key-env", ""], "must not be empty"),
    (SERVING, "--drain-timeout", ["--drain-timeout", "-1"], ">= 0 seconds, got -1"),
    (SERVING, "--max-body-bytes", ["--max-body-bytes", "0"], "at least 1 byte"),
    (SERVING, "--max-body-bytes", ["--max-body-bytes", "big"], "4MiB"),
    (SERVING, "--ssl-certfile", ["--ssl-certfile", MISSING], f"cannot read {MISSING}"),
    (SERVING, "--ssl-keyfile", ["--ssl-keyfile", MISSING], f"cannot read {MISSING}"),
    (SERVING, "--ssl-ca-certs", ["--ssl-ca-certs", MISSING], f"cannot read {MISSING}"),
    (SERVING, "--ssl-certfile", ["--ssl-certfile", __file__], "TLS needs both"),
    (SERVING, "--ssl-ca-certs", ["--ssl-ca-certs", __file__], "needs --ssl-certfile"),
    (SERVING, "--served-model-name", ["--served-model-name", ""], "must not be empty"),
    (SERVING, "--max-in-flight", ["--max-in-flight", "0"], "must be >= 1, got 0"),
    (SERVING, "--migration-timeout", ["--migration-timeout", "-5"], ">= 0 seconds"),
    (SERVING, "--migration-timeout", ["--migration-timeout", "inf"], "finite"),
    (SERVING, "--max-n", ["--max-n", "0"], "must be >= 1, got 0"),
    (SERVING, "--max-queued", ["--max-queued", "-1"], "must be >= 0, got -1"),
    (SERVING, "--routing-policy", ["--routing-policy", "random"], "invalid choice"),
    (SERVING, "--max-local-prefill-tokens", ["--max-local-prefill-tokens", "-1"], ">= 0"),
    (SERVING, "--tenant-limits", ["--tenant-limits", MISSING], f"cannot read {MISSING}"),
    (SERVING, "--tenant-limits", ["--tenant-limits", __file__], "is not valid JSON"),
    (SERVING, "--tenant-header", ["--tenant-header", "X Tenant"], "an HTTP header name"),
    (SERVING, "--tenant-header", ["--tenant-header", "Authorization"], "read by the server"),
    (POOLS, "--transfer-backend", ["--transfer-backend", "rdma"], "invalid choice"),
    (POOLS, "--kv-lease-seconds", ["--kv-lease-seconds", "0"], "must be > 0, got 0.0"),
    (POOLS, "--kv-transfer-failure", ["--kv-transfer-failure", "retry"], "invalid choice"),
    (POOLS, "--worker-threads", ["--worker-threads", "0"], "must be >= 1, got 0"),
    (POOLS, "--kv-secret-file", ["--kv-secret-file", MISSING], f"cannot read {MISSING}"),
    (("serve",), "--num-prefill", ["--num-prefill", "0"], "must be >= 1, got 0"),
    (("serve",), "--num-decode", ["--num-decode", "0"], "must be >= 1, got 0"),
    (("serve",), "--num-prefill", ["--colocated", "--num-prefill", "2"], "--colocated runs"),
    (("serve",), "--ray-address", ["--ray-address", ""], "must not be empty"),
    (("router",), "--ray-address", ["--ray-address", ""], "must not be empty"),
    (("worker",), "--ray-address", ["--ray-address", " "], "must not be empty"),
    (("router", "worker"), "--ray-join-timeout", ["--ray-join-timeout", "0"], "> 0 seconds"),
    (("worker",), "--role", ["--role", "router"], "invalid choice: 'router'"),
    (SAMPLING, "--max-tokens", ["--max-tokens", "0"], "must be >= 1 or None, got 0"),
    (SAMPLING, "--min-tokens", ["--min-tokens", "-1"], "must be >= 0, got -1"),
    (SAMPLING, "--min-tokens", ["--max-tokens", "4", "--min-tokens", "5"], "<= max_tokens"),
    (SAMPLING, "--temperature", ["--temperature", "-1"], "must be >= 0, got -1"),
    (SAMPLING, "--temperature", ["--temperature", "inf"], "must be finite"),
    (SAMPLING, "--top-p", ["--top-p", "0"], "must be in (0, 1], got 0"),
    (SAMPLING, "--top-k", ["--top-k", "-2"], "got -2"),
    (SAMPLING, "--min-p", ["--min-p", "2"], "must be in [0, 1], got 2"),
    (SAMPLING, "--repetition-penalty", ["--repetition-penalty", "0"], "must be > 0"),
    (SAMPLING, "--presence-penalty", ["--presence-penalty", "3"], "[-2, 2], got 3"),
    (SAMPLING, "--frequency-penalty", ["--frequency-penalty", "-3"], "[-2, 2], got -3"),
    (SAMPLING, "--sampling-seed", ["--sampling-seed", "-1"], "got -1"),
    (SAMPLING, "--stop", ["--stop", ""], "must not be empty"),
    (("generate",), "-n", ["-n", "0"], "must be >= 1, got 0"),
    (("chat",), "--url", ["--url", "ftp://host"], "http:// or https:// URL"),
    (("chat",), "--ca-certs", ["--ca-certs", MISSING], f"cannot read {MISSING}"),
    (("chat",), "--client-cert", ["--client-cert", MISSING], f"cannot read {MISSING}"),
    (("chat",), "--client-key", ["--client-key", MISSING], f"cannot read {MISSING}"),
    (("chat",), "--client-cert", ["--client-cert", __file__], "add --url"),
    (
        ("chat",),
        "--client-cert",
        ["--url", "https://h", "--client-cert", __file__],
        "go together",
    ),
    (
        ("chat",),
        "--max-num-seqs",
        ["--url", "http://h", "--max-num-seqs", "4"],
        "with --url the server's model",
    ),
]
# Flags whose every value is valid (free text, switches), so the table has no bad one.
FREE_FLAGS = {"--api-key", "--system", "--chat", "--help", "--version"}

PARAMS = [
    pytest.param(command, flag, argv, fragment, id=f"{command} {' '.join(argv)}")
    for commands, flag, argv, fragment in CASES
    for command in commands
]


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2, err
    assert out == "" and err.endswith("\n") and err.count("\n") == 1, err
    return err.rstrip("\n")


@pytest.mark.parametrize(("command", "flag", "argv", "fragment"), PARAMS)
def test_a_bad_value_is_one_line_naming_the_flag(
    capsys: pytest.CaptureFixture[str], command: str, flag: str, argv: list[str], fragment: str
) -> None:
    line = _error_line(capsys, [*BASE[command], *argv])
    assert line.startswith(f"kvrelay {command}: error: "), line
    assert flag in line and fragment in line, line
    assert line.endswith(f"(see kvrelay {command} --help)"), line


def test_a_bad_log_level_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error_line(capsys, ["--log-level", "loud", "serve"])
    assert line.startswith("kvrelay: error: argument --log-level: must be one of DEBUG"), line


def _value_flags(parser: argparse.ArgumentParser) -> set[str]:
    """The flags of `parser`, each by its longest spelling."""
    return {max(a.option_strings, key=len) for a in parser._actions if a.option_strings}


def test_the_table_covers_every_flag_of_every_command() -> None:
    """A flag added later without a bad case here fails this test."""
    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    switches = {"--no-prefix-caching", "--enforce-eager", "--colocated", "--manage-workers",
                "--enable-docs", "--ignore-eos", "--allow-unauthenticated",
                "--no-async-scheduling"}  # fmt: skip
    for command in BASE:
        covered = {flag for commands, flag, _, _ in CASES if command in commands}
        flags = _value_flags(subparsers.choices[command]) - FREE_FLAGS - switches
        assert flags - covered == set(), f"{command}: no bad-value case for {flags - covered}"


def test_good_values_parse_and_reach_the_engine_args() -> None:
    ns = build_parser().parse_args(
        ["serve", "--block-size", "32", "--kv-cache-memory", "1GiB", "--max-body-bytes", "8MiB",
         "--http-port", "0", "--model", "Org/Name@v1", "--drain-timeout", "0"]
    )  # fmt: skip
    assert (ns.block_size, ns.kv_cache_memory, ns.max_body_bytes, ns.http_port) == (
        32,
        "1GiB",
        8 * 1024 * 1024,
        0,
    )
    assert ns.model == "Org/Name@v1" and ns.num_prefill is None
    ns.check_flags(ns)  # the rules between flags accept it
    assert EngineArgs.from_cli_args(ns).block_size == 32


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"block_size": 3}, "block_size must be a power of two"),
    ({"block_size": "16"}, "block_size must be an int, got str"),
    ({"block_size": True}, "block_size must be an int"),
    ({"num_blocks": 0}, "num_blocks must be >= 1"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory must be a size"),
    ({"kv_cache_memory": 0}, "kv_cache_memory must be > 0"),
    ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"gpu_memory_utilization": math.nan}, "gpu_memory_utilization must be a number"),
    ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
    ({"max_num_seqs": -1}, "max_num_seqs must be >= 1"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be >= 0"),
    ({"max_model_len": 0}, "max_model_len must be >= 1"),
    ({"dtype": "fp8"}, "dtype must be one of auto, float32"),
    ({"quantization": "q2_k"}, "quantization must be one of none"),
    ({"int8_activations": 1}, "int8_activations must be True or False"),
    ({"int8_activations": True}, "int8_activations multiplies GGUF-quantized weights"),
    ({"device": "mps"}, "device must be auto, cpu"),
    ({"seed": 2**64}, "seed must be in"),
    ({"num_threads": 0}, "num_threads must be >= 1"),
    ({"attention_backend": "flash"}, "attention_backend must be one of auto"),
    ({"enforce_eager": None}, "enforce_eager must be True or False"),
    ({"async_scheduling": "yes"}, "async_scheduling must be True or False"),
    ({"async_scheduling": True, "role": "prefill"}, "cannot run on a prefill engine"),
    ({"role": "router"}, "role must be one of both"),
    ({"kv_lease_seconds": 0}, "kv_lease_seconds must be > 0"),
    ({"kv_transfer_failure": "retry"}, "kv_transfer_failure must be one of recompute"),
    ({"model": 3}, "model must be a folder"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_FIELDS, ids=[str(k) for k, _ in BAD_FIELDS])
def test_engine_args_refuse_a_bad_field_before_anything_loads(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def test_every_engine_field_has_a_bad_case() -> None:
    from dataclasses import fields

    covered = {name for kwargs, _ in BAD_FIELDS for name in kwargs}
    assert {f.name for f in fields(EngineArgs)} == covered


def test_llm_refuses_a_bad_field_without_loading_a_model(tmp_path: Path) -> None:
    from kvrelay.llm import LLM

    # The folder holds no model: the value is refused before any load is tried.
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        LLM(model=str(tmp_path), max_num_seqs=0)


def test_the_choices_are_the_engines_own() -> None:
    from kvrelay.models.quantized_loading import QUANTIZATIONS as LOADER_QUANTIZATIONS
    from kvrelay_kernels.backend import _BACKENDS

    assert set(ATTENTION_BACKENDS) == {"auto", *_BACKENDS}
    assert QUANTIZATIONS == LOADER_QUANTIZATIONS


PROBE = """
import sys, time
from kvrelay.cli import main
start = time.perf_counter()
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print(code, round(time.perf_counter() - start, 3),
      sorted(m for m in ("ray", "torch", "transformers") if m in sys.modules))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--max-num-seqs", "-1"],
        ["serve", "--block-size", "3"],
        ["worker", "--role", "decode", "--int8-activations"],
        ["router", "--ray-address", "auto", "--http-port", "99999"],
        ["generate", "hi", "--temperature", "-1"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_nothing_starts_for_a_bad_flag(argv: list[str]) -> None:
    """A real process: exit 2 with the one line, and neither Ray nor torch was imported."""
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120
    )
    wall = time.perf_counter() - started
    code, parse_s, loaded = out.stdout.split(" ", 2)
    assert code == "2", out.stderr
    assert loaded.strip() == "[]", f"a bad flag imported {loaded}"
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert float(parse_s) < 1.0, f"parsing took {parse_s} s"  # measured: ~0.01 s
    assert wall < 30, wall


def test_the_command_line_tool_exits_2_without_a_traceback() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay.cli", "serve", "--max-num-seqs", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr == (
        "kvrelay serve: error: argument --max-num-seqs: must be >= 1, got -1 "
        "(see kvrelay serve --help)\n"
    )


def test_a_max_model_len_beyond_the_model_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Known once the model's config.json is read: still one line naming the flag, exit 2,
    before the model loads (the folder has no weights to load)."""
    import json

    from tests.hf_checkpoints import BASE as TINY_CONFIG

    config = {**TINY_CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = main(["generate", "hi", "--model", str(tmp_path), "--max-model-len", "999"])
    assert code == 2
    assert capsys.readouterr().err == (
        "kvrelay: error: argument --max-model-len: 999 is longer than the model's "
        f"{TINY_CONFIG['max_position_embeddings']} positions\n"
    )
