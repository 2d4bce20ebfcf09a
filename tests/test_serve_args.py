"""The command line of `python -m serve` (serve/args.py): vLLM's flag names and defaults, the
flags accepted but ignored, the ones refused, and one-line errors with exit status 2.

Pure Python: nothing here compiles; the only jax import is the check that the names mirrored in
serve/args.py agree with their owners.
"""

from __future__ import annotations

import json
import logging
import sys

import pytest

from dsv4_jax.engine.args import EngineArgs
from dsv4_jax.engine.sampling_params import generation_defaults as sampling_defaults
from dsv4_jax.engine.speculative import SpeculativeConfig
from dsv4_jax.engine.structured_outputs import StructuredOutputsConfig
from dsv4_jax.parallel.distributed import DistributedConfig
from pallas_kernels.cli import run_main
from serve.args import (API_KEY_ENV, DEV_MODE_ENV, IGNORED_FLAGS, LOG_STATS_INTERVAL_ENV, ServerArgs, build_parser,
                        node_flags, parse_args)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(DEV_MODE_ENV, raising=False)
    monkeypatch.delenv(LOG_STATS_INTERVAL_ENV, raising=False)
    monkeypatch.delenv("DSV4_DEBUG", raising=False)


def _error_line(argv: list[str], capsys) -> str:
    """The stderr of the entry point on `argv`: it must exit 2 with exactly one line."""
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda args: parse_args(args) and 0, argv, prog="serve")
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("serve: error: ")
    return lines[0]


# ---- values -------------------------------------------------------------------------------------
def test_defaults():
    args = parse_args([])
    assert args.engine == EngineArgs()  # the engine's own defaults, vLLM's names
    assert (args.model, args.model_is_builtin, args.served_model_name) == ("dsv4-tiny", True, ("dsv4-tiny",))
    assert (args.host, args.port, args.engine.tokenizer) == ("127.0.0.1", 8000, None)
    e = args.engine
    assert (e.tensor_parallel_size, e.data_parallel_size, e.enable_expert_parallel) == (1, 1, False)
    # max_num_seqs and max_model_len: chosen for the device and the model (EngineArgs.create_engine_config)
    assert (e.gpu_memory_utilization, e.max_num_seqs, e.max_model_len) == (0.9, None, None)
    assert (e.max_num_batched_tokens, e.num_gpu_blocks_override) == (None, None)
    assert (e.dtype, e.kv_cache_dtype, e.attention_backend, e.block_size) == ("auto", "auto", None, 256)
    # Unlike vLLM's (off): this server serves one model, whose tool-call and reasoning formats they are.
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser) == (
        True, "deepseek_v4", "deepseek_v4")
    assert (args.api_key, e.seed, e.generation_config, args.uvicorn_log_level) == (None, 0, "auto", "info")
    assert (args.default_chat_template_kwargs, args.max_logprobs, args.max_waiting_requests) == (None, 20, 1024)
    assert (args.no_web_ui, args.debug, args.ignored_flags, args.enable_force_include_usage) == (False, False, (), False)
    assert (args.disable_access_log_for_endpoints, args.disable_uvicorn_access_log) == (("/health", "/metrics"), False)
    # Prefix caching on (None: vLLM's "unset", which is on), sha256, snapshots sized by the engine;
    # usage without prompt_tokens_details and no development endpoints, as vLLM.
    assert (e.enable_prefix_caching, e.prefix_caching_hash_algo, e.num_prefix_snapshots) == (None, "sha256", None)
    assert (args.enable_prompt_tokens_details, args.dev_mode) == (False, False)
    # No speculation; the periodic stats line on every 10 s, as vLLM.
    assert (e.speculative_config, args.disable_log_stats, args.log_stats_interval) == (None, False, 10.0)


