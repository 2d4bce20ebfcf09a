"""The command line of `python -m serve`: vLLM's `vllm serve` flags, parsed and checked.

A vLLM user replaces `vllm serve` with `python -m serve` and keeps their flags. Where this server
differs from vLLM (everything else has vLLM's name, meaning and default):

    flag                        here                              vLLM
    --------------------------  --------------------------------  ---------------------------------
    MODEL / --model             optional: dsv4-tiny (built in,    required
                                random weights, real tokenizer)
    --disable-access-log-for-   /health,/metrics                  none
      endpoints
    --host                      127.0.0.1 (this machine only)     all interfaces
    --max-num-seqs              GPUs as vLLM (1024 from 70 GiB,   1024 from 70 GiB, else 256
                                else 256) within the KV pools;
                                8 on CPUs
    --max-model-len             max_position_embeddings, <= 4096  the model's max_position_embeddings
    --dtype                     auto, bfloat16, float32           also half, float16, float
    --kv-cache-dtype            auto, fp8, fp8_e4m3, fp8_ds_mla,  auto, fp8, ...
                                bfloat16, bf16, float32
    --attention-backend         xla, pallas_fp8_ds_mla,           vLLM's backends; FLASHMLA_SPARSE*
                                pallas_bf16                       is mapped to pallas_fp8_ds_mla
    --block-size                256, a multiple of 128            chosen by the attention backend
    --max-logprobs              20, and at most 20 (the sampler   20
                                computes 20 top logprobs)
    --enable-auto-tool-choice   on (--no-enable-auto-tool-choice  off
                                turns it off)
    --tool-call-parser          deepseek_v4                       none
    --reasoning-parser          deepseek_v4 ('' turns the split   none
                                off)
    --structured-outputs-config backend guidance (llguidance;     backend auto: xgrammar, else
                                auto means it); xgrammar,         guidance
                                outlines, lm-format-enforcer
                                refused
    --trust-remote-code         accepted, does nothing            runs the model repo's code
    --speculative-config        method mtp or deepseek_mtp (the   also other methods, and draft
                                checkpoint's own MTP block), k    models
                                1..4; runs without async
                                scheduling
    --tokenizer-mode, --enforce-eager, --async-scheduling, --disable-log-requests
                                accepted, change nothing: one warning each
    --num-prefix-snapshots      sized from the sequence slots:    (none)
                                sliding-window and compressor
                                states the prefix cache keeps,
                                per data-parallel rank
    --max-waiting-requests      1024 sequences: a longer queue answers 503  (none)
    --no-web-ui                 turns off the browser page        (none)
    any other vLLM flag         refused: not supported by dsv4-jax

vLLM's environment variables read here: VLLM_API_KEY (--api-key's default), VLLM_SERVER_DEV_MODE
(the development endpoints) and VLLM_LOG_STATS_INTERVAL (seconds between two stats lines, 10).

Like vLLM, flags may be spelled with underscores (`--max_model_len`) and `--max-model-len` /
`--max-num-batched-tokens` take human-readable sizes (1k = 1000, 1K = 1024, also m/M, g/G).

Errors: a bad value or unknown flag is one line `serve: error: ...` and exit status 2. Every
refusal, argparse's own included, is a ValueError, which the entry point's
`pallas_kernels.cli.run_main` prints as that line: a node of several first tells the other nodes
why it stops (`node_flags` reads where it would join from the command line alone).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import sys
from typing import Any, NoReturn, Sequence

from dsv4_jax.engine.args import BUILTIN_MODEL, DTYPES, EngineArgs
from dsv4_jax.engine.prefix_cache import HASH_ALGOS
from dsv4_jax.engine.sampling_params import MAX_LOGPROBS
from dsv4_jax.engine.speculative import SpeculativeConfig
from dsv4_jax.engine.structured_outputs import StructuredOutputsConfig
from dsv4_jax.parallel.distributed import DistributedConfig
from pallas_kernels.cli import AddArgument, OneLineParser, add_debug_flag

PROG = "serve"  # the name in error lines; the entry point passes it to run_main
USAGE_PROG = "python -m serve"
logger = logging.getLogger("serve")

# These mirror names owned by dsv4_jax.kv_cache: importing them here would pull jax into `--help`;
# tests/test_serve_args.py checks that they agree.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla", "bfloat16", "bf16", "float32")
ATTENTION_BACKENDS = ("xla", "pallas_fp8_ds_mla", "pallas_bf16")
BLOCK_SIZE_MULTIPLE = 128  # the KV planner's rule: a block holds whole CSA (r=4) and HCA (r=128) entries

VLLM_FLASHMLA_PREFIX = "FLASHMLA_SPARSE"  # vLLM's sparse-MLA backend for this model (and its V4 variant)
TOOL_CALL_PARSERS = ("deepseek_v4",)
REASONING_PARSERS = ("deepseek_v4", "")  # "": no reasoning split (everything is content)
UVICORN_LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "trace")
API_KEY_ENV = "VLLM_API_KEY"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's switch for its development endpoints (POST /reset_prefix_cache)
LOG_STATS_INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"  # vLLM's seconds between two periodic stats lines
DEFAULT_LOG_STATS_INTERVAL_S = 10.0  # vLLM's, also where the variable is not above 0
DEFAULT_QUIET_ENDPOINTS = ("/health", "/metrics")
SIZE_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}

# vLLM flags accepted for its recipes' sake; each changes nothing here. flag -> (takes a value, why).
IGNORED_FLAGS = {
    "--tokenizer-mode": (True, "the tokenizer is always the model's tokenizer.json with the V4 chat encoder"),
    "--enforce-eager": (False, "there are no CUDA graphs to turn off: steps are jit-compiled for fixed shapes"),
    "--async-scheduling": (False, "async scheduling is on by default here (--no-async-scheduling turns it off)"),
    "--disable-log-requests": (False, "vLLM recipes pass it; logging is set by --uvicorn-log-level"),
}
# vLLM flags for features not built yet: refused. flag -> (takes a value, what to do instead).
REFUSED_FLAGS: dict[str, tuple[bool, str]] = {}


@dataclasses.dataclass(frozen=True)
class ServerArgs:
    """The parsed command line: the engine's arguments (`EngineArgs`, one field per engine flag)
    and the server's own flags, named as argparse names them."""

    engine: EngineArgs
    model_is_builtin: bool
    served_model_name: tuple[str, ...]  # the first is the name the API reports
    host: str
    port: int
    enable_auto_tool_choice: bool
    tool_call_parser: str | None
    reasoning_parser: str | None
    api_key: str | None = dataclasses.field(repr=False)  # never printed with the rest
    dev_mode: bool  # VLLM_SERVER_DEV_MODE: the development endpoints are served
    uvicorn_log_level: str
    disable_access_log_for_endpoints: tuple[str, ...]  # paths whose requests leave no access-log line
    disable_uvicorn_access_log: bool  # no access-log line at all
    default_chat_template_kwargs: dict[str, Any] | None
    enable_force_include_usage: bool
    enable_prompt_tokens_details: bool  # usage carries prompt_tokens_details.cached_tokens
    max_logprobs: int
    max_waiting_requests: int
    no_web_ui: bool
    disable_log_stats: bool  # no periodic stats line (serve/stats_log.py)
    log_stats_interval: float  # seconds between two stats lines (VLLM_LOG_STATS_INTERVAL)
    debug: bool
    ignored_flags: tuple[str, ...]  # one warning line per vLLM flag that changes nothing here

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def distributed(self) -> DistributedConfig:
        return self.engine.distributed


