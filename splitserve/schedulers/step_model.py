"""Online, outlier-proof model of an engine step's duration.

Pure Python (no engine import, no numpy): runs inside whatever process calls the scheduler (for
vLLM the EngineCore process), once per step, on a 4-dimensional problem, so plain lists beat any
array library here.

The model is linear in four features of the batch a step executes::

    step_ms = b0 + b1 * tokens/1e3 + b2 * sequences/1e2 + b3 * attention_pairs/1e6

``tokens`` counts every token the step computes (one per decode plus the prefill chunk tokens),
``sequences`` the requests in the batch, ``attention_pairs`` the sum over computed tokens of the
context each one attends to (a decode at context ``c`` adds ``c + 1``; a chunk of ``n`` tokens after
``c`` computed ones adds ``n * c + n * (n + 1) / 2``). Scaling keeps every coefficient in
milliseconds per "natural" unit, so the fit is well conditioned.

Step-time noise is mostly relative (a 10 ms step jitters by a millisecond, a 1 s step by tens),
so the fit minimises *relative* errors: each sample is weighted by ``1 / measured`` (weighted
recursive least squares with fixed weights; a slow outlier weighs little by construction), and
the scale, the outlier test and the safety margin are fractions of the step.

Fitting is recursive least squares with a forgetting factor, started from a prior (the safe
default: a Bayesian ridge toward prior coefficients) and made robust three ways:

- the residual scale is ``1.4826 * median(|relative residual|)`` over a short window of recent
  accepted a-priori residuals;
- a residual beyond ``outlier_sigmas`` scales is rejected (no update at all, not even of the
  scale): a GC pause or a cold first step leaves the model untouched; after
  ``max_consecutive_outliers`` rejections in a row the model treats them as a regime change (the
  machine got slower or faster): it reopens its covariance to the prior's, counts the run in its
  scale, and learns from it unclipped, so it cannot lock itself out of the truth;
- accepted residuals are Huber-clipped at ``huber_sigmas`` scales.

Invariants: the fit itself is unconstrained (projecting RLS estimates breaks the recursion), but
predictions use the coefficients clamped at zero: every feature is non-negative, so clamping only
raises a prediction (the safe side), and a prediction never decreases when the batch grows. The
covariance trace is capped (no wind-up while the batch mix does not vary).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

_MAD_TO_SIGMA = 1.4826
# Floor of the measured step used as a weight, so a (bogus) near-zero duration cannot blow up
# one sample's weight.
_MIN_STEP_MS = 0.05
FEATURE_NAMES = ("intercept_ms", "ms_per_1k_tokens", "ms_per_100_sequences", "ms_per_1m_pairs")


class StepModelPrior(BaseModel):
    """The safe default the model starts from (milliseconds), and how much to trust it.

    The defaults describe a slow machine (a small model on a CPU): they over-predict on a GPU, so
    the first budgets are small rather than too large, and the fit corrects them in a few steps.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    intercept_ms: float = Field(20.0, gt=0, description="fixed cost of one step")
    ms_per_1k_tokens: float = Field(200.0, gt=0, description="cost of 1000 computed tokens")
    ms_per_100_sequences: float = Field(10.0, gt=0, description="cost of 100 requests in a batch")
    ms_per_1m_pairs: float = Field(20.0, gt=0, description="cost of 1e6 attention token pairs")
    relative_noise: float = Field(
        0.1, gt=0, lt=1, description="expected step-to-step noise, as a fraction of the step"
    )
    relative_std: float = Field(
        2.0, gt=0, description="prior standard deviation of each coefficient, relative to it"
    )

    def coefficients(self) -> list[float]:
        return [
            self.intercept_ms,
            self.ms_per_1k_tokens,
            self.ms_per_100_sequences,
            self.ms_per_1m_pairs,
        ]


