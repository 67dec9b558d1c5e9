"""Data-parallel Algorithm 1 (``lda_svi.fit(mesh=...)``) on 8 simulated CPU devices equals the
one-device fit: the minibatch statistics are a sum over documents, so sharding the documents
and summing over devices (``psum``) changes only the order of floating-point additions.

JAX fixes its device count when it is first imported, so the 8-device fits run in a fresh
Python with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from numpyro_tempering.models import lda_svi

SCRIPT = textwrap.dedent(
    """
    import json, os
    flags = os.environ.get("XLA_FLAGS", "")  # the fixture's: the session's, and 8 devices
    if "--xla_force_host_platform_device_count=8" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8"
    import jax
    jax.config.update("jax_enable_x64", True)
    import numpy as np
    from numpyro_tempering import Ladder
    from numpyro_tempering.models import corpora, lda_svi

    assert jax.device_count() == 8
    corpus, _ = corpora.synthetic(0, 120, 30, 3, 40)
    # 50 documents per minibatch: 7 per device (6 padding documents), a short last batch of 20
    kw = dict(passes=1.5, batch_size=50, tau=10.0, seed=1, row_width=8)
    ladder = Ladder.geometric(1.0, 10.0, 5)
    out = {}
    # MVI with the normaliser following the topics: the multicanonical step, and the refresh
    # rule reading the words per rung, a log-sum-exp over the devices (a fixed log C is the
    # same step with the table as data)
    mvi = lda_svi.Multicanonical(ladder.temperatures, ladder.log_prior, refresh=0.0)
    for name, temperature, dtype in (("svi64", 1.0, "float64"), ("avi32", 3.0, "float32"),
                                     ("mvi64", mvi, "float64")):
        one = lda_svi.fit(corpus, 3, temperature=temperature, dtype=dtype, **kw)
        eight = lda_svi.fit(corpus, 3, temperature=temperature, dtype=dtype, mesh=8, **kw)
        out[name] = {
            "rel": float(np.max(np.abs(one.lam - eight.lam) / np.abs(one.lam))),
            "moved": float(np.max(np.abs(one.lam - lda_svi.init_state(
                np.random.default_rng(1), 3, 40).lam) / one.lam)),
            "steps": [one.num_steps, eight.num_steps],
            "temps": [one.temperatures.tolist(), eight.temperatures.tolist()],
            "dtype": str(eight.lam.dtype),
            "devices": len(eight.state.lam.sharding.device_set),
            "rungs": [one.log_c_rungs, eight.log_c_rungs],
        }
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def mesh_run():
    # the test session's XLA flags (conftest.py: optimisation level 0, a faster compile)
    # plus the device count: both fits of a pair are compiled alike, so the comparison
    # means the same
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name, rtol", [("svi64", 1e-10), ("mvi64", 1e-10), ("avi32", 1e-4)])
def test_eight_devices_equal_one(mesh_run, name, rtol):
    """lambda after 4 updates (a minibatch of 50 split 7 per device with padding, a short last
    batch; with the normaliser following the topics, the same rung tables recomputed):
    float64 to 1e-10 relative; float32 to 1e-4 (summation order: 4 steps of sums of ~50
    terms, each rounded at ~6e-8 relative, amplified mildly by the digamma feedback)."""
    run = mesh_run[name]
    assert run["devices"] == 8
    assert run["steps"] == [4, 4]
    assert run["dtype"] == ("float32" if name == "avi32" else "float64")
    assert run["moved"] > 1e-2  # the fits really moved lambda away from its initialisation
    assert run["rel"] < rtol
    np.testing.assert_allclose(run["temps"][0], run["temps"][1], rtol=max(rtol, 1e-12))
    assert run["rungs"][0] == run["rungs"][1]  # the same rung tables recomputed


def test_as_mesh_validates():
    assert lda_svi.as_mesh(None) is None
    assert lda_svi.as_mesh(jax.devices()[:1]).shape["data"] == 1
    with pytest.raises(ValueError, match="devices"):
        lda_svi.as_mesh(len(jax.devices()) + 1)
    with pytest.raises(TypeError, match="mesh"):
        lda_svi.as_mesh(2.5)
    with pytest.raises(ValueError, match="'data' axis"):
        lda_svi.as_mesh(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("batch",)))
