"""Speculative decoding's acceptance: which draft tokens the target model keeps.

A verify step scores k draft tokens and the position after them in one pass: `target_probs`
[B, k + 1, V] are the model's distributions at the k + 1 positions (after temperature, top-k /
top-p, penalties: what the row would sample from), `draft_ids` [B, k] the drafter's tokens and
`draft_probs` [B, k, V] the distributions it drew them from (None: drawn greedily, a one-hot q).

* Random rows (Leviathan et al., 2023): draft token i is accepted with probability
  min(1, p_i(d) / q_i(d)); at the first rejection the row's token is drawn from
  normalise(max(0, p_i - q_i)) and the row ends there; when all k are accepted a bonus token is
  drawn from p_k. Each emitted token is then distributed exactly as the target model's own sample
  would be, whatever the drafter proposes.
* Greedy rows: drafts are accepted while each equals the argmax of p_i; the first that differs is
  replaced by that argmax (and ends the row); the bonus is the argmax of p_k. The output equals
  greedy decoding of the target alone.

Returns the emitted tokens [B, k + 1] (-1 after a row's last) and the accepted draft count [B];
each row emits accepted + 1 tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EMPTY = -1  # a position after the row's last emitted token


def rejection_sample(
    target_probs: jax.Array,  # [B, k + 1, V] float32
    draft_ids: jax.Array,  # [B, k] int32
    draft_probs: jax.Array | None,  # [B, k, V] float32, or None for greedy (one-hot) drafts
    greedy: jax.Array,  # [B] bool: the row decodes greedily
    key: jax.Array,  # a PRNG key for the acceptance tests and the draws
) -> tuple[jax.Array, jax.Array]:  # tokens [B, k + 1] int32, accepted [B] int32
    b, k1, v = target_probs.shape
    k = k1 - 1
    accept_key, recover_key, bonus_key = jax.random.split(key, 3)
    p_draft = jnp.take_along_axis(target_probs[:, :k], draft_ids[..., None], axis=-1)[..., 0]  # [B, k]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
        q = jax.nn.one_hot(draft_ids, v, dtype=target_probs.dtype)
    else:
        q = draft_probs
        q_draft = jnp.take_along_axis(q, draft_ids[..., None], axis=-1)[..., 0]
    uniforms = jax.random.uniform(accept_key, (b, k))
    target_argmax = jnp.argmax(target_probs, axis=-1).astype(jnp.int32)  # [B, k + 1]
    # Accepted when u * q(d) < p(d), i.e. with probability min(1, p / q) (q(d) > 0: d was drawn from q).
    sampled_ok = uniforms * q_draft < p_draft
    greedy_ok = draft_ids == target_argmax[:, :k]
    ok = jnp.where(greedy[:, None], greedy_ok, sampled_ok)
    accepted = jnp.argmin(jnp.concatenate([ok, jnp.zeros((b, 1), bool)], axis=1), axis=1).astype(jnp.int32)
    # The token at the first rejection: from the residual max(0, p - q), normalised (all zero only
    # when p == q, where a rejection cannot happen; p then stands in).
    residual = jnp.maximum(target_probs[:, :k] - q, 0.0)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, target_probs[:, :k])
    recovered = _draw(recover_key, residual)  # [B, k]
    bonus = _draw(bonus_key, target_probs[:, k])  # [B]
    recovered = jnp.where(greedy[:, None], target_argmax[:, :k], recovered)
    bonus = jnp.where(greedy, target_argmax[:, k], bonus)
    position = jnp.arange(k1)[None, :]
    last = jnp.where(accepted == k, bonus, jnp.take_along_axis(
        recovered, jnp.minimum(accepted, k - 1)[:, None], axis=1)[:, 0] if k else bonus)
    drafts = jnp.concatenate([draft_ids, jnp.zeros((b, 1), draft_ids.dtype)], axis=1)
    tokens = jnp.where(position < accepted[:, None], drafts,
                       jnp.where(position == accepted[:, None], last[:, None], EMPTY))
    return tokens.astype(jnp.int32), accepted


def _draw(key: jax.Array, probs: jax.Array) -> jax.Array:
    """One token per distribution of `probs` [..., V] (unnormalised is fine)."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)
