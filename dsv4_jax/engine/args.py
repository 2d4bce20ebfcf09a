"""The engine's arguments, in vLLM's `EngineArgs` names, checked once, and what they resolve to.

`EngineArgs` is what a user gives (`LLM(...)`'s keywords; `python -m serve`'s flags map onto it
one to one). Constructing it checks every value that needs nothing else. `create_engine_config()`
then makes the checks that need the model's config.json and the devices, never the weights
(seconds on a real checkpoint, so a bad flag fails before any loading), and resolves every
default once: the model directory, the compute dtype, `max_model_len`, `max_num_seqs`, the KV
layout (the resolver's one logged line), the step buckets and generation_config.json's sampling
defaults. The frozen `EngineConfig` it returns is what `engine/builder.py` builds the engine
from, for `LLM` and the server alike.

Nothing here imports jax at module level: the server's `--help` stays instant.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsv4_jax.parallel.distributed import DistributedConfig
from dsv4_jax.engine.speculative import SpeculativeConfig
from dsv4_jax.engine.structured_outputs import StructuredOutputsConfig

if TYPE_CHECKING:
    from dsv4_jax.config import DeepseekV4Config
    from dsv4_jax.engine.runner import StepBuckets
    from dsv4_jax.kv_cache.resolver import KVCacheSpec
    from dsv4_jax.parallel.sharding import ParallelConfig

logger = logging.getLogger(__name__)

BUILTIN_MODEL = "dsv4-tiny"
DTYPES = ("auto", "float32", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "orbax")
# max_model_len when none is given: the model's max_position_embeddings, at most this (the pools on
# CPU are sized from max_num_seqs x max_model_len; Flash's 1M positions would not fit).
DEFAULT_MAX_MODEL_LEN = 4096
# max_num_seqs when none is given, as vLLM's defaults: GPUs with at least this much memory (H100,
# H200, B200) take 1024 sequences, smaller GPUs 256; CPUs, whose steps are slow and whose pools are
# sized from max_num_seqs x max_model_len, take 8.
LARGE_GPU_BYTES = 70 * 2**30
DEFAULT_MAX_NUM_SEQS = {"large_gpu": 1024, "gpu": 256, "cpu": 8}
# Tokens per row of the short-prompt prefill bucket at least (default_buckets).
SHORT_PREFILL_MIN = 16
# A Hugging Face repository id: `owner/name`, as the Hub spells them.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """vLLM's engine arguments that DeepSeek-V4 here understands (`python -m serve --help` says
    what each does). None means "chosen for this model and device" (`create_engine_config`)."""

    model: str = BUILTIN_MODEL  # a checkpoint directory, a Hugging Face repository id, or the built-in
    tokenizer: str | None = None  # a directory with tokenizer.json (default: the model's own)
    dtype: str = "auto"  # compute dtype; auto: the checkpoint's own
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None  # None: the KV resolver chooses by device
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: 1024 / 256 on GPUs by memory (bounded by the pools), 8 on CPUs
    max_num_batched_tokens: int | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 256
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    load_format: str = "auto"
    seed: int = 0
    async_scheduling: bool = True
    generation_config: str = "auto"  # "auto", "vllm" or a directory holding generation_config.json
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # vLLM's --structured-outputs-config: JSON text, a dict or a StructuredOutputsConfig (None: defaults)
    structured_outputs_config: str | dict | StructuredOutputsConfig | None = None
    buckets: StepBuckets | None = None  # ours: the step shapes compiled (None: `default_buckets`)
    # Prefix caching (docs/prefix_caching.md): on unless False, as vLLM's; the chained block hash;
    # ours: the sliding-window and compressor snapshots a hit restores, per data-parallel rank
    # (None: PREFIX_SNAPSHOTS_PER_SEQ per sequence slot).
    enable_prefix_caching: bool | None = None
    prefix_caching_hash_algo: str = "sha256"
    num_prefix_snapshots: int | None = None
    # vLLM's --speculative-config: JSON text, a dict or a SpeculativeConfig (None: off); the
    # drafter is the checkpoint's MTP block (docs/speculative_decoding.md)
    speculative_config: str | dict | SpeculativeConfig | None = None
    # vLLM's arguments that change nothing here, accepted so its notebooks run as written.
    trust_remote_code: bool = False  # nothing from the model directory is ever run
    enforce_eager: bool = False  # there are no CUDA graphs: steps are compiled for fixed shapes
    tokenizer_mode: str = "auto"  # always the model's tokenizer.json with the V4 chat encoder
    disable_log_stats: bool = True  # logging goes through the `logging` module

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ValueError(f"model must be a checkpoint directory, a Hugging Face repository id or "
                             f"{BUILTIN_MODEL!r}, got {self.model!r}")
        object.__setattr__(self, "model", str(self.model))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("block_size", "tensor_parallel_size", "data_parallel_size"):
            _positive_int(name, getattr(self, name))
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_gpu_blocks_override"):
            _positive_int(name, getattr(self, name), allow_none=True)
        memory = self.gpu_memory_utilization
        if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not 0 < memory <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {memory!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        _boolean("enable_expert_parallel", self.enable_expert_parallel)
        _boolean("async_scheduling", self.async_scheduling)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if self.enable_prefix_caching is not None:
            _boolean("enable_prefix_caching", self.enable_prefix_caching)
        _positive_int("num_prefix_snapshots", self.num_prefix_snapshots, allow_none=True)
        if self.enable_prefix_caching is False and self.num_prefix_snapshots is not None:
            raise ValueError(f"num_prefix_snapshots={self.num_prefix_snapshots} (--num-prefix-snapshots) sizes the "
                             "prefix cache, which enable_prefix_caching=False (--no-enable-prefix-caching) turns "
                             "off: drop one of them")
        from dsv4_jax.engine.prefix_cache import block_hasher

        block_hasher(self.prefix_caching_hash_algo)  # an unknown or unavailable algorithm names the flag
        if self.nnodes > 1 and self.load_format == "orbax":
            raise ValueError("--load-format orbax is not supported across hosts yet (--nnodes > 1): "
                             "pass --load-format safetensors")
        self.distributed  # noqa: B018  (DistributedConfig checks the node flags)
        StructuredOutputsConfig.parse(self.structured_outputs_config)  # its errors name the flag
        SpeculativeConfig.parse(self.speculative_config)  # so do these

    @property
    def distributed(self) -> DistributedConfig:
        return DistributedConfig(self.nnodes, self.node_rank, self.master_addr, self.master_port,
                                 headless=self.node_rank > 0)

    def create_engine_config(self) -> EngineConfig:
        """Every check that needs no weights, and every default resolved, once (see the module).
        Joins the other nodes of a multi-node run first: the checks read the devices."""
        import jax

        from dsv4_jax.config import DeepseekV4Config
        from dsv4_jax.engine.compiles import compile_threads
        from dsv4_jax.engine.sampling_params import generation_defaults
        from dsv4_jax.kv_cache import resolve_for_device
        from dsv4_jax.kv_cache.planner import pool_usage
        from dsv4_jax.parallel.distributed import initialize

        initialize(self.distributed)  # several hosts: before anything touches a device
        compile_threads()  # $DSV4_JAX_COMPILE_THREADS, read at warm-up: refused here if it is not a count
        model_dir = resolve_model_dir(self.model)
        config = DeepseekV4Config.from_json(model_dir)  # a bad directory fails here, with the file named
        max_model_len = self.max_model_len or min(DEFAULT_MAX_MODEL_LEN, config.max_position_embeddings)
        if max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                             f"({config.max_position_embeddings})")
        parallel = self._check_parallel(config)
        device = jax.local_devices()[0]  # this process's (across nodes, node 0's pools are used)
        kv = resolve_for_device(self.kv_cache_dtype, device, self.attention_backend, config=config)
        pool_usage(config, kv, max_model_len, self.block_size)  # whole blocks of every compress ratio
        max_num_seqs = self.max_num_seqs or default_max_num_seqs(device)
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None:
            speculative.check_model(config, model_dir)  # no V4 MTP block: refused, never silently off
        if self.tokenizer is not None and not Path(self.tokenizer).exists():
            raise FileNotFoundError(f"tokenizer {self.tokenizer}: no such file or directory")
        load_format = self.load_format
        if self.nnodes > 1 and load_format == "auto":
            logger.info("--load-format auto with --nnodes %d: reading the safetensors (the converted-weights "
                        "cache is one host's)", self.nnodes)
            load_format = "safetensors"
        return EngineConfig(
            args=self, model_dir=model_dir, model_config=config,
            dtype=checkpoint_dtype(model_dir) if self.dtype == "auto" else self.dtype,
            kv=kv, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_seqs_is_default=self.max_num_seqs is None,
            buckets=self.buckets or default_buckets(max_num_seqs, max_model_len, self.max_num_batched_tokens),
            parallel=parallel, load_format=load_format,
            tokenizer=Path(self.tokenizer) if self.tokenizer is not None else model_dir,
            structured_outputs_config=StructuredOutputsConfig.parse(self.structured_outputs_config),
            speculative_config=speculative,
            # generation_config.json's sampling defaults (vLLM's keys); followers never sample.
            sampling_defaults=generation_defaults(model_dir, self.generation_config,
                                                  "generation_config (--generation-config)")
            if self.node_rank == 0 else {},
        )

    def _check_parallel(self, config: DeepseekV4Config) -> ParallelConfig:
        """The mesh's sizes against the visible devices and the model's dimensions (no weights read)."""
        import jax

        from dsv4_jax.parallel.sharding import ParallelConfig, check_model_splits, make_mesh

        parallel = ParallelConfig(self.tensor_parallel_size, self.data_parallel_size, self.enable_expert_parallel)
        make_mesh(parallel)  # too few devices: its ValueError names the flags
        if self.nnodes > 1 and parallel.world_size != jax.device_count():
            # Every node runs every step: each must own devices of the mesh.
            raise ValueError(
                f"--tensor-parallel-size {self.tensor_parallel_size} x --data-parallel-size "
                f"{self.data_parallel_size} = {parallel.world_size} devices, but the {self.nnodes} nodes (--nnodes) "
                f"have {jax.device_count()}: across nodes the mesh must use every device of every node"
            )
        check_model_splits(config, parallel)
        return parallel


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """`EngineArgs` with everything resolved for this model and these devices (no weights read)."""

    args: EngineArgs  # as given
    model_dir: Path
    model_config: DeepseekV4Config
    dtype: str  # the compute dtype: float32 or bfloat16
    kv: KVCacheSpec  # the KV layout and attention backend the resolver chose (and logged)
    max_model_len: int
    max_num_seqs: int
    max_num_seqs_is_default: bool  # chosen by device: the pools may hold fewer slots (builder)
    buckets: StepBuckets
    parallel: ParallelConfig
    load_format: str  # "auto", "safetensors" or "orbax"; across nodes never "auto"
    tokenizer: Path  # the directory (or file) the tokenizer is read from
    sampling_defaults: dict[str, Any]  # generation_config.json's, for requests that leave them unset
    structured_outputs_config: StructuredOutputsConfig = StructuredOutputsConfig()
    # Prefix-cache snapshots per data-parallel rank and the bytes of one (the builder sizes them).
    num_prefix_snapshots: int = 0
    snapshot_bytes: int = 0
    speculative_config: SpeculativeConfig | None = None

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config.num_speculative_tokens if self.speculative_config is not None else 0

    @property
    def prefix_caching(self) -> bool:
        return self.args.enable_prefix_caching is not False

    @property
    def distributed(self) -> DistributedConfig:
        return self.args.distributed

    def node_settings(self) -> dict[str, Any]:
        """What must be equal on every node of a multi-node run (the model's path may differ, its
        config not), by the flag that sets it: the step channel's handshake compares them."""
        a = self.args
        return {
            "model config": self.model_config, "--dtype": self.dtype, "--kv-cache-dtype": self.kv.kv_cache_dtype,
            "--attention-backend": self.kv.attention_backend, "--max-model-len": self.max_model_len,
            "--max-num-seqs": self.max_num_seqs, "--max-num-batched-tokens": a.max_num_batched_tokens,
            "--block-size": a.block_size, "--num-gpu-blocks-override": a.num_gpu_blocks_override,
            "--tensor-parallel-size": a.tensor_parallel_size, "--data-parallel-size": a.data_parallel_size,
            "--enable-expert-parallel": a.enable_expert_parallel, "--seed": a.seed, "buckets": self.buckets,
            "--enable-prefix-caching": self.prefix_caching, "--num-prefix-snapshots": a.num_prefix_snapshots,
            "--prefix-caching-hash-algo": a.prefix_caching_hash_algo,
            "--speculative-config": self.speculative_config,
        }