def test_every_flag_by_its_vllm_name(tmp_path):
    argv = [
        str(tmp_path), "--served-model-name", "deepseek-ai/DeepSeek-V4-Flash", "v4", "--host", "0.0.0.0",
        "--port", "0", "--tokenizer", "/tok", "--tensor-parallel-size", "2", "--data-parallel-size", "4",
        "--enable-expert-parallel", "--load-format", "orbax", "--gpu-memory-utilization", "0.5", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "512", "--num-gpu-blocks-override", "40", "--max-model-len", "1024",
        "--dtype", "float32", "--kv-cache-dtype", "fp8", "--attention-backend", "pallas_bf16", "--block-size", "384",
        "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v4",
        "--reasoning-parser", "deepseek_v4", "--api-key", "k", "--seed", "-7", "--generation-config", "vllm",
        "--uvicorn-log-level", "trace", "--default-chat-template-kwargs", '{"thinking": false}',
        "--max-logprobs", "0", "--max-waiting-requests", "5", "--no-web-ui", "--no-async-scheduling", "--debug",
        "--enable-force-include-usage", "--disable-access-log-for-endpoints", "/health,/v1/models",
        "--disable-uvicorn-access-log", "--enable-prefix-caching", "--prefix-caching-hash-algo", "sha256_cbor",
        "--num-prefix-snapshots", "12", "--enable-prompt-tokens-details", "--disable-log-stats",
        "--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 3}',
    ]
    assert parse_args(argv) == ServerArgs(
        engine=EngineArgs(
            model=str(tmp_path), tokenizer="/tok", tensor_parallel_size=2, data_parallel_size=4,
            enable_expert_parallel=True, load_format="orbax", gpu_memory_utilization=0.5, max_num_seqs=3,
            max_num_batched_tokens=512, num_gpu_blocks_override=40, max_model_len=1024, dtype="float32",
            kv_cache_dtype="fp8", attention_backend="pallas_bf16", block_size=384, seed=-7, generation_config="vllm",
            async_scheduling=False, enable_prefix_caching=True, prefix_caching_hash_algo="sha256_cbor",
            num_prefix_snapshots=12, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 3},
        ),
        model_is_builtin=False, served_model_name=("deepseek-ai/DeepSeek-V4-Flash", "v4"), host="0.0.0.0", port=0,
        enable_auto_tool_choice=True, tool_call_parser="deepseek_v4", reasoning_parser="deepseek_v4", api_key="k",
        uvicorn_log_level="trace", disable_access_log_for_endpoints=("/health", "/v1/models"),
        disable_uvicorn_access_log=True, default_chat_template_kwargs={"thinking": False},
        enable_force_include_usage=True, max_logprobs=0, max_waiting_requests=5, no_web_ui=True, debug=True,
        ignored_flags=(), enable_prompt_tokens_details=True, dev_mode=False, disable_log_stats=True,
        log_stats_interval=10.0,
    )
    assert parse_args(argv).distributed == DistributedConfig()


def test_short_parallel_flags_are_kept_as_given():
    args = parse_args(["-tp", "2", "-dp", "8"]).engine
    assert (args.tensor_parallel_size, args.data_parallel_size) == (2, 8)


def test_model_as_flag_or_positional_names_the_served_model():
    assert parse_args(["--model", "/ckpt/"]).served_model_name == ("/ckpt/",)  # as given, not normalised
    same = parse_args(["/ckpt", "--model", "/ckpt"])
    assert (same.model, same.model_is_builtin) == ("/ckpt", False)
    assert parse_args(["dsv4-tiny"]).model_is_builtin


def test_api_key_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse_args([]).api_key == "from-env"
    args = parse_args(["--api-key", "secret-flag"])
    assert args.api_key == "secret-flag" and "secret-flag" not in repr(args)


def test_vllm_spellings_underscores_and_human_readable_sizes():
    args = parse_args(["--max_model_len=8k", "--max-num-batched-tokens", "2K"]).engine
    assert (args.max_model_len, args.max_num_batched_tokens) == (8000, 2048)
    assert parse_args(["--max-model-len", "1.5k"]).engine.max_model_len == 1500


