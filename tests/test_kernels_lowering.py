"""AOT lowering of the Pallas kernels to Triton IR for the four GPU kinds, in-process, at
DeepSeek-V4-Flash shapes (64 heads, head_dim 512, top-k 512, window 128, block 256), with the
launch parameters of pallas_kernels/tuning.py: what `python -m pallas_kernels.check` runs.

This proves the kernels lower to Triton IR for each compute capability and that MLIR's verifier
accepts every module (which XLA otherwise first does when it compiles on a GPU); it does not compile
them (register and shared-memory limits are only checked by the GPU compiler) or run them. Below
compute capability 8.9 (A100) only the bf16 layout's kernels apply and are lowered; a kind that
pallas_kernels/devices.py does not know is refused in one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import check, devices
from pallas_kernels.cli import run_main


def test_every_kernel_lowers_for_every_device_kind():
    results = check.run_check(check.DEFAULT_DEVICE_KINDS, check.CHECK_KERNELS)
    assert len(results) == len(check.DEFAULT_DEVICE_KINDS) * len(check.CHECK_KERNELS)
    failed = [r.line() for r in results if not r.ok]
    assert not failed, "\n".join(failed)


def test_prefill_variants_include_window_kv_for_every_mode():
    """The serving path (`Attention.step`) passes a prefill chunk's own rows as `window_kv` on every
    layer, so the check lowers prefill with it for window, HCA and CSA, both formats, every kind."""
    want = {f"{fmt}/{mode}{tail}" for fmt in ("fp8_ds_mla", "bf16") for mode in ("window", "csa", "hca")
            for tail in ("", "+window_kv")}
    for kind in check.DEFAULT_DEVICE_KINDS:
        variants = check.cases("sparse_prefill", kind)
        assert {name for name, _, _ in variants} == want, kind
        for name, _, args in variants:  # window_kv is the 12th positional argument: [B, S, head_dim]
            assert (len(args) == 12) == name.endswith("+window_kv"), name
            if name.endswith("+window_kv"):
                assert args[-1].shape == (check.FLASH.prefill_batch, check.FLASH.prefill_tokens, check.FLASH.head_dim)
    # and the rows reach the kernel: its chunk-rows operand is [B, S + block_k, D], not the [1, 1, 16] dummy
    sh = check.FLASH
    for name, fn, args in check.cases("sparse_prefill", "NVIDIA H200"):
        jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
        calls = [e for e in _all_eqns(jaxpr) if e.primitive.name == "pallas_call"]
        assert len(calls) == 1, name
        chunk_rows = [
            v.aval.shape for v in calls[0].invars
            if v.aval.ndim == 3 and v.aval.shape[0] == sh.prefill_batch and v.aval.shape[1] > sh.prefill_tokens
        ]
        assert (chunk_rows != []) == name.endswith("+window_kv"), (name, chunk_rows)


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name != "pallas_call":
            for sub in _subjaxprs(eqn.params):
                yield from _all_eqns(sub)


def test_fp8_lowering_is_refused_below_8_9():
    """Why the check skips the fp8 variants on an A100: lowering one really fails there (fp8 casts
    need compute capability >= 8.9, the A100 is 8.0), so the check does lower per device."""
    fn, args = next((fn, args) for name, fn, args in check.cases("kv_write", "NVIDIA A100") if name == "fp8/indexer")
    with pytest.raises(NotImplementedError, match="float8_e4m3fn"):
        check.lower(fn, args, "NVIDIA A100")


def test_a100_lowers_the_bf16_kernels_and_reports_fp8_as_not_applicable(capsys):
    a100 = devices.lookup("NVIDIA A100")
    applicable = {
        kernel: [name for name, _, _ in check.cases(kernel, "NVIDIA A100") if check.applies(name, a100)]
        for kernel in check.CHECK_KERNELS
    }
    assert applicable == {
        "kv_write": ["bf16/window", "bf16/csa", "bf16/indexer"],
        "sparse_decode": ["bf16/window", "bf16/csa", "bf16/hca"],
        "sparse_prefill": [f"bf16/{mode}{tail}" for mode in ("window", "csa", "hca") for tail in ("", "+window_kv")],
        "indexer_topk": ["bf16/decode"],
    }
    assert check.main(["--device-kind", "NVIDIA A100", "--kernel", "kv_write"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("NOTE")] == [f"NOTE NVIDIA A100: {check.not_applicable(a100)}"]
    assert "no fp8 on compute capability 8.0" in check.not_applicable(a100)
    (result,) = [line for line in lines if line.startswith(("OK", "FAIL", "N/A"))]
    assert result.startswith("OK") and result.endswith("3 variants lowered; 3 variants not applicable")


def test_unknown_device_kind_is_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        run_main(check.main, ["--device-kind", "NVIDIA H200", "--device-kind", "foo"], prog=check.PROG)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == ""  # refused before anything is printed or lowered
    assert err.count("\n") == 1 and "'foo'" in err
    assert all(name in err for name in devices.gpu_kind_names())


def test_every_kind_with_pallas_kernels_has_a_lowering_target():
    from jax._src.pallas.triton import gpu_info  # JAX's own device kind -> compute capability list

    for kind in devices.DEVICE_KINDS:
        if kind.runs_pallas:
            target = check.JAX_KIND_BY_CAPABILITY[kind.compute_capability]
            version = gpu_info.gpu_version_from_device_kind(target)
            assert gpu_info.get_gpu_info_from_version(version).arch_name == kind.compute_capability, kind.name


def test_main_prints_one_line_per_pair(capsys):
    assert check.main(["--device-kind", "NVIDIA H200", "--kernel", "kv_write"]) == 0
    out = capsys.readouterr().out
    assert "NOT compiled" in out and "NOTE" not in out
    assert sum(line.startswith(("OK", "FAIL")) for line in out.splitlines()) == 1


def _kernel_dots(jaxpr, found):
    """dot_general operand dtypes inside every pallas_call kernel of `jaxpr` (recursively)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            _collect_dots(eqn.params["jaxpr"], found)
        else:
            for sub in _subjaxprs(eqn.params):
                _kernel_dots(sub, found)
    return found