# ---- value types: each raises ArgumentTypeError, which argparse prefixes with the flag ----------
def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer (allowed: 1, 2, ...)")
    return value


def _human_positive_int(text: str) -> int:
    """vLLM's human-readable sizes: 1k = 1000 (decimals allowed: 25.6k), 1K = 1024, m/M, g/G."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer (allowed: 4096, 4k, 4K, ...)")
    number, suffix = match.groups()
    if "." in number and not suffix.islower():
        raise argparse.ArgumentTypeError(f"{text!r}: only k, m and g take a decimal number (25.6k)")
    scaled = float(number) * SIZE_SUFFIXES[suffix] if "." in number else int(number) * SIZE_SUFFIXES[suffix]
    if scaled < 1 or scaled != int(scaled):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return int(scaled)


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (allowed: 0..65535, 0 = any free port)")
    return value


def _memory_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:  # nan fails too
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1]")
    return value


def _block_size(text: str) -> int:
    value = _int(text)
    if value < 1 or value % BLOCK_SIZE_MULTIPLE:
        raise argparse.ArgumentTypeError(
            f"{value} is not a positive multiple of {BLOCK_SIZE_MULTIPLE}: the KV planner's blocks must hold whole "
            f"CSA (ratio 4) and HCA (ratio 128) compressed entries (allowed: 128, 256, 384, ...)"
        )
    return value


def _max_logprobs(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(
            f"{value} is not in 0..{MAX_LOGPROBS} (the sampler returns at most {MAX_LOGPROBS} top logprobs)"
        )
    return value


def _dtype(text: str) -> str:
    if text in DTYPES:
        return text
    if text in ("half", "float16"):
        raise argparse.ArgumentTypeError(f"{text!r}: float16 is not supported; use bfloat16 or float32 (or auto)")
    raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(DTYPES)}")


def _paths(text: str) -> tuple[str, ...]:
    paths = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in paths if not p.startswith("/")]
    if bad:
        raise argparse.ArgumentTypeError(f"{', '.join(bad)}: a path starts with / (example: /health,/metrics)")
    return paths


def _json_object(text: str, example: str = '{"thinking": false}') -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is a JSON {type(value).__name__}, not an object "
                                         f"(example: '{example}')")
    return value


def _structured_outputs_json(text: str) -> dict[str, Any]:
    return _json_object(text, '{"enable_in_reasoning": true}')


def _speculative_json(text: str) -> dict[str, Any]:
    return _json_object(text, '{"method": "mtp", "num_speculative_tokens": 2}')


# ---- the parser ----------------------------------------------------------------------------------
class _FlagParser(OneLineParser):
    """argparse's usage errors as a ValueError: `run_main` prints it as the same one line, and a
    node of several can tell the others first (`--help` still prints and exits 0)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _add_node_flags(add: AddArgument) -> None:
    add("--nnodes", type=_positive_int, default=1,
        help="hosts (processes) the model runs on; node 0 serves HTTP (default: %(default)s)")
    add("--node-rank", type=int, default=0, help="this host's rank in [0, --nnodes) (default: %(default)s)")
    add("--master-addr", default="127.0.0.1",
        help="node 0's address: JAX's coordinator and the step channel (default: %(default)s)")
    add("--master-port", type=_port, default=29500,
        help="JAX's coordinator port on node 0; the step channel uses the next one (default: %(default)s)")
    add("--headless", action="store_true",
        help="a follower (--node-rank >= 1): no HTTP, it runs node 0's steps (default: off)")


