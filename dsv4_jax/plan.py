"""KV-cache capacity table: `python -m dsv4_jax.plan --model dsv4-flash --device-kind "NVIDIA H200"
--num-devices 8 --kv-cache-dtype auto --max-model-len 1048576`.

Compares fp8_ds_mla with bf16 rows (and float32 rows, the exact reference cache, when
`--kv-cache-dtype float32` asks for them), and tensor-parallel attention (KV replicated on every
rank: V4 has one KV head) with data-parallel attention, for the given device count. Nothing runs
on a device: memory comes from `--device-memory-gib` or our table of device kinds, weights per
device from `--weight-gib` or an estimate from the checkpoint shapes.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Callable, Sequence

from dsv4_jax.config import DeepseekV4Config
from dsv4_jax.kv_cache.planner import (
    GiB,
    MiB,
    MeshShape,
    estimate_weight_bytes_per_device,
    idle_layer_bytes,
    nominal_device_memory,
    plan_capacity,
)
from dsv4_jax.kv_cache.resolver import (
    ACCEPTED_REQUESTS, ATTENTION_BACKENDS, KVCacheSpec, fp8_ds_mla_layout_problem, resolve_kv_cache,
)
from dsv4_jax.presets import PRESETS, get_config
from pallas_kernels.cli import OneLineParser, add_debug_flag, run_main

PROG = "python -m dsv4_jax.plan"


def _load_model(name: str) -> DeepseekV4Config:
    if name in PRESETS:
        return get_config(name)
    path = Path(name)
    if path.exists():
        return DeepseekV4Config.from_json(path)
    raise ValueError(
        f"--model {name!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an existing model directory "
        "or config.json"
    )


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number, rejected with a usage error below `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _gib(n: float) -> str:
    return f"{n / GiB:,.2f}"


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(
        str(c).ljust(w) if i < left else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))
    ).rstrip()
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def _alternative(requested: str, args: argparse.Namespace, config: DeepseekV4Config) -> tuple[KVCacheSpec, str]:
    """Resolve a comparison column; fall back to the xla backend when the device cannot run it."""
    try:
        spec = resolve_kv_cache(requested, args.device_kind, args.compute_capability, args.attention_backend, config)
        return spec, ""
    except ValueError:
        spec = resolve_kv_cache(requested, args.device_kind, args.compute_capability, "xla", config)
        return spec, " (xla, emulated)"


def _header(args: argparse.Namespace, config: DeepseekV4Config, chosen: KVCacheSpec, memory: int | None) -> list[str]:
    return [
        f"{args.model}: {config.num_hidden_layers} layers, head_dim {config.head_dim} "
        f"(rope {config.qk_rope_head_dim}), window {config.sliding_window}, index_head_dim {config.index_head_dim}",
        f"{args.num_devices} x {args.device_kind}"
        + (f", {memory / GiB:,.1f} GiB each" if memory else ", memory unknown")
        + f", --gpu-memory-utilization {args.gpu_memory_utilization}, --max-model-len {args.max_model_len:,}, "
        f"--block-size {args.block_size}" + (f", MTP layers {args.num_mtp_layers}" if args.num_mtp_layers else ""),
        f"--kv-cache-dtype {args.kv_cache_dtype} -> {chosen.kv_cache_dtype} on {chosen.attention_backend}: "
        f"{chosen.reason}",
        "",
    ]


def _pool_table(
    args: argparse.Namespace, config: DeepseekV4Config, specs: dict[str, tuple[KVCacheSpec, str]]
) -> list[str]:
    """KV bytes of one max_model_len sequence, per pool, for each KV cache dtype."""
    pools_by_dtype = {}
    for dtype, (spec, _) in specs.items():
        plan = plan_capacity(config, spec, max_model_len=args.max_model_len, device_memory_bytes=None,
                             max_num_seqs=1, block_size=args.block_size, num_mtp_layers=args.num_mtp_layers)
        pools_by_dtype[dtype] = plan.pools
    first_pools = next(iter(pools_by_dtype.values()))
    rows = []
    for i, first in enumerate(first_pools):
        row = [first.name, str(first.layers), first.unit]
        for dtype in specs:
            p = pools_by_dtype[dtype][i]
            row.append(f"{p.bytes_per_unit:,}")
            row.append(f"{p.bytes_per_seq / MiB:,.1f} ({p.bytes_per_seq_exact / MiB:,.1f})")
        rows.append(row)
    total = ["total", "", ""]
    for dtype in specs:
        total += ["", f"{sum(p.bytes_per_seq for p in pools_by_dtype[dtype]) / MiB:,.1f} "
                      f"({sum(p.bytes_per_seq_exact for p in pools_by_dtype[dtype]) / MiB:,.1f})"]
    rows.append(total)
    header = ["pool", "layers", "unit"]
    for dtype in specs:
        header += [f"{dtype} B/unit/layer", f"{dtype} MiB/seq"]
    return ["KV bytes per sequence at max_model_len (MiB; whole blocks, exact in parentheses)",
            _table(header, rows), ""]


def _capacity_table(
    args: argparse.Namespace, config: DeepseekV4Config, specs: dict[str, tuple[KVCacheSpec, str]],
    chosen: KVCacheSpec, memory: int | None,
) -> list[str]:
    """Sequences that fit per KV cache dtype and mesh; a row that does not fit points to a note
    under the table holding the planner's whole reason (too long for a cell)."""
    n = args.num_devices
    meshes = [MeshShape(tensor_parallel=n, data_parallel=1)]
    if n > 1:
        meshes.append(MeshShape(tensor_parallel=1, data_parallel=n))
    rows, notes = [], []
    for dtype, (spec, note) in specs.items():
        for mesh in meshes:
            weights = (int(args.weight_gib * GiB) if args.weight_gib is not None
                       else estimate_weight_bytes_per_device(config, mesh, args.num_mtp_layers))
            label = f"{dtype}{'*' if dtype == chosen.kv_cache_dtype else ''}{note}"
            attention = f"{mesh.attention} tp={mesh.tensor_parallel} dp={mesh.data_parallel}"
            try:
                plan = plan_capacity(
                    config, spec, max_model_len=args.max_model_len, device_memory_bytes=memory,
                    gpu_memory_utilization=args.gpu_memory_utilization, weight_bytes=weights, mesh=mesh,
                    block_size=args.block_size, max_num_seqs=args.max_num_seqs, num_mtp_layers=args.num_mtp_layers,
                    reserved_bytes=int(args.reserve_gib * GiB),
                )
            except ValueError as err:
                notes.append(f"[{len(notes) + 1}] {label}, {attention}: {err}")
                rows.append([label, attention, _gib(weights), "-", "-", "-", "0", f"does not fit [{len(notes)}]"])
                continue
            idle = idle_layer_bytes(plan.pools, spec, plan.num_blocks["sliding"], plan.num_blocks["compressed"])
            rows.append([
                label, attention, _gib(weights), _gib(plan.kv_budget_bytes), _gib(idle), _gib(plan.bytes_per_seq),
                f"{plan.max_seqs_per_rank:,}", f"{plan.max_concurrent_seqs:,}",
            ])
    table = _table(
        ["kv cache", "attention", "weights GiB/dev", "KV budget GiB/dev", "idle layers GiB/dev", "GiB/seq", "seqs/rank",
         "concurrent seqs"],
        rows, left=2,
    )
    title = (f"Capacity at --max-model-len {args.max_model_len:,} (* = what --kv-cache-dtype "
             f"{args.kv_cache_dtype} resolves to)")
    return [title, table, *notes, ""]


