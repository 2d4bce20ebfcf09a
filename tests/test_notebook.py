"""notebooks/quickstart.ipynb runs top to bottom in a fresh python3 kernel (nbclient), as a user would run it.

The built-in model's warm-up compiles are the cost (two model buckets: the notebook picks one prefill and one
decode bucket); the kernel shares this session's JAX_COMPILATION_CACHE_DIR, so a warm cache loads them instead."""

from __future__ import annotations

import os

import jax
import nbformat
from conftest import REPO  # tests/ is on sys.path
from nbclient import NotebookClient

NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


def outputs_text(cell: nbformat.NotebookNode) -> str:
    """Everything a code cell showed as text: streams, results and displays."""
    parts = []
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream":
            parts.append(output["text"])
        elif output["output_type"] in ("execute_result", "display_data"):
            parts.append(output["data"].get("text/plain", ""))
    return "".join(parts)


def test_notebook_is_stored_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    for i, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"cell {i} is stored with outputs"


def test_quickstart_notebook_runs_every_cell():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
           "MPLBACKEND": "Agg"}
    # allow_errors=False: the first cell that raises fails the test with its traceback (CellExecutionError).
    client = NotebookClient(notebook, kernel_name="python3", timeout=300, allow_errors=False,
                            resources={"metadata": {"path": str(REPO)}})
    client.execute(env=env)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    texts = [outputs_text(cell) for cell in code]
    assert all(cell.execution_count for cell in code)
    # The hand-written DSML completion parses into one call with JSON arguments, and the reasoning before it.
    parsed = next(t for t in texts if "get_weather" in t and "reasoning_content" in t)
    assert '\'arguments\': \'{"city": "Paris"}\'' in parsed and "I should call get_weather." in parsed
    # The planner printed its capacity table for 8 x H200.
    assert any("8 x NVIDIA H200" in t and "concurrent seqs" in t for t in texts)
    # One throughput line per batch size, each with every requested token, and the plot as a PNG.
    plot = code[-1]
    for batch in (1, 2, 4, 8):
        assert f"batch {batch}: {batch * 16} tokens in" in outputs_text(plot)
    assert any("image/png" in output.get("data", {}) for output in plot.outputs)