@pytest.mark.parametrize("name", ["FLASHMLA_SPARSE", "flashmla_sparse_v4"])
def test_vllm_flashmla_sparse_means_pallas_fp8_ds_mla(name, caplog):
    with caplog.at_level(logging.INFO, logger="serve"):
        assert parse_args(["--attention-backend", name]).engine.attention_backend == "pallas_fp8_ds_mla"
    assert [r.levelno for r in caplog.records] == [logging.INFO] and name in caplog.records[0].getMessage()


@pytest.mark.parametrize("flag", list(IGNORED_FLAGS))
def test_ignored_vllm_flag_parses_with_one_warning(flag, caplog):
    argv = [flag, "deepseek_v4"] if IGNORED_FLAGS[flag][0] else [flag]
    with caplog.at_level(logging.WARNING, logger="serve"):
        args = parse_args(argv)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(flag)
    assert args.ignored_flags == tuple(warnings)


def test_prefix_caching_flags_as_vllm():
    """On unless turned off (vLLM's default), in either spelling; vLLM's hash names; no warning:
    --no-enable-prefix-caching is a real flag now, not an ignored one."""
    for argv, expected in (([], None), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False),
                           (["--no_enable_prefix_caching"], False),
                           (["--no-enable-prefix-caching", "--enable-prefix-caching"], True)):  # the last one counts
        args = parse_args(argv)
        assert (args.engine.enable_prefix_caching, args.ignored_flags) == (expected, ()), argv
    assert not {"--enable-prefix-caching", "--no-enable-prefix-caching"} & set(IGNORED_FLAGS)
    for algo in ("sha256", "sha256_cbor"):  # the standard library's and cbor2 (a dependency): always there
        assert parse_args(["--prefix-caching-hash-algo", algo]).engine.prefix_caching_hash_algo == algo
    assert parse_args(["--num-prefix-snapshots", "3"]).engine.num_prefix_snapshots == 3


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("installed", [True, False])
def test_xxhash_algos_work_exactly_when_xxhash_imports(algo, installed, monkeypatch, capsys):
    if installed:
        pytest.importorskip("xxhash")
    else:
        monkeypatch.setitem(sys.modules, "xxhash", None)  # `import xxhash` raises ImportError
    argv = ["--prefix-caching-hash-algo", algo]
    if installed:
        assert parse_args(argv).engine.prefix_caching_hash_algo == algo
    else:
        line = _error_line(argv, capsys)
        assert "--prefix-caching-hash-algo" in line and "pip install xxhash" in line


@pytest.mark.parametrize("value, on", [("1", True), ("0", False), ("", False), (" 2 ", True)])
def test_dev_mode_is_vllms_integer_environment_switch(value, on, monkeypatch):
    monkeypatch.setenv(DEV_MODE_ENV, value)
    assert parse_args([]).dev_mode is on


def test_a_dev_mode_that_is_not_an_integer_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setenv(DEV_MODE_ENV, "yes")
    assert DEV_MODE_ENV in _error_line([], capsys)


def test_every_help_states_the_default():
    actions = [a for a in build_parser()._actions if a.dest != "help"]
    assert [a.dest for a in actions if "default" not in (a.help or "")] == []