# ---- defaults ------------------------------------------------------------------------------------
def resolve_model_dir(model: str) -> Path:
    """The checkpoint directory `model` names: the built-in model (written on first use), a local
    directory, or a Hugging Face repository id (`owner/name`) resolved through the local Hugging
    Face cache as vLLM does (`huggingface_hub.snapshot_download`: only the cache when
    `HF_HUB_OFFLINE=1`, else it downloads what is missing)."""
    if model == BUILTIN_MODEL:
        from dsv4_jax.weights.builtin import builtin_model_dir

        return builtin_model_dir()
    path = Path(model).expanduser()
    if path.exists() or not _REPO_ID.fullmatch(model):
        return path  # a missing directory fails where config.json is read, with the path named
    return _hub_snapshot(model)


def _hub_snapshot(repo_id: str) -> Path:
    try:
        import huggingface_hub
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - a dependency of the package
        raise ValueError(f"model {repo_id!r} is neither a directory nor usable as a Hugging Face repository id: "
                         "huggingface_hub is not installed") from None
    # The checkpoint, its tokenizer and configs: no README images, no PyTorch-only extras.
    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py"]
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise ValueError(
            f"model {repo_id!r}: not a local directory, and not in the Hugging Face cache "
            f"({huggingface_hub.constants.HF_HUB_CACHE}) while offline (HF_HUB_OFFLINE=1 or no network); download "
            f"it first (`hf download {repo_id}`) or pass its directory"
        ) from None
    except Exception as error:  # noqa: BLE001 - the Hub's many errors (unknown repo, gated, network)
        raise ValueError(f"model {repo_id!r}: not a local directory, and the Hugging Face Hub could not provide "
                         f"it: {type(error).__name__}: {error}") from None


