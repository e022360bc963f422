"""Beta-Bernoulli reuse model with lazy exponential forgetting.

Time is cut into epochs of ``epoch_s`` seconds. A block is accessed in an
epoch with unknown probability theta ~ Beta(alpha, beta). An access is a
success (alpha += 1); every idle epoch is a failure discounted by lambda.
After k idle epochs, in closed form (no per-epoch pass over blocks)::

    alpha' = lambda^k alpha
    beta'  = lambda^k beta + (1 - lambda^k) / (1 - lambda)

and P(at least one access in the next H epochs) = 1 - B(alpha, beta+H)/B(alpha, beta).
Every function is vectorised over numpy arrays of block ids.
"""

from __future__ import annotations

import numpy as np
from scipy.special import betaln


def forget(alpha: np.ndarray, beta: np.ndarray, k: np.ndarray, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """State after ``k`` (possibly fractional) idle epochs."""
    k = np.maximum(np.asarray(k, dtype=np.float64), 0.0)
    decay = np.power(lam, k)
    return alpha * decay, beta * decay + (1.0 - decay) / (1.0 - lam)


def p_reuse_within(alpha: np.ndarray, beta: np.ndarray, horizon: "float | np.ndarray") -> np.ndarray:
    """P(at least one access within ``horizon`` epochs) = 1 - B(a, b+H)/B(a, b)."""
    a = np.maximum(np.asarray(alpha, dtype=np.float64), 1e-12)
    b = np.maximum(np.asarray(beta, dtype=np.float64), 1e-12)
    return -np.expm1(betaln(a, b + horizon) - betaln(a, b))


def survival(alpha: np.ndarray, beta: np.ndarray, k: np.ndarray) -> np.ndarray:
    """P(no access in the first k epochs) for the Beta-geometric gap."""
    return np.exp(betaln(alpha, beta + k) - betaln(alpha, beta))


def expected_epochs_to_reuse(alpha: np.ndarray, beta: np.ndarray, cap: float = 1e6) -> np.ndarray:
    """E[epochs until the next access] = (alpha + beta - 1) / (alpha - 1) for
    alpha > 1 (Beta-geometric mean); heavier tails are capped at ``cap``.
    Used to order prefetches: sooner expected reuse first."""
    a = np.asarray(alpha, dtype=np.float64)
    b = np.asarray(beta, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        m = np.where(a > 1.0, (a + b - 1.0) / (a - 1.0), cap)
    return np.minimum(m, cap)


class BetaReuseModel:
    """Per-block (alpha, beta, last-access epoch) over shared arrays.

    The arrays may be the block table's own columns, so the daemon and the
    replay simulator share one representation.
    """

    def __init__(self, alpha: np.ndarray, beta: np.ndarray, last_epoch: np.ndarray,
                 epoch_s: float = 1.0, forgetting: float = 0.999) -> None:
        if not 0.0 < forgetting < 1.0:
            raise ValueError("forgetting must be in (0, 1)")
        if epoch_s <= 0:
            raise ValueError("epoch_s must be > 0")
        self.alpha, self.beta, self.last_epoch = alpha, beta, last_epoch
        self.epoch_s = float(epoch_s)
        self.lam = float(forgetting)

    def epoch(self, now_s: float) -> float:
        return now_s / self.epoch_s

    def init(self, blocks: "int | np.ndarray", alpha0: "float | np.ndarray", beta0: "float | np.ndarray",
             now_s: float) -> None:
        """Start blocks from their class prior."""
        self.alpha[blocks] = alpha0
        self.beta[blocks] = beta0
        self.last_epoch[blocks] = self.epoch(now_s)

    def state_at(self, blocks: "int | np.ndarray", now_s: float) -> tuple[np.ndarray, np.ndarray]:
        k = self.epoch(now_s) - self.last_epoch[blocks]
        return forget(self.alpha[blocks], self.beta[blocks], k, self.lam)

    def observe_access(self, blocks: "int | np.ndarray", now_s: float) -> None:
        """Lazy forgetting up to now, then one success."""
        a, b = self.state_at(blocks, now_s)
        self.alpha[blocks] = a + 1.0
        self.beta[blocks] = b
        self.last_epoch[blocks] = self.epoch(now_s)

    def p_reuse(self, blocks: "int | np.ndarray", now_s: float, horizon_epochs: float) -> np.ndarray:
        a, b = self.state_at(blocks, now_s)
        return p_reuse_within(a, b, horizon_epochs)

    def expected_time_to_reuse_s(self, blocks: "int | np.ndarray", now_s: float) -> np.ndarray:
        a, b = self.state_at(blocks, now_s)
        return expected_epochs_to_reuse(a, b) * self.epoch_s