def build_report(args: argparse.Namespace) -> str:
    config = _load_model(args.model)
    chosen = resolve_kv_cache(args.kv_cache_dtype, args.device_kind, args.compute_capability, args.attention_backend,
                              config)
    memory = int(args.device_memory_gib * GiB) if args.device_memory_gib else nominal_device_memory(args.device_kind)
    if memory is None and args.max_num_seqs is None:
        raise ValueError(
            f"no memory size known for {args.device_kind!r}: pass --device-memory-gib (or --max-num-seqs to size "
            f"the pools from max_num_seqs x max_model_len)"
        )
    specs = {chosen.kv_cache_dtype: (chosen, "")}
    for other in ("fp8_ds_mla", "bfloat16"):
        # No column for a layout the model's shapes leave undefined (fp8_ds_mla without whole
        # 64-dim NoPE blocks): the resolver refuses it on every backend.
        if other not in specs and not (other == "fp8_ds_mla" and fp8_ds_mla_layout_problem(config)):
            specs[other] = _alternative("fp8" if other == "fp8_ds_mla" else "bfloat16", args, config)
    footer = (
        "Tensor-parallel attention replicates the KV cache on every rank (one KV head), so concurrent sequences = "
        "data-parallel ranks x sequences per rank. Weights are "
        + ("as given (--weight-gib)" if args.weight_gib is not None else "estimated from the checkpoint shapes")
        + "; activations are not counted" + (f" beyond --reserve-gib {args.reserve_gib}" if args.reserve_gib else "")
        + ". Idle layers: planes of 1-byte elements of 2 to 4 GiB get layers that take them past 4 GiB (the Pallas "
        "kernels would index them with wrapping int32 offsets); the KV budget holds them."
    )
    return "\n".join([
        *_header(args, config, chosen, memory), *_pool_table(args, config, specs),
        *_capacity_table(args, config, specs, chosen, memory), footer,
    ])


def make_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dsv4-flash",
                   help=f"preset ({', '.join(sorted(PRESETS))}), model directory or config.json (default: %(default)s)")
    p.add_argument("--device-kind", default="NVIDIA H200",
                   help='jax device_kind, e.g. "NVIDIA H200" or cpu (default: %(default)s)')
    p.add_argument("--compute-capability", default=None, help="e.g. 9.0 (default: from the device kind)")
    p.add_argument("--num-devices", type=_at_least(1), default=1,
                   help="devices to plan for (default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help=f"one of {', '.join(ACCEPTED_REQUESTS)} (default: %(default)s)")
    p.add_argument("--attention-backend", default=None,
                   help=f"one of {', '.join(ATTENTION_BACKENDS)} (default: chosen with the KV cache dtype)")
    p.add_argument("--max-model-len", type=_at_least(1), default=1048576,
                   help="tokens of the longest sequence (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=256, help="tokens per KV cache block (default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of device memory for weights and KV cache (default: %(default)s)")
    p.add_argument("--device-memory-gib", type=float, default=None,
                   help="memory per device in GiB (default: from a table of device kinds)")
    p.add_argument("--weight-gib", type=float, default=None,
                   help="weights per device (default: estimated from the checkpoint shapes)")
    p.add_argument("--reserve-gib", type=float, default=0.0,
                   help="per device, for activations and workspace (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=_at_least(1), default=None,
                   help="sequence slots per rank (default: as many as fit)")
    p.add_argument("--num-mtp-layers", type=_at_least(0), default=0,
                   help="MTP layers served (speculative decoding; default: %(default)s)")
    add_debug_flag(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report; a bad flag or model is a ValueError for `run_main` to show as one line."""
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    print(build_report(args))
    return 0


if __name__ == "__main__":
    run_main(main, prog=PROG)
