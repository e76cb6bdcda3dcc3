"""The chunk layout's per-chunk fields."""
import jax.numpy as jnp
import pytest

from jaxcp.layout import build_layout, num_chunks


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