def _subjaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr
            elif hasattr(v, "eqns"):
                yield v


def _collect_dots(jaxpr, found):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for sub in _subjaxprs(eqn.params):
            _collect_dots(sub, found)


def test_kernel_dots_take_bf16_operands():
    """No fp32 dot inside a kernel: on the GPU an fp32 jnp.dot lowers to TF32 (half the bf16
    rate, ~1e-3 relative error), which interpret mode on CPU never shows."""
    for kernel in ("sparse_decode", "sparse_prefill", "indexer_topk"):
        for variant, fn, args in check.cases(kernel, "NVIDIA H200"):
            dots = _kernel_dots(jax.make_jaxpr(fn)(*args).jaxpr, [])
            assert dots, (kernel, variant)
            assert all(d == ("bfloat16", "bfloat16") for d in dots), (kernel, variant, set(dots))


def test_the_check_runs_mlir_verification_on_every_module():
    """A module that lowers but does not verify must fail the check, not the GPU compile. The
    kernel below loops `jnp.where(pred, 4, 0)` times: Triton's lowering types that select as the
    predicate (i1) and the loop's bounds disagree, exactly how every sparse_prefill kernel lowered
    until an H200 refused them ("'scf.for' op failed to verify ...")."""
    from jax import lax
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        n = jnp.where(x_ref[0] > 0, 4, 0)
        o_ref[...] = lax.fori_loop(0, n, lambda i, acc: acc + x_ref[...], jnp.zeros((16,), jnp.float32))

    def bad(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32))(x)

    def good(x):  # the same loop with an int32 trip count lowers and verifies
        return pl.pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., lax.fori_loop(
                0, (x_ref[0] > 0).astype(jnp.int32) * 4, lambda i, acc: acc + x_ref[...],
                jnp.zeros((16,), jnp.float32))),
            out_shape=jax.ShapeDtypeStruct((16,), jnp.float32))(x)

    x = jax.ShapeDtypeStruct((16,), jnp.float32)
    assert check.VERIFIED
    check.lower(good, (x,), "NVIDIA H100")
    with pytest.raises(Exception, match="scf.for"):
        check.lower(bad, (x,), "NVIDIA H100")