def node_flags(argv: Sequence[str] | None = None) -> DistributedConfig | None:
    """Where this process joins a run over several nodes, read from `argv` (default:
    sys.argv[1:]) alone, whatever its other flags (a flag given twice counts its last value, as
    in `parse_args`): None for one node, or when these flags are bad or do not say which node
    this is (`--headless` on rank 0: a follower whose rank is missing must not join as node 0). A
    rank above 0 without `--headless` joins as the follower it names (the refusal is that flag's
    absence)."""
    parser = _FlagParser(add_help=False, allow_abbrev=False)
    _add_node_flags(parser.add_argument)
    try:
        namespace, _ = parser.parse_known_args(_dashed(sys.argv[1:] if argv is None else argv))
        if namespace.nnodes == 1 or (namespace.headless and namespace.node_rank == 0):
            return None
        return DistributedConfig(namespace.nnodes, namespace.node_rank, namespace.master_addr, namespace.master_port,
                                 headless=namespace.node_rank > 0)
    except ValueError:  # argparse's errors, and the config's own checks
        return None


def build_parser() -> argparse.ArgumentParser:
    parser = _FlagParser(
        prog=USAGE_PROG, error_prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # a prefix of one of our flags must not silently stand for it
    )
    # One helper per group of flags, in the order `--help` lists them.
    for add_group in (_add_model_flags, _add_engine_flags, _add_parser_flags, _add_server_flags, _add_node_flags):
        add_group(parser.add_argument)
    add_debug_flag(parser)
    _add_vllm_only_flags(parser)
    return parser


