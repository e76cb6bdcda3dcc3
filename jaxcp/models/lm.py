"""A small hybrid language model: embedding, N blocks of [RMSNorm -> mixer -> RMSNorm -> SwiGLU],
final norm, untied head. Mixers come from a layer pattern such as "gdn,gdn,gdn,attn"."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jaxcp.models.attention import CausalSelfAttention
from jaxcp.models.generation import generate
from jaxcp.models.inputs import check_tokens
from jaxcp.models.layers import GatedDeltaNet, KimiDeltaAttention
from jaxcp.models.norm import RMSNorm
from jaxcp.models.remat import remat_call
from jaxcp.models.token_blocks import from_token_blocks, to_token_blocks

MIXERS = ("gdn", "kda", "attn")
REMAT = ("none", "block", "mixer")


def _call(module, *args):
    return module(*args)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)).

    block_tokens: apply it to blocks of this many tokens one after the other, each
    recomputed in the backward (``jax.checkpoint``), so that the [B, T, intermediate]
    activations exist for one block at a time; None: all tokens at once."""

    def __init__(self, hidden_size: int, intermediate_size: int,
                 block_tokens: int | None = None, *, rngs: nnx.Rngs):
        if block_tokens is not None and block_tokens < 1:
            raise ValueError(f"block_tokens must be positive or None, got {block_tokens}")
        lin = lambda n_in, n_out: nnx.Linear(n_in, n_out, use_bias=False, rngs=rngs)
        self.gate_proj = lin(hidden_size, intermediate_size)
        self.up_proj = lin(hidden_size, intermediate_size)
        self.down_proj = lin(intermediate_size, hidden_size)
        self.block_tokens = block_tokens

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up, down = (p.kernel[...].astype(x.dtype)
                          for p in (self.gate_proj, self.up_proj, self.down_proj))
        mlp = lambda y: (jax.nn.silu(y @ gate) * (y @ up)) @ down
        T = x.shape[1]
        if self.block_tokens is None or T <= self.block_tokens:
            return mlp(x)
        out = lax.map(jax.checkpoint(mlp), to_token_blocks(x, self.block_tokens))
        return from_token_blocks(out, T)


class Block(nnx.Module):
    """x + mixer(norm(x)), then + mlp(norm(.))."""

    def __init__(self, kind: str, hidden_size: int, num_heads: int, head_dim: int,
                 intermediate_size: int, cp_axis: str | None, backend: str | None,
                 attn_block_size: int, remat_mixer: bool = False,
                 mlp_block_tokens: int | None = None, cp_layout: str = "contiguous",
                 cp_kv: str = "allgather", segments: int | None = None, *, rngs: nnx.Rngs):
        self.remat_mixer = remat_mixer
        self.mixer_norm = RMSNorm(hidden_size)
        if kind == "gdn":
            self.mixer = GatedDeltaNet(hidden_size, num_heads, head_dim, cp_axis=cp_axis,
                                       backend=backend, cp_layout=cp_layout, segments=segments,
                                       rngs=rngs)
        elif kind == "kda":
            self.mixer = KimiDeltaAttention(hidden_size, num_heads, head_dim, cp_axis=cp_axis,
                                            backend=backend, cp_layout=cp_layout,
                                            segments=segments, rngs=rngs)
        else:
            self.mixer = CausalSelfAttention(hidden_size, num_heads, head_dim=head_dim,
                                             cp_axis=cp_axis, block_size=attn_block_size,
                                             cp_layout=cp_layout, cp_kv=cp_kv, rngs=rngs)
        self.mlp_norm = RMSNorm(hidden_size)
        self.mlp = SwiGLU(hidden_size, intermediate_size, mlp_block_tokens, rngs=rngs)

    def init_cache(self, batch_size: int, max_len: int, dtype):
        """The mixer's empty cache (``models.cache``)."""
        if isinstance(self.mixer, CausalSelfAttention):
            return self.mixer.init_cache(batch_size, max_len, dtype)
        return self.mixer.init_cache(batch_size, dtype)

    def __call__(self, x: jax.Array, cu_seqlens: jax.Array | None, cache=None):
        """x -> the block's output; with the mixer's cache, (that, the new cache)."""
        if cache is None:
            mixer = remat_call if self.remat_mixer else _call
            x = x + mixer(self.mixer, self.mixer_norm(x), cu_seqlens)
        else:
            h, cache = self.mixer(self.mixer_norm(x), cache=cache)
            x = x + h
        y = x + self.mlp(self.mlp_norm(x))
        return y if cache is None else (y, cache)


