"""A short generation demo: `python -m dsv4_jax.demo [--model DIR] [--prompt TEXT]`.

Encodes a chat prompt with the V4 encoder and the real tokenizer, then decodes greedily with the
full-sequence forward (no KV cache yet: the engine brings that). Without `--model` it runs the
built-in `dsv4-tiny`, whose random weights make the text meaningless but exercise every part.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in dsv4-tiny)")
    parser.add_argument("--prompt", default="Hello! Who are you?")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(logging.WARNING)

    import dsv4_jax
    from dsv4_jax.builtin import builtin_model_dir
    from dsv4_jax.chat import encode_messages
    from dsv4_jax.tokenizer import encode_prompt, load_tokenizer

    model_dir = args.model or builtin_model_dir()
    model = dsv4_jax.load_model(model_dir, dtype=args.dtype)
    tokenizer = load_tokenizer(model_dir)
    prompt = encode_messages([{"role": "user", "content": args.prompt}], thinking_mode="chat")
    ids = encode_prompt(tokenizer, prompt)
    # One fixed bucket: the model is causal, so padding after the last real token changes nothing.
    bucket = max(64, 1 << (len(ids) + args.max_tokens - 1).bit_length())
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, : len(ids)] = ids
    length, generated = len(ids), []
    start = time.perf_counter()
    for _ in range(args.max_tokens):
        logits = np.asarray(model(tokens)[0, length - 1])
        next_id = int(logits.argmax())
        generated.append(next_id)
        if next_id == model.config.eos_token_id or length == bucket:
            break
        tokens[0, length] = next_id
        length += 1
    elapsed = time.perf_counter() - start
    print(f"model: {model_dir}")
    print(f"prompt ({len(ids)} tokens): {prompt!r}")
    print(f"generated ids: {generated}")
    print(f"generated text: {tokenizer.decode(generated, skip_special_tokens=False)!r}")
    print(f"{len(generated)} tokens in {elapsed:.2f}s (first includes compilation)")


if __name__ == "__main__":
    main()