def _add_model_flags(add: AddArgument) -> None:
    """What is served, under which names, where it listens, and its tokenizer."""
    add("model_tag", nargs="?", default=None, metavar="MODEL",
        help=f"DeepSeek-V4 checkpoint directory, the same as --model (default: {BUILTIN_MODEL}, built in)")
    add("--model", default=None, metavar="DIR",
        help=f"DeepSeek-V4 checkpoint directory (default: {BUILTIN_MODEL}: random weights, real V4 tokenizer)")
    add("--served-model-name", nargs="+", default=None, metavar="NAME",
        help="model names the API answers to; the first is the one reported (default: the model as given)")
    add("--host", default="127.0.0.1",
        help="address to bind (default: %(default)s, this machine only; vLLM binds all interfaces: "
             "pass --host 0.0.0.0 for that)")
    add("--port", type=_port, default=8000, help="port to listen on, 0..65535 (default: %(default)s)")
    add("--tokenizer", default=None, metavar="DIR",
        help="directory with tokenizer.json (default: the model's own, else the bundled V4 tokenizer)")


def _add_engine_flags(add: AddArgument) -> None:
    """How the engine lays out the model: devices, weight loading, memory, sequence limits, dtypes
    and KV blocks (and --trust-remote-code, which loads nothing)."""
    add("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
        help="devices each data-parallel rank splits the model over: query heads, output groups, "
             "vocabulary and experts' intermediate dimension (default: %(default)s)")
    add("--data-parallel-size", "-dp", type=_positive_int, default=1,
        help="data-parallel attention ranks, each with its own KV pools and --max-num-seqs sequences; "
             "the mesh is dp x tp devices, the first ones visible (default: %(default)s)")
    add("--enable-expert-parallel", action="store_true",
        help="place whole routed experts on the dp x tp devices instead of splitting every expert "
             "over tp (default: off)")
    add("--load-format", choices=("auto", "safetensors", "orbax"), default="auto",
        help="auto: restore the converted-weights cache of this checkpoint and mesh, else read the "
             "safetensors and write it; safetensors: never use the cache; orbax: the cache only "
             "(docs/deployment.md; default: %(default)s)")
    add("--gpu-memory-utilization", type=_memory_fraction, default=0.9,
        help="fraction of device memory for weights and KV cache, in (0, 1] (default: %(default)s)")
    add("--max-num-seqs", type=_positive_int, default=None,
        help="sequences decoded together at most, per data-parallel rank (default: as vLLM's, 1024 on GPUs with "
             "70 GiB or more and 256 on smaller ones, at most what the KV pools hold; 8 on CPUs)")
    add("--max-num-batched-tokens", type=_human_positive_int, default=None,
        help="tokens per engine step at most (default: None = chosen from --max-num-seqs and the chunk length)")
    add("--num-gpu-blocks-override", type=_positive_int, default=None,
        help="number of compressed KV blocks, instead of sizing them from memory (default: None)")
    add("--max-model-len", type=_human_positive_int, default=None,
        help="prompt + output tokens per sequence at most (default: the model's max_position_embeddings, "
             "at most 4096)")
    add("--dtype", type=_dtype, default="auto", metavar="{" + ",".join(DTYPES) + "}",
        help="compute dtype; auto = the checkpoint's own (default: %(default)s)")
    add("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
        help="KV cache format; auto = fp8_ds_mla where the GPU has fp8, else bfloat16 (default: %(default)s)")
    add("--attention-backend", default=None, metavar="{" + ",".join(ATTENTION_BACKENDS) + "}",
        help="attention kernels; vLLM's FLASHMLA_SPARSE* names mean pallas_fp8_ds_mla "
             "(default: None = chosen by the KV resolver for the device)")
    add("--block-size", type=_block_size, default=256,
        help=f"token positions per KV block, a positive multiple of {BLOCK_SIZE_MULTIPLE} (default: %(default)s)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="reuse the KV of a prompt's leading full blocks that an earlier request computed; "
             "--no-enable-prefix-caching turns it off (default: on, as vLLM)")
    add("--prefix-caching-hash-algo", choices=HASH_ALGOS, default="sha256",
        help="hash naming a cached block by its tokens and its prefix's; the xxhash ones need the xxhash "
             "package (default: %(default)s)")
    add("--num-prefix-snapshots", type=_positive_int, default=None, metavar="N",
        help="sliding-window and compressor states the prefix cache keeps per data-parallel rank, one per "
             "cached block boundary a hit may start from (default: None = sized from the sequence slots)")
    add("--speculative-config", type=_speculative_json, default=None, metavar="JSON",
        help="speculative decoding as vLLM's JSON object: method (mtp or deepseek_mtp: the checkpoint's own "
             "MTP block drafts) and num_speculative_tokens (1 to 4), e.g. "
             "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'; steps are then scheduled one at a time "
             "(default: None = off)")
    add("--trust-remote-code", action="store_true", default=argparse.SUPPRESS,
        help="accepted for vLLM compatibility and does nothing: no code from a model directory is ever run "
             "(default: off)")


