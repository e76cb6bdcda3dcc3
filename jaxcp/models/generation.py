"""Generation from an ``LM``: prefill the caches with the prompt, then decode token by token in
one jitted ``lax.scan``."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax


def _next_token(logits: jax.Array, temperature: float, key: jax.Array) -> jax.Array:
    """[B, vocab] -> [B] int32: the argmax (temperature 0) or a sample of
    softmax(logits / temperature)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@partial(jax.jit, static_argnums=(0, 3, 4))
def _generate(graph, state, prompt, max_new_tokens, temperature, rng):
    model = nnx.merge(graph, state)
    cache = model.init_cache(prompt.shape[0], prompt.shape[1] + max_new_tokens)
    logits, cache = model(prompt, cache=cache)

    def step(carry, key):
        last, cache = carry
        token = _next_token(last, temperature, key)
        logits, cache = model(token[:, None], cache=cache)
        return (logits[:, -1], cache), token

    keys = jax.random.split(rng, max_new_tokens)
    _, tokens = lax.scan(step, (logits[:, -1], cache), keys)
    return tokens.T


def generate(model, prompt: jax.Array, max_new_tokens: int, *, temperature: float = 0.0,
             rng: jax.Array | None = None) -> jax.Array:
    """``LM.generate``: prompt [B, T] int -> [B, max_new_tokens] int32."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a float >= 0, got {temperature!r}")
    if temperature > 0 and rng is None:
        raise ValueError("temperature > 0 samples: pass rng (a jax.random key)")
    rng = jax.random.key(0) if rng is None else rng
    graph, state = nnx.split(model)
    return _generate(graph, state, jnp.asarray(prompt, jnp.int32), max_new_tokens,
                     float(temperature), rng)
