"""`LLM`: the notebook API, in vLLM's shapes.

    from dsv4_jax import LLM, SamplingParams
    llm = LLM(model="dsv4-tiny")                      # or a DeepSeek-V4 checkpoint directory
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.0))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))

Pools: on a GPU they are sized from `gpu_memory_utilization` of the device's memory (JAX's
`bytes_limit`) minus what the weights and the activations take (the capacity planner, as vLLM
does; `activations.py` measures the latter); on CPU, where JAX reports no memory, from
`max_num_seqs` x `max_model_len`. `num_gpu_blocks_override` sets the compressed block count.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from dsv4_jax.engine.compiles import compile_threads
from dsv4_jax.engine.outputs import RequestOutput
from dsv4_jax.engine.request import integer_token_ids
from dsv4_jax.engine.runner import StepBuckets
from dsv4_jax.engine.sampling_params import SamplingParams, default_max_tokens_within, generation_defaults

logger = logging.getLogger(__name__)

BUILTIN_NAMES = ("dsv4-tiny",)
DTYPES = ("auto", "float32", "bfloat16")
# max_model_len when none is given: the model's max_position_embeddings, at most this (the pools on
# CPU are sized from max_num_seqs x max_model_len; Flash's 1M positions would not fit).
DEFAULT_MAX_MODEL_LEN = 4096
# Tokens per row of the short-prompt prefill bucket at least (default_buckets).
SHORT_PREFILL_MIN = 16


def device_memory(device) -> int | None:
    """The memory the pools are sized from: JAX's usable memory of a GPU (`bytes_limit`); None on
    CPU, where the pools are sized from max_num_seqs x max_model_len instead."""
    from dsv4_jax.kv_cache.planner import live_device_memory

    return live_device_memory(device) if device.platform == "gpu" else None


def _positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def default_buckets(max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int | None) -> StepBuckets:
    """Prefill buckets of one chunk length: one row (a long prompt alone) and as many rows as fit
    the token budget; the same rows of an eighth of a chunk (short prompts together: eight
    20-token prompts would be 92% padding in eight 256-token rows); two decode buckets (a quarter
    of max_num_seqs, and max_num_seqs). A step runs in the smallest bucket that holds it, and never
    holds more than max_num_batched_tokens tokens, so no chunk is longer."""
    chunk = min(256, 1 << max(1, (max_model_len - 1).bit_length()), max_num_batched_tokens or 256)
    budget = max_num_batched_tokens or min(max_num_seqs, 8) * chunk
    rows = max(1, min(max_num_seqs, budget // chunk))
    short = max(SHORT_PREFILL_MIN, chunk // 8)
    prefill = {(1, chunk), (rows, chunk)} | ({(rows, short)} if short < chunk else set())
    decode = tuple(sorted({max(1, max_num_seqs // 4), max_num_seqs}))
    return StepBuckets(prefill=tuple(sorted(prefill)), decode=decode)


def checkpoint_dtype(path: Path) -> str:
    """The compute dtype `dtype="auto"` means: the checkpoint's own (`config.json`'s `torch_dtype`
    or `dtype`); bfloat16 when it names none (DeepSeek's checkpoints are bf16 + fp8)."""
    import json

    from dsv4_jax.config import DeepseekV4Config

    DeepseekV4Config.from_json(path)  # a bad directory fails here, with the file named
    raw = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    stored = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    return "float32" if stored in ("float32", "fp32") else "bfloat16"


class LLM:
    def __init__(
        self,
        model: str | Path = "dsv4-tiny",
        *,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        attention_backend: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int | None = None,
        num_gpu_blocks_override: int | None = None,
        gpu_memory_utilization: float = 0.9,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        load_format: str = "auto",
        seed: int = 0,
        tokenizer: str | Path | None = None,
        block_size: int = 256,
        buckets: StepBuckets | None = None,
        usable_blocks_cap: int | None = None,  # test-only: forces preemption without resizing the pools
        async_scheduling: bool = True,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        generation_config: str = "auto",
        # vLLM's arguments that change nothing here, accepted so its notebooks run as written.
        trust_remote_code: bool = False,  # nothing from the model directory is ever run
        enforce_eager: bool = False,  # there are no CUDA graphs: steps are compiled for fixed shapes
        tokenizer_mode: str = "auto",  # always the model's tokenizer.json with the V4 chat encoder
        disable_log_stats: bool = True,  # logging goes through the `logging` module
        enable_prefix_caching: bool | None = None,  # not built: only off (False or None) is accepted
    ):
        from dsv4_jax.engine.compilation_cache import enable_compilation_cache
        from dsv4_jax.parallel.distributed import DistributedConfig, StartUp, StepChannel, initialize

        # Before anything compiles (JAX reads the setting at the first compile): a restarted
        # notebook then loads the warm-up's executables.
        enable_compilation_cache()

        # Several hosts: jax.distributed starts before anything touches a device.
        self.distributed = DistributedConfig(nnodes, node_rank, master_addr, master_port, headless=node_rank > 0)
        initialize(self.distributed)
        # A failure until the warm-up ends is told to the other nodes, which would wait for this one.
        with StartUp(self.distributed) as start_up:
            if enable_prefix_caching:
                raise ValueError(f"enable_prefix_caching={enable_prefix_caching!r}: prefix caching is not built yet "
                                 "in dsv4-jax; leave it unset or pass False")
            if nnodes > 1 and load_format != "safetensors":
                if load_format == "orbax":
                    raise ValueError("--load-format orbax is not supported across hosts yet (--nnodes > 1): "
                                     "pass --load-format safetensors")
                logger.info("--load-format auto with --nnodes %d: reading the safetensors (the converted-weights "
                            "cache is one host's)", nnodes)
                load_format = "safetensors"
            import jax

            from dsv4_jax.engine.engine import LLMEngine
            from dsv4_jax.weights.loading import load_model
            from dsv4_jax.parallel.sharding import ParallelConfig, make_mesh, node_weight_bytes
            from dsv4_jax.chat.tokenizer import load_tokenizer

            path = self.check_arguments(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                        attention_backend=attention_backend, max_model_len=max_model_len,
                                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                        num_gpu_blocks_override=num_gpu_blocks_override,
                                        gpu_memory_utilization=gpu_memory_utilization,
                                        tensor_parallel_size=tensor_parallel_size,
                                        data_parallel_size=data_parallel_size,
                                        enable_expert_parallel=enable_expert_parallel, load_format=load_format,
                                        seed=seed, block_size=block_size, tokenizer=tokenizer)
            # generation_config.json's sampling defaults (vLLM's keys); followers never sample.
            self.sampling_defaults = generation_defaults(path, generation_config) if node_rank == 0 else {}
            max_model_len = self.resolve_max_model_len(path, max_model_len)
            compute = checkpoint_dtype(path) if dtype == "auto" else dtype
            self.parallel = ParallelConfig(tensor_parallel_size, data_parallel_size, enable_expert_parallel)
            buckets = buckets or default_buckets(max_num_seqs, max_model_len, max_num_batched_tokens)
            channel = None
            if nnodes > 1:  # before anything runs a collective: every node must run the same program
                from dsv4_jax.config import DeepseekV4Config

                settings = {  # what must be equal on every node (the model's path may differ, its config not)
                    "model config": DeepseekV4Config.from_json(path), "--dtype": compute,
                    "--kv-cache-dtype": kv_cache_dtype,
                    "--attention-backend": attention_backend, "--max-model-len": max_model_len,
                    "--max-num-seqs": max_num_seqs, "--max-num-batched-tokens": max_num_batched_tokens,
                    "--block-size": block_size, "--num-gpu-blocks-override": num_gpu_blocks_override,
                    "--tensor-parallel-size": tensor_parallel_size, "--data-parallel-size": data_parallel_size,
                    "--enable-expert-parallel": enable_expert_parallel, "--seed": seed, "buckets": buckets,
                    "usable_blocks_cap": usable_blocks_cap,
                }
                channel = (StepChannel.leader(self.distributed, settings) if self.distributed.is_leader
                           else StepChannel.follower(self.distributed, settings))
                start_up.watch(channel)
            mesh = make_mesh(self.parallel) if self.parallel.world_size > 1 else None
            self.model = load_model(path, dtype=compute, kv_cache_dtype=kv_cache_dtype,
                                             attention_backend=attention_backend, mesh=mesh,
                                             parallel=self.parallel if mesh is not None else None,
                                             load_format=load_format)
            if mesh is not None:
                logger.info("mesh: data %d x tensor %d over devices %s, routed experts %s", data_parallel_size,
                            tensor_parallel_size, [d.id for d in mesh.devices.flat],
                            "whole on each device (expert parallel)" if enable_expert_parallel
                            else "split along their intermediate dimension")
                held = node_weight_bytes(self.model.state)
                logger.info("weights on this node's %d devices: %.2f MiB of the model's %.2f MiB (routed experts: "
                            "%.2f of %.2f MiB)", jax.local_device_count(), held.local / 2**20, held.total / 2**20,
                            held.local_experts / 2**20, held.total_experts / 2**20)
            self.config = self.model.config
            self.spec = self.model.kv_cache_spec
            self.tokenizer = load_tokenizer(tokenizer or path)
            # Every node measures its activations (the measurement puts small arrays on the whole mesh:
            # a call every process must join), then takes the leader's pools (below).
            self.plan, self.layout = self._size_pools(max_model_len, max_num_seqs, block_size, gpu_memory_utilization,
                                                      num_gpu_blocks_override, buckets)
            if channel is not None:  # the leader's pools are every node's (device memory may differ)
                if self.distributed.is_leader:
                    channel.send(self.layout)
                else:
                    self.layout = channel.receive()
            self.engine = LLMEngine(
                self.model, self.tokenizer, self.layout, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                buckets=buckets,
                attention_backend=self.spec.attention_backend, max_num_batched_tokens=max_num_batched_tokens,
                seed=seed, usable_blocks_cap=usable_blocks_cap, async_scheduling=async_scheduling,
            )
            logger.info("KV cache per data-parallel rank (%d): %d sequence slots, %d compressed blocks of %d "
                        "positions; %.1f MiB on the mesh", data_parallel_size, self.layout.num_seq_slots,
                        self.layout.num_compressed_blocks, self.layout.block_size, self.cache_bytes / 2**20)
            start = time.perf_counter()
            compiled = self.engine.warmup()
            logger.info("warm-up: %d compiles in %.1fs", compiled, time.perf_counter() - start)
            self._ids = 0
            self._channel = None
            # Every process warmed up the same way; from here the leader's steps are every node's.
            if channel is not None:
                if self.distributed.is_leader:
                    self.engine.lead(channel)
                else:
                    self._channel = channel

    # ---- several hosts ----------------------------------------------------------------------------
    def follow(self) -> int:
        """On a follower node (`node_rank` >= 1): run the leader's steps until it shuts down;
        returns the number of device calls made."""
        if self._channel is None:
            raise ValueError("follow() is for the followers of a multi-node run (node_rank >= 1)")
        return self.engine.follow(self._channel)

    def shutdown(self) -> None:
        """On the leader of a multi-node run: release the followers (their `follow` returns)."""
        self.engine.stop_followers()

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def check_arguments(cls, model: str | Path = "dsv4-tiny", *, dtype: str = "auto", kv_cache_dtype: str = "auto",
                        attention_backend: str | None = None,
                        max_model_len: int | None = None, max_num_seqs: int = 8, max_num_batched_tokens: int | None = None,
                        num_gpu_blocks_override: int | None = None, gpu_memory_utilization: float = 0.9,
                        tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                        enable_expert_parallel: bool = False, load_format: str = "auto", seed: int = 0,
                        block_size: int = 256, tokenizer: str | Path | None = None,
                        async_scheduling: bool = True, nnodes: int = 1, node_rank: int = 0,
                        master_addr: str = "127.0.0.1", master_port: int = 29500,
                        generation_config: str = "auto") -> Path:
        """Every check that needs no weights (seconds on a real checkpoint), as a ValueError naming
        the argument; returns the model directory (the built-in one is written on first use).
        `generation_config` is read (and checked) by the constructor, or by the server naming its flag."""
        from dsv4_jax.weights.builtin import builtin_model_dir
        from dsv4_jax.parallel.sharding import ParallelConfig
        from dsv4_jax.parallel.distributed import DistributedConfig
        from dsv4_jax.weights.converted_cache import check_load_format

        cls._check_arguments(dtype, max_model_len, max_num_seqs, max_num_batched_tokens, num_gpu_blocks_override,
                             gpu_memory_utilization, seed, block_size)
        compile_threads()  # $DSV4_JAX_COMPILE_THREADS, read at warm-up: refused here if it is not a count
        if not isinstance(enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be a bool, got {enable_expert_parallel!r}")
        ParallelConfig(tensor_parallel_size, data_parallel_size, enable_expert_parallel)  # sizes >= 1
        check_load_format(load_format)
        DistributedConfig(nnodes, node_rank, master_addr, master_port, headless=node_rank > 0)
        path = builtin_model_dir() if str(model) in BUILTIN_NAMES else Path(model)
        cls._check_against_model(path, cls.resolve_max_model_len(path, max_model_len), block_size,
                                 kv_cache_dtype, attention_backend)
        cls._check_parallel(path, tensor_parallel_size, data_parallel_size, enable_expert_parallel, nnodes)
        if not isinstance(async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool, got {async_scheduling!r}")
        if tokenizer is not None and not Path(tokenizer).exists():
            raise FileNotFoundError(f"tokenizer {tokenizer}: no such file or directory")
        return path

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's
        generation_config.json defaults (vLLM's), else SamplingParams(). Its max_tokens is capped
        per prompt to what max_model_len leaves (a default, not the caller's demand)."""
        return SamplingParams(**self.sampling_defaults)

    def get_tokenizer(self):
        """The tokenizer with the methods notebooks call on vLLM's (`encode`, `decode`,
        `apply_chat_template` with the V4 encoder, `eos_token_id`); `llm.tokenizer` is the raw one."""
        from dsv4_jax.chat.tokenizer import NotebookTokenizer

        return NotebookTokenizer(self.tokenizer)

    @staticmethod
    def resolve_max_model_len(path: Path, max_model_len: int | None) -> int:
        """`max_model_len` as given, or else the model's max_position_embeddings capped at
        DEFAULT_MAX_MODEL_LEN (the built-in dsv4-tiny has 1024 positions)."""
        if max_model_len is not None:
            return max_model_len
        from dsv4_jax.config import DeepseekV4Config

        positions = DeepseekV4Config.from_json(path).max_position_embeddings
        return min(DEFAULT_MAX_MODEL_LEN, positions)

    @staticmethod
    def _check_arguments(dtype, max_model_len, max_num_seqs, max_num_batched_tokens, num_gpu_blocks_override,
                         gpu_memory_utilization, seed, block_size) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        _positive_int("max_model_len", max_model_len, allow_none=True)
        _positive_int("block_size", block_size)
        _positive_int("max_num_seqs", max_num_seqs)
        _positive_int("max_num_batched_tokens", max_num_batched_tokens, allow_none=True)
        _positive_int("num_gpu_blocks_override", num_gpu_blocks_override, allow_none=True)
        if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
                or not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an integer, got {seed!r}")

    @staticmethod
    def _check_against_model(path: Path, max_model_len: int, block_size: int, kv_cache_dtype: str,
                             attention_backend: str | None) -> None:
        """The checks that need the model's config.json but not its weights (seconds to load on a
        real checkpoint): max_model_len, the KV cache dtype on this device, the block size."""
        import jax

        from dsv4_jax.config import DeepseekV4Config
        from dsv4_jax.kv_cache import resolve_for_device
        from dsv4_jax.kv_cache.planner import pool_usage

        config = DeepseekV4Config.from_json(path)  # a bad directory fails here, with the file named
        if max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                             f"({config.max_position_embeddings})")
        # Only checked here: load_model resolves it again and logs the start-up line once.
        spec = resolve_for_device(kv_cache_dtype, jax.devices()[0], attention_backend, config=config, log=False)
        pool_usage(config, spec, max_model_len, block_size)  # block_size: whole blocks of every compress ratio

    @staticmethod
    def _check_parallel(path: Path, tensor_parallel_size: int, data_parallel_size: int,
                        enable_expert_parallel: bool, nnodes: int = 1) -> None:
        """The mesh's sizes against the visible devices and the model's dimensions (no weights read)."""
        import jax

        from dsv4_jax.config import DeepseekV4Config
        from dsv4_jax.parallel.sharding import ParallelConfig, check_model_splits, make_mesh

        parallel = ParallelConfig(tensor_parallel_size, data_parallel_size, enable_expert_parallel)
        make_mesh(parallel)  # too few devices: its ValueError names the flags
        if nnodes > 1 and parallel.world_size != jax.device_count():
            # Every node runs every step: each must own devices of the mesh.
            raise ValueError(
                f"--tensor-parallel-size {tensor_parallel_size} x --data-parallel-size {data_parallel_size} = "
                f"{parallel.world_size} devices, but the {nnodes} nodes (--nnodes) have {jax.device_count()}: "
                "across nodes the mesh must use every device of every node"
            )
        check_model_splits(DeepseekV4Config.from_json(path), parallel)

    def _size_pools(self, max_model_len, max_num_seqs, block_size, gpu_memory_utilization, num_gpu_blocks_override,
                    buckets):
        import jax

        from dsv4_jax.engine.activations import measure_activations
        from dsv4_jax.kv_cache.planner import MeshShape, plan_capacity

        device = jax.local_devices()[0]  # this process's (across nodes, node 0's plan is used)
        memory = device_memory(device)
        # What the first device holds (every device holds the same share).
        weight_bytes = sum(s.data.nbytes for x in jax.tree.leaves(self.model.state)
                           for s in x.addressable_shards if s.device == device)
        p = self.parallel

        def plan(reserved_bytes: int):
            plan = plan_capacity(
                self.config, self.spec, max_model_len=max_model_len, device_memory_bytes=memory,
                gpu_memory_utilization=gpu_memory_utilization, weight_bytes=weight_bytes, block_size=block_size,
                max_num_seqs=max_num_seqs, reserved_bytes=reserved_bytes,
                mesh=MeshShape(p.tensor_parallel_size, p.data_parallel_size, p.expert_parallel_size),
            )
            return plan, self._layout(plan, max_model_len, block_size, num_gpu_blocks_override)

        plan0, layout = plan(0)
        if memory is None:
            return plan0, layout
        # The activations of the largest pools the memory could hold (shapes only), then the pools.
        start = time.perf_counter()
        activations = measure_activations(self.model, layout, buckets=buckets,
                                          attention_backend=self.spec.attention_backend, max_model_len=max_model_len)
        logger.info("activations: %s, measured in %.1fs; the KV cache gets what remains of "
                    "--gpu-memory-utilization %s of %.2f GiB after them and %.2f GiB of weights",
                    activations.describe(), time.perf_counter() - start, gpu_memory_utilization,
                    memory / 2**30, weight_bytes / 2**30)
        return plan(activations.reserved_bytes)

    def _layout(self, plan, max_model_len, block_size, num_gpu_blocks_override):
        from dsv4_jax.kv_cache.paged import PagedCacheLayout

        layout = PagedCacheLayout.from_plan(self.config, plan)
        if num_gpu_blocks_override is not None:
            need = math.ceil(max_model_len / block_size)
            if num_gpu_blocks_override < need:
                raise ValueError(f"num_gpu_blocks_override ({num_gpu_blocks_override}) holds less than one sequence "
                                 f"of max_model_len {max_model_len} ({need} blocks of {block_size})")
            layout = dataclasses.replace(layout, num_compressed_blocks=num_gpu_blocks_override)
        return layout

    @property
    def cache_bytes(self) -> int:
        from dsv4_jax.kv_cache.paged import cache_nbytes

        return cache_nbytes(self.engine.runner.cache)

    # ---- generation -------------------------------------------------------------------------------
    def _prompts(self, prompts) -> list[tuple[str | None, list[int]]]:
        from dsv4_jax.chat.tokenizer import encode_prompt

        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                out.append((p, encode_prompt(self.tokenizer, p)))  # exactly one BOS
                continue
            text = p.get("prompt") if isinstance(p, dict) else None
            if not isinstance(p, dict) or not isinstance(text, (str, type(None))) \
                    or text is None and "prompt_token_ids" not in p:
                raise ValueError(f"prompts[{i}] must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                                 f"got {repr(p)[:80]}")
            if "prompt_token_ids" in p:  # vLLM's TokensPrompt (its text optional)
                out.append((text, integer_token_ids(p["prompt_token_ids"])))
            else:  # vLLM's TextPrompt
                out.append((text, encode_prompt(self.tokenizer, text)))
        return out

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt (with `n` completions each), in the prompts' order."""
        if self._channel is not None:
            raise ValueError(f"node {self.distributed.node_rank} is a follower: it runs the leader's steps "
                             "(follow()); generate on node 0")
        items = self._prompts(prompts)
        if sampling_params is None:
            default, limit = self.get_default_sampling_params(), self.engine.max_model_len
            sampling_params = [default_max_tokens_within(default, limit - len(ids)) for _, ids in items]
        params_list = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(items)
        if len(params_list) != len(items):
            raise ValueError(f"sampling_params has {len(params_list)} entries for {len(items)} prompts")
        groups = []
        try:
            for (text, ids), params in zip(items, params_list):
                if not isinstance(params, SamplingParams):
                    raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
                base = f"{self._ids}"
                self._ids += 1
                children = []
                for i in range(params.n):
                    child = params.for_child(i)
                    rid = f"{base}-{i}"
                    self.engine.add_request(rid, ids, child, prompt=text)
                    children.append(rid)
                groups.append((base, text, ids, children))
            finished = self._run(sum(len(children) for *_, children in groups), use_tqdm)
        except BaseException:
            # Whatever stopped it (Ctrl-C in a notebook, a bad argument, a failed step): the next
            # call must find the engine as new, with nothing of this one scheduled or in flight.
            self.engine.reset()
            raise
        results = []
        for base, text, ids, children in groups:
            outs = [finished[rid] for rid in children]
            completions = []
            for i, o in enumerate(outs):
                o.outputs[0].index = i
                completions.append(o.outputs[0])
            # The phases of the first choice: its children arrive together, as vLLM's parent request.
            results.append(RequestOutput(base, text, ids, outs[0].prompt_logprobs, completions, True, outs[0].metrics))
        return results

    def _run(self, total: int, use_tqdm) -> dict[str, RequestOutput]:
        """Step until the `total` requests added finished (a prompt's `n` completions are `n`
        requests, counted each, as vLLM's bar counts them); the bar closes whatever happens."""
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            make_bar = use_tqdm if callable(use_tqdm) else tqdm  # vLLM also takes a tqdm class
            bar = make_bar(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    generated += 1
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s")
        finally:
            if bar is not None:
                bar.close()
        return finished

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
    ) -> list[RequestOutput]:
        """Chat completions: the V4 encoder builds the prompt (the chat mapping decides thinking
        defaults). As in vLLM, a completion's `text` is all it generated (in thinking mode the
        reasoning, `</think>`, then the answer), cut by stop strings and without special tokens as
        `generate` gives it; each also carries the parse of that text, as the server makes it:
        `reasoning` (thinking mode, else None), `content` and `tool_calls` (None if none)."""
        from dsv4_jax.chat import build_prompt, chat_message, chat_parser, resolve_chat_options

        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [build_prompt(c, tools=tools, chat_template_kwargs=chat_template_kwargs,
                                reasoning_effort=reasoning_effort) for c in conversations]
        thinking = resolve_chat_options(chat_template_kwargs, reasoning_effort).thinking_mode == "thinking"
        outputs = self.generate([{"prompt_token_ids": self._prompts([p])[0][1]} for p in prompts],
                                sampling_params, use_tqdm)
        for prompt, out in zip(prompts, outputs):
            out.prompt = prompt
            for completion in out.outputs:
                # As a server with --enable-auto-tool-choice --reasoning-parser deepseek_v4 parses
                # it: tool calls only when the request offered tools (lenient: never raises).
                message = chat_message(completion.text, chat_parser(tools_active=bool(tools), split_reasoning=thinking))
                completion.content = message["content"]
                # None for "there is none", as OpenAI omits them: no reasoning outside thinking
                # mode, no tool calls unless the model wrote some.
                completion.reasoning = message["reasoning_content"] if thinking else None
                completion.tool_calls = message["tool_calls"] or None
        return outputs