def _add_parser_flags(add: AddArgument) -> None:
    """Tool calls, reasoning and structured outputs in the model's output. The parsers are on by
    default (vLLM's are off): this server serves one model, whose formats they are."""
    add("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
        help="let the model call tools when a request allows it (tool_choice \"auto\"); "
             "--no-enable-auto-tool-choice answers such requests 400, as vLLM without the flag (default: on)")
    add("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="deepseek_v4",
        help="format of the model's tool calls (default: %(default)s)")
    add("--reasoning-parser", choices=REASONING_PARSERS, default="deepseek_v4", metavar="{deepseek_v4,''}",
        help="return the thinking as reasoning_content, and start structured outputs after it; '' for "
             "neither: the thinking stays in content and a constraint binds from the first token "
             "(default: %(default)s)")
    add("--structured-outputs-config", type=_structured_outputs_json, default=None, metavar="JSON",
        help="vLLM's structured-outputs settings as a JSON object: backend (guidance or auto, both "
             "llguidance), enable_in_reasoning, reasoning_parser (default: --reasoning-parser's), "
             "disable_any_whitespace, disable_additional_properties, disable_fallback, compile_timeout_s "
             "(default: None = the engine's defaults)")


def _add_server_flags(add: AddArgument) -> None:
    """The API key, the sampler's seed, request defaults and limits, HTTP logging, the chat page and
    the scheduling mode."""
    add("--api-key", default=None,
        help=f"key clients must send as a Bearer token (default: the {API_KEY_ENV} environment variable, "
             "else none: no key needed)")
    add("--seed", type=_int, default=0, help="seed of the sampler (default: %(default)s)")
    add("--generation-config", default="auto", metavar="{auto,vllm,DIR}",
        help="request defaults from generation_config.json: auto = the model directory's if present, vllm = "
             "none, or a directory holding the file (default: %(default)s)")
    add("--uvicorn-log-level", choices=UVICORN_LOG_LEVELS, default="info",
        help="log level of the HTTP server (default: %(default)s)")
    add("--disable-access-log-for-endpoints", type=_paths, default=DEFAULT_QUIET_ENDPOINTS, metavar="PATHS",
        help="comma-separated paths whose requests leave no access-log line, '' for none "
             f"(default: {','.join(DEFAULT_QUIET_ENDPOINTS)}: the probes a supervisor and Prometheus send)")
    add("--disable-uvicorn-access-log", action="store_true", help="no access-log line for any request (default: off)")
    add("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
        help="a JSON object of chat-template arguments for every request, e.g. '{\"thinking\": false}' "
             "(default: None)")
    add("--enable-force-include-usage", action="store_true",
        help="every streamed response carries usage: in each chunk (the usage so far) and in a last chunk, "
             "whatever the request's stream_options say (default: off)")
    add("--enable-prompt-tokens-details", action="store_true",
        help="usage carries prompt_tokens_details.cached_tokens: the prompt tokens served from the prefix "
             "cache (default: off)")
    add("--max-logprobs", type=_max_logprobs, default=MAX_LOGPROBS,
        help=f"top logprobs a request may ask for, 0..{MAX_LOGPROBS} (default: %(default)s)")
    add("--max-waiting-requests", type=_positive_int, default=1024,
        help="sequences (prompts x n) that may wait for a slot; a request that would queue more gets 503 "
             "(default: %(default)s)")
    add("--no-web-ui", action="store_true", help="do not serve the browser chat page (default: off)")
    add("--disable-log-stats", action="store_true",
        help=f"no periodic stats line in the log (default: off: every {LOG_STATS_INTERVAL_ENV} seconds, "
             f"{DEFAULT_LOG_STATS_INTERVAL_S:g} unless set, while requests are served: throughput, running and "
             "waiting requests, KV cache usage, prefix cache hit rate, speculative decoding acceptance)")
    add("--no-async-scheduling", action="store_true",
        help="schedule each step only after the last one's tokens reach the host (default: off, i.e. the next "
             "step is scheduled while the device runs this one)")


