import harness
import numpy as np
import pytest

import meshdsl as md


@pytest.mark.parametrize("layout", ["vocab:model; d_ff:data", "vocab:model", "d_ff:(data, model)"])
@pytest.mark.parametrize("three", [True, False])
def test_scan_einsum_explain(layout, three):
    rng = np.random.default_rng(0)
    xs = harness.rand(rng, {"n": 3, "d_model": 4})
    w = harness.rand(rng, {"vocab": 8, "d_model": 4})
    v = harness.rand(rng, {"d_ff": 8})

    def fn(xs, w, v):
        def body(c, x):
            u = c + x * 0.5
            e = md.einsum(u, w, v, out=["d_model"]) if three else md.einsum(u, w, out=["d_model"])
            return md.tanh(e), e

        return md.scan(body, md.zeros([md.Dim("d_model", 4)]), xs, "n")

    harness.assert_explain_matches_hlo(fn, harness.mesh("data2_model4"), layout, [xs, w, v])
