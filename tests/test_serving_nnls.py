"""k3lab.serving.nnls, the step model's non-negative least squares in numpy (no scipy): the optimum
against every support's least squares on fresh random problems, the fit of the committed H200 step
records with scipy unimportable, and bad input refused."""

import itertools
import subprocess
import sys

import numpy as np
import pytest

from k3lab.serving.nnls import nnls


def _brute_force(A, b):
    """The smallest residual of any support's unconstrained least squares that stays >= 0 (the NNLS
    optimum is one of them)."""
    n = A.shape[1]
    best = np.linalg.norm(b)  # x = 0
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            z = np.linalg.lstsq(A[:, cols], b, rcond=None)[0]
            if (z >= 0).all():
                best = min(best, np.linalg.norm(A[:, cols] @ z - b))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_nnls_reaches_the_optimum_on_random_problems(seed):
    rng = np.random.default_rng(seed)
    for _ in range(150):
        m, n = int(rng.integers(1, 10)), int(rng.integers(1, 6))
        A = rng.standard_normal((m, n)) * 10.0 ** rng.uniform(-3, 3, size=n)  # badly scaled columns too
        b = rng.standard_normal(m) * 10.0 ** rng.uniform(-2, 2)
        x, r = nnls(A, b)
        assert (x >= 0).all() and r == pytest.approx(np.linalg.norm(A @ x - b))
        assert r <= _brute_force(A, b) + 1e-9 * np.linalg.norm(b)


def test_nnls_matches_scipy_where_scipy_is_installed():
    scipy_nnls = pytest.importorskip("scipy.optimize", reason="scipy is optional here (a cross-check)").nnls
    rng = np.random.default_rng(7)
    for _ in range(300):
        A = rng.standard_normal((12, 5)) * 10.0 ** rng.uniform(-2, 2, size=5)
        b = rng.standard_normal(12)
        x, r = nnls(A, b)
        xs, rs = scipy_nnls(A, b)
        assert r == pytest.approx(rs, rel=1e-9, abs=1e-12)
        np.testing.assert_allclose(x, xs, rtol=1e-6, atol=1e-9 * np.abs(xs).max(initial=1.0))


def test_the_step_model_fits_the_committed_records_without_scipy():
    # notebook 09 and `k3lab bench serving` where scipy was never installed: every import of it fails
    code = ("import sys, importlib.abc\n"
            "class NoScipy(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] == 'scipy':\n"
            "            raise ModuleNotFoundError('No module named scipy (blocked)')\n"
            "sys.meta_path.insert(0, NoScipy())\n"
            "from k3lab.serving import inputs\n"
            "fits = inputs.fits(inputs.step_points())\n"
            "assert fits and 'scipy' not in sys.modules\n"
            "print(len(fits), round(fits['base'].coef['fixed'], 6))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    count, fixed = done.stdout.split()
    assert int(count) >= 2 and float(fixed) > 0


def test_nnls_refuses_bad_input():
    with pytest.raises(ValueError, match="A must be"):
        nnls(np.ones((3, 2)), np.ones(4))
    with pytest.raises(ValueError, match="finite"):
        nnls(np.array([[1.0, np.nan]]), np.ones(1))