def _add_vllm_only_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that are accepted and change nothing, then those refused."""
    for flag, (takes_value, why) in IGNORED_FLAGS.items():
        _add_presence_flag(parser, flag, takes_value,
                           f"accepted for vLLM compatibility, changes nothing: {why} (default: off)")
    for flag, (takes_value, why) in REFUSED_FLAGS.items():
        _add_presence_flag(parser, flag, takes_value, f"refused: {why} (default: off)")


def _add_presence_flag(parser: argparse.ArgumentParser, flag: str, takes_value: bool, help_text: str) -> None:
    """A flag whose only effect is being present (absent ones leave no attribute)."""
    if takes_value:
        parser.add_argument(flag, default=argparse.SUPPRESS, metavar="VALUE", help=help_text)
    else:
        parser.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=help_text)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _dashed(argv: Sequence[str]) -> list[str]:
    """`--max_model_len=8k` -> `--max-model-len=8k`: vLLM accepts underscores in flag names."""
    out = []
    for arg in argv:
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            arg = name.replace("_", "-") + eq + value
        out.append(arg)
    return out


def _attention_backend(value: str | None) -> str | None:
    if value is None:
        return None
    if value.strip().lower() in ATTENTION_BACKENDS:
        return value.strip().lower()
    if value.strip().upper().startswith(VLLM_FLASHMLA_PREFIX):
        logger.info("--attention-backend %s is vLLM's sparse MLA backend for DeepSeek-V4: using pallas_fp8_ds_mla",
                    value)
        return "pallas_fp8_ds_mla"
    raise ValueError(
        f"--attention-backend {value!r} is not a DeepSeek-V4 attention backend; allowed: "
        f"{', '.join(ATTENTION_BACKENDS)}, vLLM's {VLLM_FLASHMLA_PREFIX}* (or leave it unset to choose by device)"
    )


def _model(namespace: argparse.Namespace) -> str | None:
    positional, flag = namespace.model_tag, namespace.model
    if positional is not None and flag is not None and positional != flag:
        raise ValueError(f"MODEL {positional!r} and --model {flag!r} differ; give the model once")
    return positional if positional is not None else flag


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parse and check `argv` (default: sys.argv[1:]). A bad value, an unknown or refused flag
    and a conflict between flags raise a ValueError naming them (run_main makes it one line)."""
    parser = build_parser()
    namespace, extra = parser.parse_known_args(_dashed(sys.argv[1:] if argv is None else argv))
    _refuse_unsupported(namespace, extra)
    model = _model(namespace)
    attention_backend = _attention_backend(namespace.attention_backend)
    structured_outputs = _structured_outputs_config(namespace)
    speculative = _speculative_config(namespace)
    ignored = _ignored_flags(namespace)  # warned only once every check has passed
    for line in ignored:
        logger.warning("%s", line)
    engine = _engine_args(namespace, model or BUILTIN_MODEL, attention_backend, structured_outputs, speculative)
    if namespace.headless != (namespace.node_rank > 0):
        DistributedConfig(namespace.nnodes, namespace.node_rank, namespace.master_addr, namespace.master_port,
                          namespace.headless)  # its ValueError names --headless / --node-rank
    return _server_args(namespace, engine, tuple(ignored))


