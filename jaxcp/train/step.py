"""The jitted training step on a (data, seq) mesh: batch split over "data", sequence over "seq".

Parameters are replicated on every device: the model is small next to its activations, and
context parallelism splits activations along the sequence, so replicas cost little memory and
need no gather; the gradient of a replicated input of shard_map is summed over the mesh by JAX.
The loss is the mean cross-entropy over the masked target positions of the whole global batch
(sums are psum-ed over both axes inside shard_map). Compute runs in `compute_dtype` (matrices
cast from the float32 master parameters; vectors such as A_log, dt_bias and norms stay float32).
check_vma is shard_map's (the "interpret" backend needs False inside shard_map).
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcp.cp.split import to_layout
from jaxcp.train.cluster import global_batch
from jaxcp.train.loss import masked_token_sums
from jaxcp.train.mqar import Batch

AXES = ("data", "seq")
LOSS_BLOCK_TOKENS = 8192


def make_optimizer(lr: float, warmup: int, steps: int, weight_decay: float = 0.1,
                   clip: float = 1.0) -> optax.GradientTransformation:
    """AdamW on a warmup + cosine schedule, after global-norm gradient clipping."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1),
                                                  end_value=lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))


def _compute_params(params, dtype):
    return jax.tree.map(lambda p: p.astype(dtype) if p.ndim >= 2 else p, params)


def make_loss(graph, mesh: Mesh, compute_dtype=jnp.float32, check_vma: bool = True,
              loss_block_tokens: int = LOSS_BLOCK_TOKENS) -> Callable:
    """loss(params, batch) -> (mean masked cross-entropy, accuracy on the masked positions).
    The head's logits exist one block of loss_block_tokens tokens at a time
    (``jaxcp.train.loss``)."""
    def local(params, batch: Batch):
        model = nnx.merge(graph, _compute_params(params, compute_dtype))
        sums = masked_token_sums(model.features(batch.tokens), model.head.kernel[...],
                                 batch.targets, batch.mask, loss_block_tokens)
        total = jax.lax.psum(jnp.concatenate([sums, jnp.sum(batch.mask)[None]]), AXES)
        return total[0] / total[2], total[1] / total[2]

    spec = P(*AXES)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), Batch(spec, spec, spec)),
                         out_specs=(P(), P()), check_vma=check_vma)


def make_train_step(graph, mesh: Mesh, tx: optax.GradientTransformation,
                    compute_dtype=jnp.float32, check_vma: bool = True,
                    loss_block_tokens: int = LOSS_BLOCK_TOKENS) -> Callable:
    """step(params, opt_state, batch) -> (params, opt_state, loss, accuracy), jitted."""
    loss = make_loss(graph, mesh, compute_dtype, check_vma, loss_block_tokens)

    @jax.jit
    def step(params, opt_state, batch):
        (value, acc), grads = jax.value_and_grad(loss, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, acc

    return step


def shard_batch(batch: Batch, mesh: Mesh, cp_layout: str = "contiguous") -> Batch:
    """Place a batch, the same on every process, with its batch axis over "data" and its
    sequence over "seq" in cp_layout (``jaxcp.cp.split``: the tokens permuted here, once,
    on the host; the loss sums over tokens in any order); each process transfers only the
    shards its devices hold."""
    world = mesh.shape["seq"]
    laid = Batch(*(to_layout(np.asarray(x), cp_layout, world) for x in batch))
    return global_batch(laid, mesh, P(*AXES))


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, NamedSharding(mesh, P()))
