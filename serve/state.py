"""What the routes share: the loaded model and engine, the request limits, the metrics, and whether
the server is ready (warm-up done) and still accepting (not shutting down)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class ServingState:
    args: Any  # serve.args.ServerArgs
    served_model_names: tuple[str, ...]
    config: Any = None  # dsv4_jax.engine.args.EngineConfig: the engine's arguments, resolved before it loads
    built: Any = None  # dsv4_jax.engine.builder.BuiltEngine, once built (before it serves)
    engine: Any = None  # dsv4_jax.engine.async_engine.EngineClient, once started
    layout: Any = None  # dsv4_jax.kv_cache.paged.PagedCacheLayout of one rank's pools, once built
    limits: Any = None  # serve.protocol.ServerLimits, once the model is known
    metrics: Any = None  # serve.metrics.ServerMetrics
    ready: bool = False  # warm-up done: /health answers 200
    accepting: bool = True  # False once shutdown began: new requests get 503
    load_error: str | None = None
    started_at: float = 0.0  # when the app was built (the models' `created`)
    # Where the start-up is: {"phase": ..., "done": n, "total": m} (`starting`), for /health's 503.
    startup: dict[str, Any] = dataclasses.field(default_factory=lambda: {"phase": "starting", "done": 0, "total": 0})

    def starting(self, phase: str, done: int, total: int) -> None:
        """The builder's progress callback (called from the loading thread: one assignment)."""
        self.startup = {"phase": phase, "done": done, "total": total}

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len