# ---- errors: one line on stderr, exit status 2 ----------------------------------------------------
@pytest.mark.parametrize("argv, named", [
    (["--port", "70000"], "--port"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--block-size", "100"], "--block-size"),
    (["--default-chat-template-kwargs", "{thinking: false}"], "--default-chat-template-kwargs"),
    (["--default-chat-template-kwargs", "[1]"], "--default-chat-template-kwargs"),
    (["/a", "--model", "/b"], "--model"),
    (["--reasoning-parser", "deepseek_r1"], "--reasoning-parser"),
    (["--tool-call-parser", "hermes"], "--tool-call-parser"),
    (["--structured-outputs-config", "{backend: guidance}"], "--structured-outputs-config"),
    (["--structured-outputs-config", '["guidance"]'], "--structured-outputs-config"),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'], "--structured-outputs-config"),
    (["--structured-outputs-config", '{"backend": "nope"}'], "--structured-outputs-config"),
    (["--structured-outputs-config", '{"enable_in_reasoning": "yes"}'], "--structured-outputs-config"),
    (["--structured-outputs-config", '{"compile_timeout_s": 0}'], "--structured-outputs-config"),
    (["--structured-outputs-config", '{"guided_backend": "guidance"}'], "--structured-outputs-config"),
    (["--quantization", "fp8"], "--quantization"),
    (["--max-model", "10"], "--max-model"),  # no prefix matching of --max-model-len
    (["--dtype", "half"], "--dtype"),
    (["--speculative-config", "{method: mtp}"], "--speculative-config"),  # not JSON
    (["--speculative-config", "[1]"], "--speculative-config"),
    (["--speculative-config", '{"method": "mtp"}'], "--speculative-config"),  # k missing
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'], "--speculative-config"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 5}'], "--speculative-config"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": "2"}'], "--speculative-config"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "--speculative-config"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}'],
     "--speculative-config"),  # unknown key
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2, "model": "/draft"}'],
     "--speculative-config"),
    (["--prefix-caching-hash-algo", "md5"], "--prefix-caching-hash-algo"),
    (["--prefix-caching-hash-algo", "builtin"], "--prefix-caching-hash-algo"),  # vLLM's old default, gone there too
    (["--num-prefix-snapshots", "0"], "--num-prefix-snapshots"),
    (["--enable-prefix-caching=yes"], "--enable-prefix-caching"),
    (["--attention-backend", "FLASHINFER"], "--attention-backend"),
    (["--kv-cache-dtype", "int8"], "--kv-cache-dtype"),
    (["-tp", "0"], "--tensor-parallel-size"),
    (["--max-num-seqs", "many"], "--max-num-seqs"),
    (["--max-model-len", "1.5K"], "--max-model-len"),
    (["--max-logprobs", "21"], "--max-logprobs"),
    (["--max-waiting-requests", "0"], "--max-waiting-requests"),
])
def test_bad_command_line_is_one_line_naming_the_flag(argv, named, capsys):
    assert named in _error_line(argv, capsys)


@pytest.mark.parametrize("value, why", [
    ('{"method": "mtp", "num_speculative_tokens": 9}', "from 1 to 4"),
    ('{"method": "ngram", "num_speculative_tokens": 2}', "mtp, deepseek_mtp"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 4}', "prompt_lookup_max"),
    ('{"method": "mtp", "num_speculative_tokens": 2', "not valid JSON"),
])
def test_a_bad_speculative_config_says_what_is_wrong(value, why, capsys):
    line = _error_line(["--speculative-config", value], capsys)
    assert "--speculative-config" in line and why in line


def test_half_precision_points_to_bfloat16_or_float32(capsys):
    assert "bfloat16 or float32" in _error_line(["--dtype", "float16"], capsys)


@pytest.mark.parametrize("backend", ["xgrammar", "outlines", "lm-format-enforcer"])
def test_vllms_other_structured_output_backends_point_to_guidance(backend, capsys):
    line = _error_line(["--structured-outputs-config", json.dumps({"backend": backend})], capsys)
    assert backend in line and "guidance" in line


def test_a_node_with_refused_flags_still_knows_where_to_join():
    """A node of several tells the others why its flags are refused (they would wait for it in
    jax.distributed.initialize): where to join comes from the node flags alone, whatever else fails."""
    node = ["--nnodes", "2", "--master-addr", "10.0.0.1", "--master_port=1234"]
    refused = ["--max-num-seqs", "many", "--quantization", "fp8", "-tp", "2"]
    assert node_flags([*refused, *node, "--node-rank", "1"]) == DistributedConfig(2, 1, "10.0.0.1", 1234, headless=True)
    assert node_flags([*node, "--node-rank", "1"]) == DistributedConfig(2, 1, "10.0.0.1", 1234, headless=True)
    assert node_flags(refused) is None  # one node: nobody waits
    assert node_flags([*node, "--headless"]) is None  # a follower without its rank: not node 0
    assert node_flags([*node, "--node-rank", "2"]) is None  # nowhere to join
    assert node_flags([*node, "--master-port", "0"]) is None
    twice = [*node, "--node-rank", "0", "--node_rank=1", "--headless"]  # the last one counts, as in parse_args
    assert node_flags([*twice, *refused]) == parse_args(twice).distributed == DistributedConfig(
        2, 1, "10.0.0.1", 1234, headless=True)
    assert node_flags(["--nnode", "2"]) is None  # no prefix matching here either


