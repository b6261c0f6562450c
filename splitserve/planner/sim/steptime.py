"""Step times for the simulator: the planner's roofline, reduced once to a few coefficients.

Runs in the simulating process. ``roofline.step_cost`` rebuilds the model's mean layer on every
call (tens of microseconds); a simulation asks for a step time millions of times, so
:class:`StepTimer` asks the planner's own functions (``mean_layer``, ``attention_flops``, the KV
bytes of ``kv``) for the per-token, per-pair and per-byte figures once, and evaluates the same
formula as a handful of multiplications:

- FLOPs = ``L (2 A T + a P) + 2 H V S``: ``T`` tokens computed, ``P`` causal attention pairs,
  ``S`` tokens sampled (LM head), ``A`` active weights per token of the mean layer;
- bytes = ``L (b_w W(T) + b_a X T + k (R + T)) + b_w H V``: weights touched by ``T`` tokens
  (all of them for a dense model; routed experts by probability for MoE), input activations,
  KV read (``R`` context tokens) and written;
- time = ``max(FLOPs / F, bytes / B) + overhead``.

It equals ``roofline.step_cost`` wherever ``step_cost`` can describe the batch
(tests/unit/test_sim_steptime.py checks it); it also prices batches ``step_cost`` cannot (several
prompts at different contexts beside decodes at different contexts). The accelerator is the
catalog's (peak, scaled by ``efficiency``) or a calibration file's (achieved figures).

:class:`MeasuredStepTimer` replaces the roofline by a step model measured on the served engine
(a calibration file's ``step_model``): the budget policy's own linear form in tokens,
sequences and attention pairs.
"""

from __future__ import annotations

from splitserve.planner.calibration_file import EngineStepModel
from splitserve.planner.catalog import Accelerator, ModelShape, PlannerInputError
from splitserve.planner.kv import kv_bytes_per_token_per_layer
from splitserve.planner.roofline import BF16_BYTES, attention_flops, make_replica, mean_layer


class StepTimer:
    """Roofline time of one engine step on one replica (see module docstring)."""

    __slots__ = (
        "_f",
        "_b",
        "_flops_per_token",
        "_flops_per_pair",
        "_flops_per_sample",
        "_bytes_per_token",
        "_bytes_per_kv_read",
        "_dense_weight_bytes",
        "_head_bytes",
        "_moe",
        "_moe_cache",
        "_weight_elem_bytes",
        "overhead_s",
        "kv_bytes_per_token",
        "kv_bytes_per_token_per_layer",
        "num_layers",
        "mem_bytes",
    )

    def __init__(
        self,
        model: ModelShape,
        acc: Accelerator,
        *,
        gpus: int = 1,
        efficiency: float = 1.0,
        kv_dtype: str = "bf16",
        weight_bytes: int = BF16_BYTES,
        act_bytes: int = BF16_BYTES,
        overhead_s: float = 0.0,
    ) -> None:
        replica = make_replica(acc, gpus, efficiency)
        layer = mean_layer(model)
        n = model.num_layers
        kv = kv_bytes_per_token_per_layer(model, kv_dtype)
        self._f = replica.flops
        self._b = replica.mem_bytes_per_s
        self._flops_per_token = n * 2.0 * layer.active_weight_elems
        self._flops_per_pair = n * attention_flops(model, 1, 0)  # one new token, no context
        self._flops_per_sample = 2.0 * model.hidden_size * model.vocab_size
        self._bytes_per_token = n * (act_bytes * layer.input_elems_per_token + kv)
        self._bytes_per_kv_read = float(n * kv)
        self._dense_weight_bytes = n * weight_bytes * layer.dense_weight_elems
        self._head_bytes = float(weight_bytes * model.hidden_size * model.vocab_size)
        self._moe = layer if model.is_moe else None
        self._moe_cache: dict[int, float] = {}
        self._weight_elem_bytes = weight_bytes
        self.overhead_s = overhead_s
        self.kv_bytes_per_token_per_layer = kv
        self.kv_bytes_per_token = kv * n
        self.num_layers = n
        self.mem_bytes = replica.mem_bytes
        if self._moe is not None:
            self._dense_weight_bytes = 0.0  # weight_elems_touched covers dense and experts

    def _weight_bytes(self, tokens: int) -> float:
        if self._moe is None:
            return self._dense_weight_bytes
        cached = self._moe_cache.get(tokens)
        if cached is None:
            touched = self._moe.weight_elems_touched(tokens)
            cached = self.num_layers * self._weight_elem_bytes * touched
            self._moe_cache[tokens] = cached
        return cached

    def seconds(
        self, tokens: int, pairs: float, kv_read: float, sampled: int, sequences: int = -1
    ) -> float:
        """One step computing ``tokens`` tokens with ``pairs`` attention pairs, reading
        ``kv_read`` cached tokens' KV, sampling ``sampled`` tokens, for ``sequences`` requests
        (the roofline does not use it; a measured step model does)."""
        if tokens <= 0:
            return self.overhead_s
        flops = (
            self._flops_per_token * tokens
            + self._flops_per_pair * pairs
            + self._flops_per_sample * sampled
        )
        nbytes = (
            self._weight_bytes(tokens)
            + self._bytes_per_token * tokens
            + self._bytes_per_kv_read * kv_read
            + self._head_bytes
        )
        t_c = flops / self._f
        t_m = nbytes / self._b
        return (t_c if t_c > t_m else t_m) + self.overhead_s


class MeasuredStepTimer(StepTimer):
    """A :class:`StepTimer` whose step times come from an :class:`EngineStepModel`.

    Memory (KV capacity, bytes per token) is still the accelerator's and the model's; only
    ``seconds`` changes. ``efficiency`` does not scale a measured step (it measured what the
    engine achieves), nor do the pool's GPUs per server (it measured one server as it was
    configured: give the pool that server's GPU count); ``overhead_s`` is still added, as a
    what-if on top of the measurement.
    """

    __slots__ = ("_coef",)

    def __init__(self, model: ModelShape, acc: Accelerator, step_model: EngineStepModel,
                 **kwargs: object) -> None:  # fmt: skip
        if step_model.model.lower() != model.name.lower():
            raise PlannerInputError(
                f"the calibration's step model was measured with {step_model.model}, not "
                f"{model.name}: measure this model (benchmarks/calibrate_engine.py) or drop "
                "its step_model"
            )
        super().__init__(model, acc, **kwargs)  # type: ignore[arg-type]
        self._coef = step_model.seconds_per_unit()

    def seconds(
        self, tokens: int, pairs: float, kv_read: float, sampled: int, sequences: int = -1
    ) -> float:
        if tokens <= 0:
            return self.overhead_s
        if sequences < 0:
            sequences = sampled
        c0, c_tok, c_seq, c_pair = self._coef
        return c0 + c_tok * tokens + c_seq * sequences + c_pair * pairs + self.overhead_s
