"""One process of the two-process CP check (tests/test_multiprocess.py): GDN and KDA with the
sequence axis over 8 CPU devices of 2 processes, packed sequences crossing the process
boundary, forward and gradients against the single-device op on this process.

    python tests/multiprocess_ops.py HOST:PORT NUM_PROCESSES PROCESS_ID

Prints one line per op with the largest relative error over o, the final states and every
gradient; exits 1 if one is over 1e-5.
"""
import sys

from jaxcp.train.cluster import Cluster, global_batch, start, stop


def main(coordinator: str, num_processes: int, process_id: int) -> int:
    cluster = Cluster(coordinator, num_processes, process_id, timeout_s=60)
    start(cluster, devices_per_process=8 // num_processes)
    import numpy as np
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, PartitionSpec as P

    import jaxcp
    from jaxcp.metrics import rel_error

    mesh = Mesh(np.array(jax.devices()), ("seq",))
    T, H, D = 256, 2, 16
    cu = np.asarray([0, 50, 200, 256], np.int32)      # 50 .. 200 crosses token 128, process 1
    rng = np.random.default_rng(0)
    worst = 0.0
    for kind, op in (("gdn", jaxcp.chunk_gated_delta_rule), ("kda", jaxcp.chunk_kda)):
        r = lambda *s: rng.standard_normal(s).astype(np.float32)
        g_shape = (1, T, H) if kind == "gdn" else (1, T, H, D)
        xs = (r(1, T, H, D), r(1, T, H, D), r(1, T, H, D),
              np.log(1 / (1 + np.exp(-r(*g_shape) - 2))), 1 / (1 + np.exp(-r(1, T, H))))
        h0 = r(3, H, D, D) * 0.1
        wo, wf = r(1, T, H, D), r(3, H, D, D)

        def loss(q, k, v, g, beta, h0, wo, cp):
            o, final = op(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                          cu_seqlens=jnp.asarray(cu), use_qk_l2norm_in_kernel=True,
                          cp_axis="seq" if cp else None, backend="xla")
            local = jnp.sum(o * wo)
            return (jax.lax.psum(local, "seq") if cp else local) + jnp.sum(final * wf), o

        grad = lambda cp: jax.value_and_grad(
            lambda *a: loss(*a, cp=cp), argnums=tuple(range(6)), has_aux=True)
        sharded = jax.shard_map(grad(True), mesh=mesh, in_specs=(P(None, "seq"),) * 5 + (P(),)
                                + (P(None, "seq"),),
                                out_specs=((P(), P(None, "seq")), (P(None, "seq"),) * 5 + (P(),)))
        spec_tokens = P(None, "seq")
        args = global_batch(tuple(xs), mesh, spec_tokens) + (
            global_batch(h0, mesh, P()), global_batch(wo, mesh, spec_tokens))
        (_, o), grads = jax.jit(sharded)(*args)
        got = [multihost_utils.process_allgather(x, tiled=True) for x in (o, *grads)]
        local = jax.jit(grad(False))
        (_, o_ref), grads_ref = local(*(jnp.asarray(x) for x in (*xs, h0, wo)))
        errors = [rel_error(a, b) for a, b in zip(got, (o_ref, *grads_ref))]
        worst = max(worst, *errors)
        print(f"{kind} process {process_id}: max rel error {max(errors):.2e}", flush=True)
    stop(cluster)
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