# ---- what the server makes of them -------------------------------------------------------------
def test_the_engine_flags_are_the_engine_arguments_llm_takes():
    """One set of engine arguments: the server's flags parse into the `EngineArgs` that `LLM(...)`
    builds from its keywords (`LLM.from_engine_args` takes the server's as they are)."""
    args = parse_args(["/ckpt", "--max-model-len", "2048", "--seed", "3", "--attention-backend", "xla"])
    assert args.engine == EngineArgs(model="/ckpt", max_model_len=2048, seed=3, attention_backend="xla")


@pytest.mark.parametrize("argv", [
    ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'],
    ['--speculative_config={"method": "mtp", "num_speculative_tokens": 2}'],  # vLLM's underscore spelling
])
def test_speculative_config_reaches_the_engine_arguments_as_llm_takes_them(argv):
    """vLLM's JSON, as given, is `EngineArgs.speculative_config` (what `LLM(speculative_config=...)`
    sets), with no warning: speculation is a real flag now."""
    args = parse_args(argv)
    assert args.engine == EngineArgs(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert SpeculativeConfig.parse(args.engine.speculative_config) == SpeculativeConfig("mtp", 2)
    assert args.ignored_flags == ()
    k4 = parse_args(["--speculative-config", '{"method": "deepseek_mtp", "num_speculative_tokens": 4}'])
    assert SpeculativeConfig.parse(k4.engine.speculative_config) == SpeculativeConfig("deepseek_mtp", 4)


def test_disable_log_stats_turns_the_stats_line_off_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="serve"):
        args = parse_args(["--disable-log-stats"])
    assert (args.disable_log_stats, args.ignored_flags, caplog.records) == (True, (), [])
    assert "--disable-log-stats" not in IGNORED_FLAGS


@pytest.mark.parametrize("value, seconds", [("2.5", 2.5), (" 30 ", 30.0), ("0", 10.0), ("-1", 10.0), ("", 10.0),
                                            ("inf", 10.0)])
def test_log_stats_interval_is_vllms_environment_variable(value, seconds, monkeypatch):
    monkeypatch.setenv(LOG_STATS_INTERVAL_ENV, value)
    assert parse_args([]).log_stats_interval == seconds  # not above 0 (or not finite): vLLM's 10


def test_a_log_stats_interval_that_is_not_a_number_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setenv(LOG_STATS_INTERVAL_ENV, "ten")
    assert LOG_STATS_INTERVAL_ENV in _error_line([], capsys)


def test_parser_flags_and_structured_outputs_config_as_vllm():
    """The parsers are on by default and each flag turns its part off; --structured-outputs-config
    is vLLM's JSON, with --reasoning-parser as its reasoning_parser unless the JSON names one (as
    vLLM does), so constraints start after the reasoning exactly when the reasoning is split off."""
    off = parse_args(["--no-enable-auto-tool-choice", "--reasoning-parser", ""])
    assert (off.enable_auto_tool_choice, off.tool_call_parser, off.reasoning_parser) == (False, "deepseek_v4", None)
    assert StructuredOutputsConfig.parse(off.engine.structured_outputs_config) == \
        StructuredOutputsConfig(reasoning_parser="")
    assert parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "deepseek_v4"]).enable_auto_tool_choice
    assert parse_args([]).engine.structured_outputs_config is None  # the engine's defaults, as LLM() has
    for argv, expected in (
        (["--structured-outputs-config", '{"enable_in_reasoning": true}'],
         StructuredOutputsConfig(enable_in_reasoning=True, reasoning_parser="deepseek_v4")),
        (["--structured-outputs-config", '{"backend": "guidance"}', "--reasoning-parser", ""],
         StructuredOutputsConfig(backend="guidance", reasoning_parser="")),
        (["--structured-outputs-config", '{"reasoning_parser": ""}'], StructuredOutputsConfig(reasoning_parser="")),
        (["--structured_outputs_config={\"disable_any_whitespace\": true, \"compile_timeout_s\": 5}"],
         StructuredOutputsConfig(disable_any_whitespace=True, compile_timeout_s=5)),
    ):
        args = parse_args(argv)
        assert StructuredOutputsConfig.parse(args.engine.structured_outputs_config) == expected, argv
        assert args.reasoning_parser == (None if "" in argv else "deepseek_v4")  # the split follows the flag only


