"""Engine pieces that bound their temporaries by splitting work: the token-chunked dense FFN
gives the same values as the whole-sequence one (a row-wise function; f32 association per
row unchanged, so equal up to XLA's fusion of the same ops: 1e-6 relative)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from hmoe_jax.model.layers import swiglu
from hmoe_jax.model.params import FFNParams
from hmoe_jax.runtime import pieces


def test_chunked_tokens_equals_whole():
    rng = np.random.default_rng(0)
    p = FFNParams(
        *(jnp.asarray(rng.normal(size=s).astype(np.float32) / 8) for s in [(64, 32), (64, 32), (32, 64)])
    )
    for t in (5, 8, 37):  # shorter than, equal to and not a multiple of the chunk
        x = jnp.asarray(rng.normal(size=(1, t, 32)).astype(np.float32))
        got = np.asarray(pieces.chunked_tokens(lambda xc: swiglu(p, xc), x, chunk=8))
        ref = np.asarray(swiglu(p, x))
        assert got.shape == ref.shape
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
