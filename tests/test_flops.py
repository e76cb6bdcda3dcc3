"""Model FLOPs per token and MFU, counted by hand for a small hybrid."""
import chex
import jax
import pytest
from flax import nnx

from jaxcp.models import LM
from jaxcp.train.flops import delta_rule_flops, mfu, peak_flops, token_flops


def test_token_flops_of_a_hybrid_by_hand():
    """hidden 32, vocab 64, 2 heads of 16: a GDN block (values 32 wide), an attention block,
    MLPs of 128, an untied head."""
    D, V, H, K, I, T = 32, 64, 2, 16, 128, 1000
    model = nnx.eval_shape(lambda: LM(V, D, "gdn,attn", H, K, I, rngs=nnx.Rngs(0)))
    flops = token_flops(model, T)
    gdn = (D * H * K * 2 + D * H * 2 * K * 2 + D * H * 2                # q, k, v, g, b, a
           + H * 2 * K * D)                                            # o
    attn = 4 * D * H * K
    mlp = 3 * D * I
    want_matmul = 2 * (gdn + attn + 2 * mlp + D * V)
    chex.assert_trees_all_close(
        (flops.matmul, flops.attention, flops.delta_rule),
        (float(want_matmul), 2.0 * T * H * K, H * delta_rule_flops(64, K, 2 * K)))
    assert flops.step == 3 * (flops.matmul + flops.attention + flops.delta_rule)
    C = 64
    assert delta_rule_flops(C, 16, 32) == 6 * C * 16 + 4 * C * 32 + 2 * C * C / 3 + 6 * 16 * 32


def test_mfu_and_peaks():
    assert mfu(1e9, 1e5, 1e15) == pytest.approx(0.1)
    assert mfu(1e9, None, 1e15) is None and mfu(1e9, 1e5, None) is None
    assert peak_flops(jax.devices()[0]) is None            # the CPU has no listed peak