def test_mirrored_names_agree_with_their_owners():
    from dsv4_jax.kv_cache import planner, resolver
    from serve import args

    assert set(args.KV_CACHE_DTYPES) <= set(resolver.ACCEPTED_REQUESTS)
    assert set(args.ATTENTION_BACKENDS) == set(resolver.ATTENTION_BACKENDS)
    assert args.BLOCK_SIZE_MULTIPLE == planner.BLOCK_SIZE_MULTIPLE


def generation_defaults(args: ServerArgs, model_dir) -> dict:
    """The sampling defaults the engine reads for these flags (`EngineArgs.create_engine_config`)."""
    return sampling_defaults(model_dir, args.engine.generation_config, "generation_config (--generation-config)")


def _write_generation_config(folder, content) -> None:
    folder.mkdir(exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content)
    (folder / "generation_config.json").write_text(text)


def test_generation_defaults_take_vllms_keys_from_the_model_directory(tmp_path):
    _write_generation_config(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": None,
                                        "max_new_tokens": 100, "eos_token_id": 1})
    expected = {"temperature": 0.6, "top_p": 0.95, "max_tokens": 100}
    assert generation_defaults(parse_args([]), tmp_path) == expected
    assert generation_defaults(parse_args(["--generation-config", "vllm"]), tmp_path) == {}
    assert generation_defaults(parse_args([]), tmp_path / "elsewhere") == {}  # auto without the file


def test_generation_defaults_from_a_named_folder(tmp_path):
    _write_generation_config(tmp_path / "gen", {"top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1})
    args = parse_args(["--generation-config", str(tmp_path / "gen")])
    assert generation_defaults(args, tmp_path) == {"top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="--generation-config"):
        generation_defaults(parse_args(["--generation-config", str(tmp_path)]), tmp_path)


@pytest.mark.parametrize("content, named", [("{oops", "JSON"), ("[0.6]", "list"), ({"temperature": -1}, "temperature")])
def test_malformed_generation_config_names_the_file(tmp_path, content, named):
    _write_generation_config(tmp_path, content)
    with pytest.raises(ValueError) as err:
        generation_defaults(parse_args([]), tmp_path)
    assert str(tmp_path / "generation_config.json") in str(err.value) and named in str(err.value)


def test_the_server_binds_every_address_of_its_host_or_names_the_flags():
    """`python -m serve` binds before the model loads, as uvicorn's asyncio server would have bound:
    every address the host names (one per family), each port given; a bad one is a ValueError
    naming --host and --port with what to do."""
    import socket

    from serve.server import _listen

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        everywhere = {socket.AF_INET, socket.AF_INET6}
    except OSError:  # no IPv6 on this machine
        everywhere = {socket.AF_INET}
    for host, families in (("127.0.0.1", {socket.AF_INET}), ("", everywhere)):
        listeners = _listen(host, 0)
        try:
            assert {listener.family for listener in listeners} == families, listeners
        finally:
            for listener in listeners:
                listener.close()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^--host 127\.0\.0\.1 --port {port}: cannot listen there: Address "
                                             r"already in use; pass a free --port$"):
            _listen("127.0.0.1", port)
    with pytest.raises(ValueError, match=r"^--host 192\.0\.2\.1 --port 8000: cannot listen there: .*; --host must be "
                                         r"an address of this machine$"):
        _listen("192.0.2.1", 8000)  # TEST-NET-1: never this machine's