@pytest.mark.parametrize("kernel, sinks_at, head_axis", [("sparse_decode", 4, 1), ("sparse_prefill", 5, 2)])
def test_attention_kernels_under_tensor_parallelism_lower_per_rank(kernel, sinks_at, head_axis):
    """On a (data 1 x tensor 2) mesh of abstract H200s, the model's `heads_over_tensor` runs the
    Triton kernel inside a manual (shard_map) computation with half the query heads and sinks per
    rank, the pools whole: XLA never has to partition (or gather around) the opaque kernel. Lowering
    only, not compiling."""
    import re
    import warnings

    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, NamedSharding, PartitionSpec

    from dsv4_jax.model.attention import heads_over_tensor

    variant, fn, args = next(c for c in check.cases(kernel, "NVIDIA H200") if c[0] == "fp8_ds_mla/csa")
    mesh = AbstractMesh((1, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2,
                        abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="cuda"))
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "Pallas Triton is deprecated"
        exported = jax.export.export(
            jax.jit(lambda *a: heads_over_tensor(fn, a, sinks_at=sinks_at, head_axis=head_axis),
                    in_shardings=NamedSharding(mesh, PartitionSpec())),
            platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)
    text = exported.mlir_module()
    assert exported.nr_devices == 2 and "sdy.manual_computation" in text and "__gpu$xla.gpu.triton" in text
    q, sinks = args[0], args[sinks_at]
    per_rank = list(q.shape)
    per_rank[head_axis] //= 2
    kernel_args = re.search(rf"func\.func private @{kernel}\((.*)", text).group(1)
    q_type = "x".join(map(str, per_rank)) + "xbf16"
    assert f"%arg0: tensor<{q_type}>" in kernel_args, kernel_args[:200]
    assert f"tensor<{sinks.shape[0] // 2}xf32>" in kernel_args


def test_kernels_refuse_pools_they_would_index_with_wrapping_offsets():
    """On an H200, sparse_decode over an e4m3 plane of 2.29e9 elements (2.14 GiB) hit an illegal
    memory access: JAX indexes operands of at most 4 GiB with int32 offsets. Every kernel now
    refuses such a pool at trace time, naming the way out; the references (the xla backend) read
    it, and a plane past 4 GiB (int64 offsets, verified on the H200) is taken."""
    import functools

    from pallas_kernels.indexer_topk import indexer_topk, indexer_topk_reference
    from pallas_kernels.kv_write import write_kv, write_kv_reference
    from pallas_kernels.sparse_decode import sparse_decode, sparse_decode_reference

    S = jax.ShapeDtypeStruct

    def kv_pool(blocks, units):
        return (S((1, blocks, units, 448), jnp.float8_e4m3fn), S((1, blocks, units, 64), jnp.bfloat16),
                S((1, blocks, units, 8), jnp.uint8))

    band, past = kv_pool(80_000, 64), kv_pool(160_000, 64)  # 2.29e9 and 4.59e9 e4m3 elements
    window = kv_pool(4, 256)
    q, tables = S((2, 64, 512), jnp.bfloat16), (S((2, 2), jnp.int32), S((2,), jnp.int32), S((64,), jnp.float32))
    cbt, idx = S((2, 512), jnp.int32), S((2, 512), jnp.int32)
    iq, iw = S((2, 1, 64, 128), jnp.bfloat16), S((2, 1, 64), jnp.float32)
    starts = (S((2,), jnp.int32), S((2,), jnp.int32))

    def decode(fn, pool):
        return jax.eval_shape(functools.partial(fn, window=128, ratio=4), q, window, *tables, pool, cbt, idx)

    def topk(fn, pool):
        blocks = 270_000 if pool is band else 540_000  # 2.2e9 and 4.4e9 e4m3 elements
        keys = (S((1, blocks, 64, 128), jnp.float8_e4m3fn), S((1, blocks, 64), jnp.float32))
        return jax.eval_shape(functools.partial(fn, topk=512, ratio=4), iq, iw, keys, cbt, *starts)

    def write(fn, pool):
        return jax.eval_shape(fn, pool, S((16, 512), jnp.bfloat16), S((16,), jnp.int32))

    for run, kernel, reference in ((decode, sparse_decode, sparse_decode_reference),
                                   (topk, indexer_topk, indexer_topk_reference),
                                   (write, write_kv, write_kv_reference)):
        with pytest.raises(ValueError, match="int32 offsets that wrap.*--attention-backend xla"):
            run(functools.partial(kernel, interpret=True), band)
        run(reference, band)
        run(functools.partial(kernel, interpret=True), past)
