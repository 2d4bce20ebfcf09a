"""What a serving engine holds on a device besides its weights and its KV cache, measured before the
pools are allocated (vLLM runs a profiling forward pass for this; here XLA's buffer assignment of
the compiled programs gives it without running them).

The pools are sized from what is left of `gpu_memory_utilization` of a device's memory once the
weights and these activations are counted. Without them the pools took all of it, and the first
long prefill (its scratch grows with the step's tokens) or prompt-logprobs pass could run out of
memory while serving. The builder (engine/builder.py) measures the largest buckets compiled for
the smallest pools, as shapes only (nothing is allocated): every step updates the pools in place,
so its scratch does not grow with them; it then checks the warmed-up engine's own programs
(`engine_activations`, nothing compiled) against that reservation. The measured programs are kept
in the program cache, so a restart reads them back for the same figures.

What may be live at once, counted generously: the largest step (its scratch and its outputs),
the previous step's outputs (async scheduling launches a step while the last one's logits and
streams are still held), and the larger of prompt scoring and sampling, which run between steps
on those outputs. Not in XLA's figures: allocator fragmentation, collective (NCCL) buffers and
library workspaces, which the rest of `gpu_memory_utilization`'s margin has to hold.
"""

from __future__ import annotations

import dataclasses

from dsv4_jax.engine.runner import ModelRunner, StepBuckets
from dsv4_jax.engine.sampler import Sampler, SamplerConfig, SamplingRow, build_sampling_batch
from dsv4_jax.engine.sampling_params import SamplingParams
from dsv4_jax.kv_cache.paged import PagedCacheLayout

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class ActivationMemory:
    """Bytes per device; each figure the largest over the buckets."""

    step: int  # a step's scratch and outputs (logits, streams)
    step_outputs: int  # a step's outputs alone (the previous step's, held while the next runs)
    scores: int  # a prompt-scoring pass over a prefill step's streams (0: no prefill bucket)
    sampler: int  # sampling a step's logits, edited by the widest penalised batch

    @property
    def reserved_bytes(self) -> int:
        return self.step + self.step_outputs + max(self.scores, self.sampler)

    def describe(self) -> str:
        return (f"{self.reserved_bytes / MiB:.1f} MiB per device (a step {self.step / MiB:.1f} MiB, the previous "
                f"step's outputs {self.step_outputs / MiB:.1f} MiB, prompt scoring {self.scores / MiB:.1f} MiB, "
                f"sampling {self.sampler / MiB:.1f} MiB)")


def measure_activations(model, layout: PagedCacheLayout, *, buckets: StepBuckets, attention_backend: str,
                        max_model_len: int, sampler_config: SamplerConfig = SamplerConfig(),
                        num_speculative_tokens: int = 0) -> ActivationMemory:
    """The `ActivationMemory` of an engine serving `model` (dsv4_jax.weights.loading.CausalLM) with these
    buckets on pools of `layout`: its programs compiled for those pools' shapes, none run and no
    pool allocated. With speculative decoding, its verify buckets and their k + 1 logits a row too
    (the MTP drafter's program is not measured)."""
    runner = ModelRunner(model, layout, attention_backend=attention_backend, buckets=buckets, allocate_cache=False,
                         num_speculative_tokens=num_speculative_tokens)
    made: list[Sampler] = []

    def sampler_for(config: SamplerConfig) -> Sampler:
        made.append(Sampler(config, runner.mesh))
        return made[-1]

    measured = _activations(runner, sampler_for, max_model_len, sampler_config)
    for programs in (runner.programs, *(sampler.programs for sampler in made)):
        programs.keep()  # only analysed, never run: a restart reads them back for the same figures
    return measured


def engine_activations(engine) -> ActivationMemory:
    """The `ActivationMemory` of a warmed-up `LLMEngine`, from the executables its warm-up built
    (nothing is compiled)."""
    return _activations(engine.runner, lambda config: engine.sampler, engine.max_model_len, engine.sampler_config)


def _activations(runner: ModelRunner, sampler_for, max_model_len: int, sampler_config: SamplerConfig
                 ) -> ActivationMemory:
    programs = runner.program_memory()
    vocab = runner.config.vocab_size
    widest = max(programs.values(), key=lambda bucket: bucket.logits.shape[0])
    config = dataclasses.replace(sampler_config, pad_rows=widest.logits.shape[0])  # as the engine pads them
    width = config.penalty_widths(min(vocab + 1, max_model_len))[-1]
    penalised = build_sampling_batch(
        [SamplingRow(SamplingParams(repetition_penalty=1.1, logprobs=1), 0, config.prompt_of_width(width), [])],
        widest.logits.shape[0], vocab_size=vocab, config=config)
    return ActivationMemory(
        step=max(p.step.total for p in programs.values()),
        step_outputs=max(p.step.outputs for p in programs.values()),
        scores=max((p.scores.total for p in programs.values() if p.scores is not None), default=0),
        sampler=sampler_for(config).program_memory(widest.logits, penalised),
    )
