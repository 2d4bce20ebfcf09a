"""`LLM`: the notebook API, in vLLM's shapes.

    from dsv4_jax import LLM, SamplingParams
    llm = LLM(model="dsv4-tiny")                      # or a checkpoint directory / Hugging Face repo id
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.0))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))

Its keyword arguments are `EngineArgs`' (engine/args.py, vLLM's names); the engine is built as the
server builds its own (`engine/builder.py`). Pools: on a GPU they are sized from
`gpu_memory_utilization` of the device's memory (JAX's `bytes_limit`) minus what the weights and
the activations take (the capacity planner, as vLLM does); on CPU, where JAX reports no memory,
from `max_num_seqs` x `max_model_len`. `num_gpu_blocks_override` sets the compressed block count.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from dsv4_jax.engine.args import BUILTIN_MODEL, EngineArgs
from dsv4_jax.engine.outputs import RequestOutput
from dsv4_jax.engine.request import integer_token_ids
from dsv4_jax.engine.sampling_params import SamplingParams, default_max_tokens_within
from dsv4_jax.parallel.distributed import DistributedConfig


class LLM:
    """vLLM's offline `LLM` over a DeepSeek-V4 engine. `LLM(model, **engine_args)` takes the
    fields of `EngineArgs` as keywords (dtype, kv_cache_dtype, max_model_len, max_num_seqs,
    tensor_parallel_size, ...); a bad value is a ValueError naming it, before any weights load."""

    def __init__(self, model: str | Path = BUILTIN_MODEL, **engine_args: Any):
        def checked() -> EngineArgs:
            fields = {f.name for f in dataclasses.fields(EngineArgs)}
            unknown = sorted(set(engine_args) - fields)
            if unknown:
                raise ValueError(f"LLM() got unknown argument(s) {', '.join(unknown)}; the engine's arguments are "
                                 f"{', '.join(sorted(fields - {'model'}))}")
            return EngineArgs(model=model, **engine_args)

        defaults = EngineArgs()
        nodes = {name: engine_args.get(name, getattr(defaults, name))
                 for name in ("nnodes", "node_rank", "master_addr", "master_port")}
        self._start(DistributedConfig(**nodes, headless=nodes["node_rank"] > 0), checked)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *,
                         block_manager_factory: Callable[..., Any] | None = None) -> LLM:
        """An `LLM` from `EngineArgs`; `block_manager_factory` makes each data-parallel rank's
        block allocator (`engine.block_manager.BlockManager`'s constructor by default)."""
        llm = cls.__new__(cls)
        llm._start(engine_args.distributed, lambda: engine_args, block_manager_factory)
        return llm

    def _start(self, nodes: DistributedConfig, engine_args: Callable[[], EngineArgs],
               block_manager_factory: Callable[..., Any] | None = None) -> None:
        """Join the other nodes (several hosts), then check `engine_args()` and build: a node whose
        arguments are refused tells the others why, instead of leaving them waiting for it."""
        from dsv4_jax.engine.builder import build_engine
        from dsv4_jax.engine.compilation_cache import enable_compilation_cache
        from dsv4_jax.parallel.distributed import StartUp, initialize

        # Before anything compiles (JAX reads the setting at the first compile): a restarted
        # notebook then loads the warm-up's executables.
        enable_compilation_cache()
        initialize(nodes)  # before anything touches a device
        with StartUp(nodes):  # a failure is told to the other nodes, which would wait for this one
            config = engine_args().create_engine_config()
        built = build_engine(config, block_manager_factory=block_manager_factory)
        self.engine_config = built.config  # as resolved (max_num_seqs as the pools bound it)
        self.engine, self.plan, self.model = built.engine, built.plan, built.model
        self._built = built
        self._ids = 0

    # ---- what it runs ------------------------------------------------------------------------------
    @property
    def config(self):
        """The model's `DeepseekV4Config`."""
        return self.engine_config.model_config

    @property
    def spec(self):
        """The KV layout and attention backend the resolver chose (`KVCacheSpec`)."""
        return self.engine_config.kv

    @property
    def layout(self):
        """One data-parallel rank's pools (`PagedCacheLayout`)."""
        return self.engine.runner.layout

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return self.engine_config.sampling_defaults

    @property
    def distributed(self):
        return self.engine_config.distributed

    @property
    def parallel(self):
        """The mesh's sizes (`ParallelConfig`: tensor, data, expert parallel)."""
        return self.engine_config.parallel

    @property
    def cache_bytes(self) -> int:
        return self.engine.cache_bytes

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

    # ---- several hosts ----------------------------------------------------------------------------
    def follow(self) -> int:
        """On a follower node (`node_rank` >= 1): run the leader's steps until it shuts down;
        returns the number of device calls made."""
        return self._built.follow()

    def shutdown(self) -> None:
        """On the leader of a multi-node run: release the followers (their `follow` returns)."""
        self.engine.stop_followers()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's `LLM.reset_prefix_cache`), e.g. to time a cold prompt:
        True once done. Between `generate` calls nothing runs, so it is always done then."""
        return self.engine.reset_prefix_cache()

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
        if self._built.channel is not None:
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
            # The engine's prompt ids: truncate_prompt_tokens may have cut them.
            # Its cached prompt tokens are the first choice's too: the prompt is counted once.
            results.append(RequestOutput(base, text, outs[0].prompt_token_ids, outs[0].prompt_logprobs, completions, True, outs[0].metrics,
                                         next((o.error for o in outs if o.error), None),
                                         num_cached_tokens=outs[0].num_cached_tokens))
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