class StepModelSettings(BaseModel):
    """How the online fit learns and what it treats as an outlier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prior: StepModelPrior = Field(default_factory=StepModelPrior)
    forgetting_factor: float = Field(
        0.995, gt=0.9, le=1.0, description="RLS forgetting; 0.995 remembers about 200 steps"
    )
    residual_window: int = Field(32, ge=3, le=4096, description="steps in the residual-scale MAD")
    outlier_sigmas: float = Field(4.0, gt=1.0, description="reject residuals beyond this")
    huber_sigmas: float = Field(2.0, gt=0.0, description="clip accepted residuals at this")
    max_consecutive_outliers: int = Field(
        3, ge=1, description="this many rejections in a row are a regime change: learn from them"
    )


@dataclass(frozen=True)
class StepFeatures:
    """What a step computes (or would compute)."""

    tokens: int
    sequences: int
    attention_pairs: int

    def vector(self) -> list[float]:
        return [1.0, self.tokens / 1e3, self.sequences / 1e2, self.attention_pairs / 1e6]


def chunk_attention_pairs(computed_tokens: int, new_tokens: int) -> int:
    """Attention pairs of ``new_tokens`` computed after ``computed_tokens`` (causal)."""
    return new_tokens * computed_tokens + new_tokens * (new_tokens + 1) // 2


@dataclass(frozen=True)
class Observation:
    """The outcome of learning from one measured step."""

    predicted_s: float
    measured_s: float
    accepted: bool

    @property
    def error_s(self) -> float:
        """Measured minus predicted (positive: the step was slower than predicted)."""
        return self.measured_s - self.predicted_s


class RobustStepModel:
    """Recursive least squares over :class:`StepFeatures`, robust to outliers (see module doc)."""

    def __init__(self, settings: StepModelSettings | None = None) -> None:
        self.settings = settings or StepModelSettings()
        prior = self.settings.prior
        self._theta = prior.coefficients()
        self._clamped = list(self._theta)
        noise_var = prior.relative_noise**2
        n = len(self._theta)
        self._p0_diag = [(prior.relative_std * t) ** 2 / noise_var for t in self._theta]
        self._p = [[self._p0_diag[i] if i == j else 0.0 for j in range(n)] for i in range(n)]
        self._p_trace_cap = 10.0 * sum(self._p0_diag)
        self._residuals: deque[float] = deque(maxlen=self.settings.residual_window)
        self._consecutive_outliers = 0
        self.samples_seen = 0
        self.samples_rejected = 0

    @property
    def coefficients(self) -> dict[str, float]:
        """The coefficients predictions use (the fit's, clamped at zero)."""
        return dict(zip(FEATURE_NAMES, self._clamped, strict=True))

    @property
    def relative_scale(self) -> float:
        """Robust scale of recent relative prediction errors: 1.4826 * median |residual|.

        The prior noise until a few residuals are known; never below a twentieth of it, so a
        perfectly quiet window cannot make the outlier test reject ordinary jitter.
        """
        prior = self.settings.prior.relative_noise
        if len(self._residuals) < 3:
            return prior
        return max(_MAD_TO_SIGMA * statistics.median(self._residuals), 0.05 * prior)

    def predict_s(self, features: StepFeatures) -> float:
        b0, b1, b2, b3 = self._clamped
        return (
            b0
            + b1 * features.tokens / 1e3
            + b2 * features.sequences / 1e2
            + b3 * features.attention_pairs / 1e6
        ) / 1e3

    def observe(self, features: StepFeatures, measured_s: float) -> Observation:
        """Learn from one executed step; returns the a-priori prediction and its fate."""
        x = features.vector()
        predicted_s = self.predict_s(features)
        fitted_ms = sum(t * v for t, v in zip(self._theta, x, strict=True))
        measured_ms = measured_s * 1e3
        weight = 1.0 / max(measured_ms, _MIN_STEP_MS)
        relative_residual = (measured_ms - fitted_ms) * weight
        scale = self.relative_scale
        self.samples_seen += 1

        if abs(relative_residual) > self.settings.outlier_sigmas * scale:
            self._consecutive_outliers += 1
            if self._consecutive_outliers < self.settings.max_consecutive_outliers:
                self.samples_rejected += 1
                return Observation(predicted_s, measured_s, accepted=False)
            # A run of outliers is a regime change: reopen the covariance to the prior's (RLS
            # covariance resetting) and learn from it at full strength.
            for i, p0 in enumerate(self._p0_diag):
                self._p[i][i] += p0
            effective = relative_residual
            self._residuals.extend([abs(relative_residual)] * self._consecutive_outliers)
        else:
            self._consecutive_outliers = 0
            limit = self.settings.huber_sigmas * scale
            effective = max(-limit, min(limit, relative_residual))
            self._residuals.append(abs(relative_residual))

        self._rls_update([v * weight for v in x], effective)
        return Observation(predicted_s, measured_s, accepted=True)

    def _rls_update(self, x: list[float], residual: float) -> None:
        lam = self.settings.forgetting_factor
        n = len(x)
        p = self._p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        self._theta = [t + g * residual for t, g in zip(self._theta, gain, strict=True)]
        self._clamped = [max(0.0, t) for t in self._theta]
        # P <- (P - K x^T P) / lam ; x^T P == px^T because P is symmetric.
        new_p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        trace = sum(new_p[i][i] for i in range(n))
        if trace > self._p_trace_cap:
            shrink = self._p_trace_cap / trace
            new_p = [[v * shrink for v in row] for row in new_p]
        self._p = new_p
