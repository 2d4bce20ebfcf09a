"""Any shape the config accepts runs on the xla backend; the Pallas kernels' limits are known ahead.

Issue 41: a transformers-valid config with head_dim 40 loaded and its full forward was right, but
`LLM(...)` died in its warm-up: the xla backend (the pure-JAX references) refused a KV row that is
not a multiple of 16 wide, a tiling limit of the Pallas kernels only. Here:

* three small configs whose shapes no kernel tiles the same way (head_dim 40, 24, 72; RoPE dims
  12, 16, 8; indexer 3 x 24, 5 x 16, 4 x 40; 4, 6, 3 heads in 2, 3, 1 output groups; hc_mult 4,
  2, 3; windows 4, 5, 7; CSA ratios 4, 2, 8 and HCA ratios 16, 8, 12; 8, 5, 6 experts with 1, 2, 0
  hash layers) run on a `ModelRunner` with a float32 cache, one prefill and one decode bucket
  each: two sequences (19 and 26 tokens) are prefilled in 16-token chunks and decoded greedily
  for 14 tokens, past their sliding windows, across CSA and HCA window boundaries and with more
  CSA entries than the indexer keeps; the full forward fed the runner's tokens agrees (the
  comparison rule below; with nothing rounded, the logits too, to 1e-5 x max|logits|);
* `LLM` at head_dim 40 with `kv_cache_dtype="auto"` (bfloat16 rows on the xla backend here):
  greedy generation follows, under the rule, the same cache dtype and backend fed each prompt and
  its generated tokens as one chunk (`dsv4_jax.testing.prefill_logits`);
* `pallas_kernels.limits` (what the resolver asks before anything loads) says exactly what the
  kernel wrappers refuse when traced for the CPU's interpreter, and what lowering to Triton
  refuses for an H100 and an RTX PRO 6000 (lowering compiles nothing for XLA).

Comparison rule (the project's): one run's tokens are fed to the other, and the tokens must be
equal wherever the other run's top-1/top-2 logit gap exceeds 1e-3.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import dsv4_jax
from dsv4_jax import LLM
from dsv4_jax.engine.runner import ModelRunner, StepBuckets, StepRow
from dsv4_jax.kv_cache import PagedCacheLayout, resolve_kv_cache
from dsv4_jax.presets import get_config
from dsv4_jax.testing import prefill_logits, write_random_checkpoint
from pallas_kernels import check, limits

GAP = 1e-3  # top-1/top-2 logit gap below which two runs may pick different tokens
EXACT = 1e-5  # float32 cache: max |cached - full| / max |full|
CHUNK = 16  # the one prefill bucket's tokens per row
BUCKETS = StepBuckets(prefill=((2, CHUNK),), decode=(2,))
PROMPTS = (19, 26)  # two rows: 16 + 3 and 16 + 10 tokens of prefill
NEW_TOKENS = 14  # greedy decode steps: positions up to 39

_BASE = get_config("dsv4-tiny-test").replace(num_nextn_predict_layers=0)
CONFIGS = {
    # head_dim 40 = 28 NoPE + 12 RoPE: neither kernel format's dim chunks fit (pallas_bf16 needs a
    # multiple of 16, pallas_fp8_ds_mla whole 64-dim NoPE blocks and 16-dim RoPE chunks).
    "head_dim_40": _BASE.replace(
        head_dim=40, qk_rope_head_dim=12, num_attention_heads=4, o_groups=2, hc_mult=4, sliding_window=4,
        num_hidden_layers=3, compress_ratios=(0, 4, 16), index_n_heads=3, index_head_dim=24, index_topk=3,
        n_routed_experts=8, num_experts_per_tok=2, num_hash_layers=1,
    ),
    # CSA ratio 2 (transformers' compress_rates) with HCA 8; a 16-dim indexer, 5 indexer heads.
    "head_dim_24": _BASE.replace(
        head_dim=24, qk_rope_head_dim=16, num_attention_heads=6, o_groups=3, hc_mult=2, sliding_window=5,
        num_hidden_layers=3, compress_ratios=(8, 2, 0), csa_compress_ratio=2, index_n_heads=5, index_head_dim=16,
        index_topk=4, n_routed_experts=5, num_experts_per_tok=3, num_hash_layers=2, n_shared_experts=0,
    ),
    # 64 NoPE + 8 RoPE dims; CSA ratio 8 and HCA 12 (blocks of 384 positions hold whole entries).
    "head_dim_72": _BASE.replace(
        head_dim=72, qk_rope_head_dim=8, num_attention_heads=3, o_groups=1, hc_mult=3, sliding_window=7,
        num_hidden_layers=3, compress_ratios=(8, 12, 0), csa_compress_ratio=8, index_n_heads=4,
        index_head_dim=40, index_topk=2, n_routed_experts=6, num_experts_per_tok=1, num_hash_layers=0,
    ),
}
BLOCK_SIZE = {"head_dim_40": 128, "head_dim_24": 128, "head_dim_72": 384}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("any_config")
    return {name: write_random_checkpoint(root / name, config, seed=7) for name, config in CONFIGS.items()}


def _prompts(config, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, config.vocab_size, size=n).tolist() for n in PROMPTS]


def _greedy_on_runner(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[list[int]], np.ndarray]:
    """Prefill both prompts in chunks of CHUNK tokens (one row each per step), then decode
    NEW_TOKENS greedily. Returns each row's generated tokens and the logits each came from
    [rows, NEW_TOKENS, vocab]."""
    blocks = [[i] for i in range(len(prompts))]  # one compressed block per sequence holds all its entries
    pos = [0] * len(prompts)
    last = [None] * len(prompts)
    while any(p < len(ids) for p, ids in zip(pos, prompts)):
        live = [i for i, ids in enumerate(prompts) if pos[i] < len(ids)]
        rows = [StepRow(i, pos[i], prompts[i][pos[i] : pos[i] + CHUNK], blocks[i]) for i in live]
        logits = np.asarray(runner.step(rows).logits)
        for k, i in enumerate(live):
            pos[i] += len(rows[k].token_ids)
            last[i] = logits[k]
    generated, seen = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(NEW_TOKENS):
        for i, row_logits in enumerate(last):
            generated[i].append(int(np.argmax(row_logits)))
            seen[i].append(row_logits)
        rows = [StepRow(i, pos[i], [generated[i][-1]], blocks[i]) for i in range(len(prompts))]
        logits = np.asarray(runner.step(rows).logits)
        for i in range(len(prompts)):
            pos[i] += 1
            last[i] = logits[i]
    return generated, np.stack([np.stack(s) for s in seen])


def _full_logits(model, prompts: list[list[int]], generated: list[list[int]]) -> np.ndarray:
    """The full forward fed each row's prompt and generated tokens: the logits each generated
    token was picked from [rows, len(generated[i]), vocab] (one forward call, rows padded at the
    end: the forward is causal)."""
    seqs = [p + g[:-1] for p, g in zip(prompts, generated)]
    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    logits = np.asarray(model(ids))
    return np.stack([logits[i, len(p) - 1 : len(p) - 1 + len(g)] for i, (p, g) in enumerate(zip(prompts, generated))])


def assert_tokens_follow(tokens: list[list[int]], reference_logits: np.ndarray) -> int:
    """The comparison rule: each token equals the reference's argmax wherever the reference's
    top-1/top-2 logit gap exceeds GAP. Returns how many tokens were compared."""
    compared = 0
    for row, row_logits in zip(tokens, reference_logits):
        for i, (token, logits) in enumerate(zip(row, row_logits)):
            top = np.sort(logits)[::-1]
            if top[0] - top[1] > GAP:
                assert token == int(np.argmax(logits)), (i, row)
                compared += 1
    return compared


@pytest.mark.parametrize("name", list(CONFIGS))
def test_float32_runner_follows_the_full_forward(name, checkpoints, capsys):
    config = CONFIGS[name]
    model = dsv4_jax.load_model(checkpoints[name])
    spec = resolve_kv_cache("float32", "cpu", None, config=config)
    layout = PagedCacheLayout.build(config, spec, max_model_len=BLOCK_SIZE[name], num_seq_slots=2,
                                    block_size=BLOCK_SIZE[name])
    runner = ModelRunner(model, layout, buckets=BUCKETS)
    prompts = _prompts(config, seed=1)
    generated, got = _greedy_on_runner(runner, prompts)
    assert runner.compiles.built <= 2  # one prefill and one decode bucket
    want = _full_logits(model, prompts, generated)
    compared = assert_tokens_follow(generated, want)
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    with capsys.disabled():
        print(f"\n{name}: {compared}/{got.shape[0] * got.shape[1]} greedy tokens compared, max |cached - full| "
              f"{np.max(np.abs(got - want)):.2e} = {error:.2e} x max|logits|")
    assert compared >= got.shape[0] * got.shape[1] - 2  # the rule skipped at most a near tie or two
    assert all(len(set(row)) >= 3 for row in generated), generated  # not one token repeated
    assert error <= EXACT


def test_llm_runs_head_dim_40_with_an_auto_kv_cache(checkpoints, capsys):
    """`LLM` end to end at head_dim 40 (issue 41: it failed in its warm-up with every
    kv_cache_dtype). On a CPU `auto` is bfloat16 rows on the xla backend: greedy tokens follow the
    same cache dtype and backend fed each prompt and its tokens as one chunk."""
    config = CONFIGS["head_dim_40"]
    llm = LLM(str(checkpoints["head_dim_40"]), dtype="float32", kv_cache_dtype="auto", max_model_len=128,
              max_num_seqs=2, block_size=128, buckets=BUCKETS, num_gpu_blocks_override=4, seed=0,
              enable_prefix_caching=False)  # at 128 positions nothing could hit
    assert (llm.spec.kv_cache_dtype, llm.spec.attention_backend) == ("bfloat16", "xla")
    prompts = _prompts(config, seed=41)
    params = dsv4_jax.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    generated = [out.outputs[0].token_ids for out in outs]
    assert [len(g) for g in generated] == [8, 8]
    # The reference: each prompt and its tokens as ONE chunk over a fresh cache of the same dtype on
    # the same backend (what the cache rounds is the same; the dense forward rounds nothing).
    fed = [p + g[:-1] for p, g in zip(prompts, generated)]
    every = prefill_logits(llm.model, fed, kv_cache_dtype=llm.spec.kv_cache_dtype)
    reference = np.stack([logits[len(p) - 1 :] for p, logits in zip(prompts, every)])
    compared = assert_tokens_follow(generated, reference)
    with capsys.disabled():
        print(f"\nLLM head_dim 40, auto (bfloat16 on xla): {compared}/16 greedy tokens compared")
    assert compared >= 14  # the rule skipped at most a near tie or two


# ---- the kernels' limits, against the kernels ---------------------------------------------------
# Small pools and batches: lowering time grows with nothing here but the number of variants.
_SMALL = {"window": 8, "block_size": 128, "max_model_len": 1024, "num_seq_slots": 2, "decode_batch": 2,
          "prefill_batch": 1, "prefill_tokens": 32, "write_tokens": 64, "csa_layers": 1, "hca_layers": 1,
          "sliding_layers": 1, "topk": 8}
SHAPES = {  # check.Shapes fields: heads, head_dim, rope_dim, index_heads, index_head_dim
    "fits": (6, 96, 32, 4, 16),  # 6 heads padded to a head block; a 16-dim indexer
    "head_dim_40": (4, 40, 12, 8, 64),  # no format's dim chunks
    "head_dim_48": (4, 48, 16, 8, 64),  # bf16 fits, fp8_ds_mla's 32 NoPE dims do not
    "head_dim_72": (4, 72, 8, 8, 64),  # 64 NoPE dims but 8 RoPE dims; 72 is no multiple of 16
    "heads_24": (24, 96, 32, 8, 64),  # more heads than a 16-head block, not a multiple
    "heads_48": (48, 96, 32, 8, 64),  # a multiple of 16, not of H100's 32-head decode block
    "indexer_12x48": (4, 96, 32, 12, 48),  # indexer heads and dims not powers of two
}


def _shapes(name: str) -> tuple[check.Shapes, limits.ModelShapes]:
    heads, head_dim, rope, index_heads, index_dim = SHAPES[name]
    lowered = check.Shapes(heads=heads, head_dim=head_dim, rope_dim=rope, index_heads=index_heads,
                           index_head_dim=index_dim, **_SMALL)
    return lowered, limits.ModelShapes(heads, head_dim, rope, index_heads, index_dim)


def _refused(kernel_format: str, device_kind: str, shapes: check.Shapes) -> str | None:
    """The first variant of `kernel_format`'s backend that fails, with its error, or None: traced
    for the interpreter on "cpu" (the wrappers' own checks), lowered to Triton IR for a GPU kind."""
    kind = None if device_kind == "cpu" else check.resolve_device_kind(device_kind)
    for kernel in check.CHECK_KERNELS:
        for variant, fn, args in check.cases(kernel, device_kind, shapes):
            fmt = variant.split("/")[0]
            if {"fp8_ds_mla": "fp8_ds_mla", "bf16": "bf16", "fp8": "fp8_ds_mla"}[fmt] != kernel_format:
                continue  # fp8 indexer keys go with the fp8 KV cache (and fp8 GPUs)
            try:
                if kind is None:
                    jax.eval_shape(fn, *args)
                else:
                    check.lower(fn, args, check.JAX_KIND_BY_CAPABILITY[kind.compute_capability])
            except Exception as exc:  # noqa: BLE001 - any refusal counts
                return f"{kernel}:{variant}: {type(exc).__name__}: {str(exc)[:120]}"
    return None


@pytest.mark.parametrize("device_kind", ["cpu", "NVIDIA H100", "NVIDIA RTX PRO 6000"])
@pytest.mark.parametrize("kernel_format", limits.KV_FORMATS)
def test_limits_say_exactly_what_the_kernels_refuse(device_kind, kernel_format):
    for name in SHAPES:
        lowered, model_shapes = _shapes(name)
        problems = limits.shape_problems(model_shapes, kernel_format, device_kind)
        failed = _refused(kernel_format, device_kind, lowered)
        assert bool(problems) == (failed is not None), (name, problems, failed)


def test_limits_name_the_config_field_and_the_constraint():
    shapes = limits.ModelShapes(num_attention_heads=48, head_dim=40, qk_rope_head_dim=12, index_n_heads=12,
                                index_head_dim=48)
    bf16 = limits.shape_problems(shapes, "bf16", "NVIDIA H200")
    assert [p.split(" ")[0] for p in bf16] == ["`head_dim`", "`num_attention_heads`", "`index_head_dim`", "`index_n_heads`"]
    assert "must be a multiple of 16" in bf16[0] and "multiple of 32, or fewer than 32" in bf16[1]
    fp8 = limits.shape_problems(shapes, "fp8_ds_mla", "NVIDIA H200")
    assert "28 NoPE dims must be a multiple of 64" in fp8[0] and fp8[1].startswith("`qk_rope_head_dim` = 12")
    # The CPU interprets the kernels: any number of indexer heads; a model without CSA layers has
    # no indexer at all.
    assert not any("index_n_heads" in p for p in limits.shape_problems(shapes, "bf16", "cpu"))
    no_csa = dataclasses.replace(shapes, index_n_heads=None, index_head_dim=None)
    assert not any("index" in p for p in limits.shape_problems(no_csa, "bf16", "NVIDIA H200"))
