"""A short generation demo: `python -m dsv4_jax.demo [--model DIR] [--prompt TEXT]`.

Encodes a chat prompt with the V4 encoder and the real tokenizer, then decodes greedily with the
full-sequence forward (no KV cache yet: the engine brings that). Without `--model` it runs the
built-in `dsv4-tiny`, whose random weights make the text meaningless but exercise every part.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from pallas_kernels.cli import OneLineParser, add_debug_flag, run_main

if TYPE_CHECKING:
    from dsv4_jax.weights.loading import CausalLM

PROG = "python -m dsv4_jax.demo"


def make_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, metavar="DIR",
        help="DeepSeek-V4 checkpoint directory with config.json and *.safetensors (default: the built-in "
             "dsv4-tiny, written once under $DSV4_JAX_CACHE or ~/.cache/dsv4-jax)",
    )
    parser.add_argument("--prompt", default="Hello! Who are you?", help="the user message (default: %(default)r)")
    parser.add_argument(
        "--max-tokens", type=int, default=8, help="tokens to generate at most (default: %(default)s)"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"],
        help="compute dtype of activations and dequantised weights (default: %(default)s)",
    )
    add_debug_flag(parser)
    return parser


def generate(model: CausalLM, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with the full-sequence forward; stops at EOS. Returns the new token ids."""
    # One fixed bucket: the model is causal, so padding after the last real token changes nothing.
    bucket = max(64, 1 << (len(prompt_ids) + max_tokens - 1).bit_length())
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, : len(prompt_ids)] = prompt_ids
    length, generated = len(prompt_ids), []
    for _ in range(max_tokens):
        logits = np.asarray(model(tokens)[0, length - 1])
        next_id = int(logits.argmax())
        generated.append(next_id)
        if next_id == model.config.eos_token_id or length == bucket:
            break
        tokens[0, length] = next_id
        length += 1
    return generated


def main(argv: Sequence[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)

    import dsv4_jax
    from dsv4_jax.weights.builtin import builtin_model_dir
    from dsv4_jax.chat import encode_messages
    from dsv4_jax.chat.tokenizer import encode_prompt, load_tokenizer

    model_dir = args.model or builtin_model_dir()
    model = dsv4_jax.load_model(model_dir, dtype=args.dtype)
    tokenizer = load_tokenizer(model_dir)
    prompt = encode_messages([{"role": "user", "content": args.prompt}], thinking_mode="chat")
    ids = encode_prompt(tokenizer, prompt)
    start = time.perf_counter()
    generated = generate(model, ids, args.max_tokens)
    elapsed = time.perf_counter() - start
    print(f"model: {model_dir}")
    print(f"prompt ({len(ids)} tokens): {prompt!r}")
    print(f"generated ids: {generated}")
    print(f"generated text: {tokenizer.decode(generated, skip_special_tokens=False)!r}")
    print(f"{len(generated)} tokens in {elapsed:.2f}s (first includes compilation)")


if __name__ == "__main__":
    run_main(main, prog=PROG)
