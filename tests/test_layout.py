"""The chunk layout's per-chunk fields."""
import chex
import jax
import jax.numpy as jnp
import pytest

from jaxcp.layout import build_layout, chunks_by_table, num_chunks, to_chunks


@pytest.mark.parametrize("cu", [None, [0, 3, 100]])
def test_per_chunk_fields_are_chunks_by_batch(cu):
    # the Pallas state kernels read column b of these fields; on a GPU nothing clamps a
    # read past a [NT, 1] array, so every row needs its own column
    B = 3 if cu is None else 1
    n_seqs = None if cu is None else len(cu) - 1
    layout, _ = build_layout(B, 100, 16, None if cu is None else jnp.asarray(cu), 0, 100)
    NT = num_chunks(100, 16, n_seqs)
    for name in ("chunk_seq", "chunk_starts", "chunk_ends"):
        assert getattr(layout, name).shape == (NT, B), name


def test_chunk_gathers_transpose_to_gathers():
    """to_chunks / from_chunks with packed sequences: their VJPs (gathers, not the scatter-adds
    autodiff would build) equal the transposes of the plain gathers."""
    import jax
    import numpy as np

    from jaxcp.layout import _slots_from_tokens, _tokens_from_slots, from_chunks, to_chunks

    cu = jnp.asarray([0, 1, 20, 37, 70], jnp.int32)
    _, tm = build_layout(1, 70, 16, cu, 0, 70)
    NT = num_chunks(70, 16, 4)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 70, 2, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((NT, 1, 2, 16, 3)), jnp.float32)
    ct_y = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
    ct_x = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    got = jax.vjp(lambda a: to_chunks(a, tm, NT, 16), x)[1](ct_y)[0]
    plain = lambda a: jnp.moveaxis(_slots_from_tokens(a, tm).reshape(1, NT, 16, 2, 3),
                                   (1, 3), (0, 2))
    want = jax.vjp(plain, x)[1](ct_y)[0]
    np.testing.assert_array_equal(got, want)

    got = jax.vjp(lambda b: from_chunks(b, tm, 70), y)[1](ct_x)[0]
    plain = lambda b: _tokens_from_slots(
        jnp.moveaxis(b, (0, 2), (1, 3)).reshape(1, NT * 16, 2, 3), tm)
    want = jax.vjp(plain, y)[1](ct_x)[0]
    np.testing.assert_array_equal(got, want)
    assert "scatter" not in str(jax.make_jaxpr(jax.grad(
        lambda a: jnp.sum(from_chunks(to_chunks(a, tm, NT, 16), tm, 70) ** 2)))(x))


@pytest.mark.parametrize("device, cu", [(0, None), (1, [0, 1, 20, 37, 70, 90, 100, 140]),
                                        (0, [0, 1, 20, 37, 70, 90, 100, 140])])
def test_token_table_places_every_token_once(device, cu):
    """The token table the in-place kernels read: chunk c holds the local tokens
    [token_start, token_start + token_count), in order, of one sequence each, the same
    tokens as the padded chunk layout's slots; unused chunks hold none. Without cu_seqlens
    and T % C != 0 the last chunk is short; T % C == 0 needs no table."""
    import numpy as np

    T, C = 70, 16
    cua = None if cu is None else jnp.asarray(cu, jnp.int32)
    layout, tm = build_layout(1, T, C, cua, device * T, 2 * T)
    start = np.asarray(layout.token_start[:, 0])
    count = np.asarray(layout.token_count[:, 0])
    tokens = np.concatenate([np.arange(s, s + n) for s, n in zip(start, count)])
    np.testing.assert_array_equal(tokens, np.arange(T))
    assert count.min() >= 0 and count.max() <= C
    if cu is not None:
        slots = np.asarray(tm.slot_token).reshape(-1, C)
        for c in range(len(start)):
            mine = np.arange(start[c], start[c] + count[c])
            np.testing.assert_array_equal(slots[c, :count[c]], mine)
            assert (slots[c, count[c]:] == -1).all()
            owner = np.searchsorted(np.asarray(cu)[1:], device * T + mine, side="right")
            assert len(set(owner)) <= 1
    assert build_layout(2, 64, C, None, 0, 64)[0].token_start is None


def test_chunks_by_table_reads_what_to_chunks_gathers():
    """The chunks of packed sequences (a 1-token one among them) from the layout's token
    table alone equal ``to_chunks`` by the token map, zero past each chunk's tokens."""
    T = 150
    layout, token_map = build_layout(1, T, 64, jnp.array([0, 1, 70, T], jnp.int32), 0, T)
    x = jax.random.normal(jax.random.key(0), (1, T, 2, 3))
    NT = layout.chunk_starts.shape[0]
    got = chunks_by_table(x, layout, 64)
    chex.assert_shape(got, (NT, 1, 2, 64, 3))
    chex.assert_trees_all_equal(got, to_chunks(x, token_map, NT, 64))
