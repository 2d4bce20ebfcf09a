"""JAX's persistent compilation cache for the engine's programs, on by default for `LLM` and
`python -m serve`, so a restart (a new notebook kernel, a restarted server) loads the warm-up's
executables instead of compiling them again (on an H200 one step program took 11-15 s).

The directory is JAX's own setting where given (`$JAX_COMPILATION_CACHE_DIR`, or
`jax.config.update("jax_compilation_cache_dir", ...)`), else `$DSV4_JAX_CACHE/jax-cache` (by
default `~/.cache/dsv4-jax/jax-cache`). JAX's own switch turns it off
(`JAX_ENABLE_COMPILATION_CACHE=false`). JAX reads these once, at the first compile of the
process: a process that compiled something before left the cache as it found it.
"""

from __future__ import annotations


def enable_compilation_cache(*, every_program: bool = False) -> str | None:
    """Point JAX's persistent compilation cache at a directory where none is set; returns the
    directory in use (None where JAX's switch is off). In our directory every program is cached,
    also those that compile in under a second and small ones, so a restart compiles nothing; in
    a directory JAX was given, JAX's thresholds stay as they are unless `every_program` (the
    server)."""
    import jax

    from dsv4_jax.weights.builtin import cache_root

    if not jax.config.jax_enable_compilation_cache:
        return None
    directory = jax.config.jax_compilation_cache_dir
    if not directory:
        directory = str(cache_root() / "jax-cache")
        jax.config.update("jax_compilation_cache_dir", directory)
        every_program = True
    if every_program:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return directory
