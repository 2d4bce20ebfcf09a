"""The DeepSeek-V4 model in Flax NNX; `docs/architecture.md` maps each file to the spec."""
