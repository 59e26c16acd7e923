"""Non-negative least squares with numpy alone: min ||A x - b|| subject to x >= 0.

The step model (`stepmodel.fit`) needs it for a handful of coefficients; numpy has no NNLS of its own,
and a dependency for one small solve is more than it is worth. This is the active-set method of Lawson
and Hanson (Solving Least Squares Problems, 1974, ch. 23): start with every coefficient held at zero;
repeatedly free the held coefficient whose gradient most wants it to grow, solve the unconstrained least
squares on the free ones, and where that solution turns a free coefficient negative, step back along the
segment to the first one that reaches zero and hold it again. It ends when no held coefficient wants to
grow (the Karush-Kuhn-Tucker conditions, to a tolerance scaled to A), and the answer is exact up to
rounding: the least-squares solution on the final free set.
"""

from __future__ import annotations

import numpy as np


def nnls(A, b, max_iter: int | None = None) -> tuple[np.ndarray, float]:
    """(x, ||A x - b||) with x >= 0 minimising the residual. A: (m, n) finite floats, b: (m,).
    max_iter: outer iterations before giving up (default 3 n; RuntimeError when reached).
    ValueError for shapes that do not match or values that are not finite."""
    A = np.asarray(A, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if A.ndim != 2 or b.ndim != 1 or A.shape[0] != b.shape[0]:
        raise ValueError(f"A must be (m, n) and b (m,), got A {A.shape} and b {b.shape}")
    if not (np.isfinite(A).all() and np.isfinite(b).all()):
        raise ValueError("A and b must hold finite numbers only")
    m, n = A.shape
    max_iter = 3 * n if max_iter is None else max_iter
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    blocked = np.zeros(n, dtype=bool)  # freed to no effect (rounding): not tried again until x moves
    eps = np.finfo(np.float64).eps
    # the gradient's rounding floor: A^T r is as large as |A| |b|, so is its noise
    tol = 10.0 * eps * max(m, n) * max(np.abs(A).sum(axis=0).max(initial=0.0), 1e-300) * max(np.abs(b).max(
        initial=0.0), 1e-300)

    def solve(mask: np.ndarray) -> np.ndarray:
        z = np.zeros(n)
        z[mask] = np.linalg.lstsq(A[:, mask], b, rcond=None)[0]
        return z

    for _ in range(max_iter):
        w = A.T @ (b - A @ x)  # minus the gradient: where it is positive, growing lowers the residual
        wants = ~free & ~blocked & (w > tol)
        if not wants.any():
            break
        j = int(np.argmax(np.where(wants, w, -np.inf)))
        free[j] = True
        z = solve(free)
        if z[j] <= 0:  # rounding: freeing j does not help after all
            free[j], blocked[j] = False, True
            continue
        while (z[free] <= 0).any():  # step back to the first free coefficient that reaches zero
            hits = np.flatnonzero(free & (z <= 0))
            ratios = x[hits] / (x[hits] - z[hits])
            k = hits[np.argmin(ratios)]
            x = x + ratios.min() * (z - x)
            x[k] = 0.0
            free &= x > 0
            x[~free] = 0.0
            z = solve(free)
        x = z
        blocked[:] = False
    else:
        raise RuntimeError(f"nnls did not converge in {max_iter} iterations")
    return x, float(np.linalg.norm(A @ x - b))