def checkpoint_dtype(path: Path) -> str:
    """The compute dtype `dtype="auto"` means: the checkpoint's own (`config.json`'s `torch_dtype`
    or `dtype`); bfloat16 when it names none (DeepSeek's checkpoints are bf16 + fp8)."""
    raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    stored = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    return "float32" if stored in ("float32", "fp32") else "bfloat16"


def default_max_num_seqs(device: Any) -> int:
    """vLLM's default for the device: 1024 sequences on GPUs with >= 70 GiB (H100, H200, B200),
    256 on smaller GPUs; 8 on CPUs. On a GPU the pools may then hold fewer (the builder says so).
    A GPU's size is its kind's (the devices table), else what JAX may use of it divided by the
    fraction JAX takes (`XLA_CLIENT_MEM_FRACTION`, formerly `XLA_PYTHON_CLIENT_MEM_FRACTION`, 0.75
    by default): JAX's own limit is below 70 GiB on an 80 GB H100."""
    if device.platform != "gpu":
        return DEFAULT_MAX_NUM_SEQS["cpu"]
    return DEFAULT_MAX_NUM_SEQS["large_gpu" if gpu_bytes(device) >= LARGE_GPU_BYTES else "gpu"]


def gpu_bytes(device: Any) -> int:
    """The whole memory of a GPU (see `default_max_num_seqs`)."""
    import os

    from dsv4_jax.kv_cache.planner import live_device_memory, nominal_device_memory

    nominal = nominal_device_memory(getattr(device, "device_kind", ""))
    if nominal:
        return nominal
    given = os.environ.get("XLA_CLIENT_MEM_FRACTION", os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    try:
        fraction = float(given)
    except ValueError:
        fraction = 0.75
    return int((live_device_memory(device) or 0) / min(max(fraction, 0.05), 1.0))


def default_buckets(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int | None) -> StepBuckets:
    """Prefill buckets of one chunk length: one row (a long prompt alone) and as many rows as fit
    the token budget; the same rows of an eighth of a chunk (short prompts together: eight
    20-token prompts would be 92% padding in eight 256-token rows); two decode buckets (a quarter
    of max_num_seqs, and max_num_seqs). A step runs in the smallest bucket that holds it, and never
    holds more than max_num_batched_tokens tokens, so no chunk is longer."""
    from dsv4_jax.engine.runner import StepBuckets

    chunk = min(256, 1 << max(1, (max_model_len - 1).bit_length()), max_num_batched_tokens or 256)
    budget = max_num_batched_tokens or min(max_num_seqs, 8) * chunk
    rows = max(1, min(max_num_seqs, budget // chunk))
    short = max(SHORT_PREFILL_MIN, chunk // 8)
    prefill = {(1, chunk), (rows, chunk)} | ({(rows, short)} if short < chunk else set())
    decode = tuple(sorted({max(1, max_num_seqs // 4), max_num_seqs}))
    return StepBuckets(prefill=tuple(sorted(prefill)), decode=decode)