def _refuse_unsupported(namespace: argparse.Namespace, extra: list[str]) -> None:
    """Raises for flags argparse left over, a refused vLLM flag, or a tool choice without a parser."""
    unknown = [arg.partition("=")[0] for arg in extra if arg.startswith("-")]
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not supported by dsv4-jax (see {USAGE_PROG} --help for its flags)")
    if extra:
        raise ValueError(f"unexpected argument(s) {' '.join(extra)!r}: give one MODEL")
    for flag, (_, why) in REFUSED_FLAGS.items():
        if hasattr(namespace, _dest(flag)):
            raise ValueError(f"{flag}: {why}")


def _ignored_flags(namespace: argparse.Namespace) -> list[str]:
    """One warning line per vLLM flag given that changes nothing here."""
    ignored = []
    for flag, (takes_value, why) in IGNORED_FLAGS.items():
        if hasattr(namespace, _dest(flag)):
            given = f"{flag} {getattr(namespace, _dest(flag))}" if takes_value else flag
            ignored.append(f"{given} is ignored: {why}")
    return ignored


def _structured_outputs_config(namespace: argparse.Namespace) -> dict[str, Any] | None:
    """--structured-outputs-config, checked now (a bad key or backend is one line before anything
    loads), with --reasoning-parser as its reasoning_parser unless it names one (as vLLM does).
    None when that is the engine's default, so the default flags give `LLM()`'s EngineArgs."""
    config = dict(namespace.structured_outputs_config or {})
    config.setdefault("reasoning_parser", namespace.reasoning_parser)
    try:
        StructuredOutputsConfig.parse(config)
    except ValueError as error:
        raise ValueError(f"--structured-outputs-config: {error}") from None
    return None if config == {"reasoning_parser": StructuredOutputsConfig().reasoning_parser} else config


def _speculative_config(namespace: argparse.Namespace) -> dict[str, Any] | None:
    """--speculative-config, checked now: a bad method, k or key is one line (naming the flag)
    before anything loads. Whether the checkpoint has an MTP block to draft with is checked with
    its config.json, before the port opens (`EngineArgs.create_engine_config`)."""
    config = namespace.speculative_config
    SpeculativeConfig.parse(config)  # its ValueErrors name --speculative-config
    return config