class LM(nnx.Module):
    """tokens [B, T] int -> logits [B, T, vocab_size] float32.

    layer_pattern: comma-separated mixers from MIXERS, one per block ("gdn,gdn,gdn,attn").
    backend: the GDN/KDA ops' backend (None: the library default); attn_block_size: the
    attention layers' query/key block (CausalSelfAttention's block_size). remat: what the
    backward recomputes instead of keeping (``models.remat``, keeping nothing inside):
    "none", "block" (each block keeps only its input) or "mixer" (each mixer keeps only its
    input; the MLPs keep theirs). mlp_block_tokens: the MLPs work on blocks of this many
    tokens one at a time (``SwiGLU``); None: all tokens at once. cp_layout: how the sequence
    is split over cp_axis (``jaxcp.cp.split``): tokens come in that layout's order, which the
    caller makes once per batch (``jaxcp.to_layout``). cp_kv: how the attention layers pass
    keys and values over cp_axis, "allgather" or "ring" (``CausalSelfAttention``). segments:
    the GDN/KDA ops' (None: chosen by shape, ``jaxcp.cp.segments``)."""

    def __init__(self, vocab_size: int, hidden_size: int, layer_pattern: str, num_heads: int,
                 head_dim: int, intermediate_size: int | None = None,
                 cp_axis: str | None = None, backend: str | None = None,
                 attn_block_size: int = 1024, remat: str = "none",
                 mlp_block_tokens: int | None = None, cp_layout: str = "contiguous",
                 cp_kv: str = "allgather", segments: int | None = None, *, rngs: nnx.Rngs):
        if remat not in REMAT:
            raise ValueError(f"remat must be one of {REMAT}, got {remat!r}")
        self.remat = remat
        kinds = [k.strip() for k in layer_pattern.split(",") if k.strip()]
        bad = [k for k in kinds if k not in MIXERS]
        if not kinds or bad:
            raise ValueError(f"layer_pattern must list mixers from {MIXERS}, got {layer_pattern!r}")
        self.embed = nnx.Embed(vocab_size, hidden_size, rngs=rngs)
        self.blocks = nnx.List([Block(kind, hidden_size, num_heads, head_dim,
                                      intermediate_size or 4 * hidden_size, cp_axis, backend,
                                      attn_block_size, remat == "mixer", mlp_block_tokens,
                                      cp_layout, cp_kv, segments, rngs=rngs)
                                for kind in kinds])
        self.norm = RMSNorm(hidden_size)
        self.head = nnx.Linear(hidden_size, vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, cu_seqlens: jax.Array | None = None, *,
                 cache: tuple | None = None):
        """Logits [B, T, vocab] float32; with a cache (``init_cache``) the tokens continue the
        sequences it holds, on one device, and the call returns (logits, the new cache)."""
        if cache is None:
            return self.head(self.features(tokens, cu_seqlens)).astype(jnp.float32)
        x, cache = self.features(tokens, cu_seqlens, cache=cache)
        return self.head(x).astype(jnp.float32), cache

    def init_cache(self, batch_size: int, max_len: int) -> tuple:
        """The empty cache of every block, for `batch_size` sequences of up to `max_len`
        tokens, activations in the parameters' dtype."""
        dtype = self.embed.embedding[...].dtype
        return tuple(block.init_cache(batch_size, max_len, dtype) for block in self.blocks)

    def features(self, tokens: jax.Array, cu_seqlens: jax.Array | None = None, *,
                 cache: tuple | None = None):
        """tokens [B, T] -> the final norm's output [B, T, hidden], which the head maps to
        logits (a loss over a large vocabulary takes it in blocks: ``jaxcp.train.loss``);
        with a cache, (that, the new cache)."""
        check_tokens(tokens)
        # nnx.Embed returns float32 whatever its table's dtype: compute in the table's dtype
        # (bf16 when the train step casts the parameters for bf16 compute)
        x = self.embed(tokens).astype(self.embed.embedding[...].dtype)
        if cache is not None:
            if len(cache) != len(self.blocks):
                raise ValueError(f"LM: cache must hold one entry per block ({len(self.blocks)}),"
                                 f" got {len(cache)}: use init_cache")
            new = []
            for block, c in zip(self.blocks, cache):
                x, c = block(x, cu_seqlens, c)
                new.append(c)
            return self.norm(x), tuple(new)
        call = remat_call if self.remat == "block" else _call
        for block in self.blocks:
            x = call(block, x, cu_seqlens)
        return self.norm(x)

    def generate(self, prompt: jax.Array, max_new_tokens: int, *, temperature: float = 0.0,
                 rng: jax.Array | None = None) -> jax.Array:
        """prompt [B, T] int -> the next max_new_tokens tokens [B, max_new_tokens] int32: the
        prompt through the chunk ops (prefill), then one token at a time from the caches,
        greedy (temperature 0) or sampled from softmax(logits / temperature) with rng.
        One jitted program per shape (``generation.generate``)."""
        return generate(self, prompt, max_new_tokens, temperature=temperature, rng=rng)