def _engine_args(namespace: argparse.Namespace, model: str, attention_backend: str | None,
                 structured_outputs: dict[str, Any] | None, speculative: dict[str, Any] | None) -> EngineArgs:
    return EngineArgs(
        model=model,
        tokenizer=namespace.tokenizer,
        tensor_parallel_size=namespace.tensor_parallel_size,
        data_parallel_size=namespace.data_parallel_size,
        enable_expert_parallel=namespace.enable_expert_parallel,
        load_format=namespace.load_format,
        gpu_memory_utilization=namespace.gpu_memory_utilization,
        max_num_seqs=namespace.max_num_seqs,
        max_num_batched_tokens=namespace.max_num_batched_tokens,
        num_gpu_blocks_override=namespace.num_gpu_blocks_override,
        max_model_len=namespace.max_model_len,
        dtype=namespace.dtype,
        kv_cache_dtype=namespace.kv_cache_dtype,
        attention_backend=attention_backend,
        block_size=namespace.block_size,
        seed=namespace.seed,
        generation_config=namespace.generation_config,
        async_scheduling=not namespace.no_async_scheduling,
        nnodes=namespace.nnodes,
        node_rank=namespace.node_rank,
        master_addr=namespace.master_addr,
        master_port=namespace.master_port,
        structured_outputs_config=structured_outputs,
        enable_prefix_caching=namespace.enable_prefix_caching,
        prefix_caching_hash_algo=namespace.prefix_caching_hash_algo,
        num_prefix_snapshots=namespace.num_prefix_snapshots,
        speculative_config=speculative,
    )


def _server_args(namespace: argparse.Namespace, engine: EngineArgs, ignored: tuple[str, ...]) -> ServerArgs:
    return ServerArgs(
        engine=engine,
        model_is_builtin=engine.model == BUILTIN_MODEL,
        served_model_name=tuple(namespace.served_model_name or [engine.model]),
        host=namespace.host,
        port=namespace.port,
        enable_auto_tool_choice=namespace.enable_auto_tool_choice,
        tool_call_parser=namespace.tool_call_parser,
        reasoning_parser=namespace.reasoning_parser or None,  # '': no reasoning split
        api_key=namespace.api_key or os.environ.get(API_KEY_ENV) or None,
        dev_mode=_dev_mode(),
        uvicorn_log_level=namespace.uvicorn_log_level,
        disable_access_log_for_endpoints=namespace.disable_access_log_for_endpoints,
        disable_uvicorn_access_log=namespace.disable_uvicorn_access_log,
        default_chat_template_kwargs=namespace.default_chat_template_kwargs,
        enable_force_include_usage=namespace.enable_force_include_usage,
        enable_prompt_tokens_details=namespace.enable_prompt_tokens_details,
        max_logprobs=namespace.max_logprobs,
        max_waiting_requests=namespace.max_waiting_requests,
        no_web_ui=namespace.no_web_ui,
        disable_log_stats=namespace.disable_log_stats,
        log_stats_interval=_log_stats_interval(),
        debug=namespace.debug,
        ignored_flags=ignored,
    )


def _dev_mode() -> bool:
    """VLLM_SERVER_DEV_MODE as vLLM reads it: an integer, on unless 0 (unset: off)."""
    text = os.environ.get(DEV_MODE_ENV, "").strip()
    try:
        return bool(int(text or "0"))
    except ValueError:
        raise ValueError(f"{DEV_MODE_ENV}={text!r} is not an integer (1 serves the development endpoints, "
                         "0 or unset does not)") from None


def _log_stats_interval() -> float:
    """VLLM_LOG_STATS_INTERVAL as vLLM reads it: seconds, a number; 10 when unset or not above 0."""
    text = os.environ.get(LOG_STATS_INTERVAL_ENV, "").strip()
    try:
        value = float(text or DEFAULT_LOG_STATS_INTERVAL_S)
    except ValueError:
        raise ValueError(f"{LOG_STATS_INTERVAL_ENV}={text!r} is not a number (seconds between two stats lines; "
                         f"unset: {DEFAULT_LOG_STATS_INTERVAL_S:g})") from None
    return value if value > 0 and math.isfinite(value) else DEFAULT_LOG_STATS_INTERVAL_S
