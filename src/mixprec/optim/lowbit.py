"""Pure low-precision training without master weights: Kahan-compensated and stochastic-rounding updates.

Plain bf16 weights lose every update smaller than half a unit in the last place
(bf16 keeps 8 significant bits: adding 1e-4 to 1.0 does nothing). Two remedies
that keep the weights in bf16:

- :class:`KahanOptimizer` keeps a bf16 compensation buffer per weight holding what
  rounding dropped; weight + compensation represents the weight with ~16 significant
  bits, and the next update starts from it (Kahan summation).
- :class:`StochasticRoundingOptimizer` rounds each updated weight up or down at
  random with probabilities proportional to the distance, so updates survive in
  expectation.

Both wrap any torch optimizer: during ``step()`` each low-precision parameter is
expanded to fp32 (with its gradient and optimizer state), the inner optimizer runs
its usual fp32 math, and the result is stored back in low precision. Between steps
optimizer state is kept in ``state_dtype`` (bf16 by default, halving its memory).

>>> import torch
>>> from mixprec.optim import KahanOptimizer
>>> w = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
>>> opt = KahanOptimizer(torch.optim.SGD([w], lr=1.0))
>>> for _ in range(100):
...     w.grad = torch.full_like(w, -1e-4)
...     opt.step()
>>> round(float(w.detach().float().mean()), 2)  # plain bf16 SGD would stay at 1.0
1.01
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES, parse_dtype
from mixprec.optim.base import WrappedOptimizer

__all__ = ["KahanOptimizer", "LowPrecisionOptimizer", "StochasticRoundingOptimizer", "stochastic_round"]


def stochastic_round(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16, up or down at random: E[result] == x (for finite, in-range values).

    >>> import torch
    >>> x = torch.full((100000,), 1.0 + 2**-10)  # a quarter of the way between two bf16 values
    >>> y = stochastic_round(x, generator=torch.Generator().manual_seed(0)).float()
    >>> abs(float(y.mean()) - (1 + 2**-10)) < 1e-4
    True
    """
    if dtype != torch.bfloat16:
        raise ValueError(f"stochastic_round supports dtype=torch.bfloat16 only, got {dtype}")
    x = x.to(torch.float32)
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.view(torch.int32) + noise) & -65536  # keep the top 16 bits: exactly a bf16 value
    return bits.view(torch.float32).to(torch.bfloat16)


class LowPrecisionOptimizer(WrappedOptimizer):
    """Low-precision weights and state, fp32 arithmetic inside ``step()``, round-to-nearest store.

    The inner optimizer runs its usual math on fp32 expansions of the bf16/fp16
    parameters, gradients and state, so constants such as Adam's ``eps=1e-8`` (zero
    in fp16) and small second moments do not break it; results are rounded back.
    Updates smaller than half a unit in the last place are still lost: see
    :class:`KahanOptimizer` and :class:`StochasticRoundingOptimizer`.
    """

    _STATE_KEY = "mixprec_lowbit"

    def __init__(self, optimizer: torch.optim.Optimizer, *, state_dtype: torch.dtype | str | None = torch.bfloat16) -> None:
        super().__init__(optimizer)
        self.state_dtype = None if state_dtype is None else parse_dtype(state_dtype)

    def _low_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.params() if p.dtype in LOW_PRECISION_DTYPES]

    def _expand_into(self, param: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(param)

    def _store(self, param: torch.Tensor, value32: torch.Tensor, low: torch.Tensor) -> None:
        low.copy_(value32)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step: fp32 parameters as usual, then each low-precision one expanded.

        Low-precision parameters are stepped one at a time, expanded (with gradient and
        state) into fp32 scratch buffers reused from parameter to parameter, so the fp32
        working memory is that of the largest parameter, not of the whole model. The
        inner optimizer's math is per parameter either way, so results do not change;
        its step hooks run once per low-precision parameter.
        """
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step() does not take a closure; compute the loss before step()")
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        low = [[p for p in params if p.dtype in LOW_PRECISION_DTYPES] for params in saved]
        if not any(low):
            return self.optimizer.step()
        scratch: dict[tuple[int, torch.device], torch.Tensor] = {}
        try:
            for group, params in zip(groups, saved, strict=True):
                group["params"] = [p for p in params if p.dtype not in LOW_PRECISION_DTYPES]
            result = self.optimizer.step()  # fp32 parameters (norm layers), unexpanded
            for group in groups:
                group["params"] = []
            for group, params in zip(groups, low, strict=True):
                for p in params:
                    group["params"] = [p]
                    self._step_one(p, scratch)
                group["params"] = []
        finally:
            for group, params in zip(groups, saved, strict=True):
                group["params"] = params
        return result

    def _step_one(self, p: torch.nn.Parameter, scratch: dict[tuple[int, torch.device], torch.Tensor]) -> None:
        def buffer(slot: int) -> torch.Tensor:
            key = (slot, p.device)
            buf = scratch.get(key)
            if buf is None or buf.numel() < p.numel():
                buf = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
                scratch[key] = buf
            return buf[: p.numel()].view(p.shape)

        low, grad_low = p.data, p.grad
        value32 = buffer(0)
        self._expand_into(p, value32)
        p.data = value32
        if grad_low is not None:
            p.grad = buffer(1).copy_(grad_low)
        state = self.optimizer.state.get(p)
        stored: dict[Any, torch.Tensor] = {}
        if state:
            for slot, (key, value) in enumerate(list(state.items()), start=2):
                if _is_param_state(value, p) and value.dtype != torch.float32:
                    stored[key] = value
                    state[key] = buffer(slot).copy_(value)
        try:
            self.optimizer.step()
        finally:
            self._store(p, value32, low)
            p.data = low
            p.grad = grad_low
            state = self.optimizer.state.get(p) or {}
            for key, value in list(state.items()):
                if key in stored:
                    state[key] = stored[key].copy_(value)
                elif _is_param_state(value, p) and self.state_dtype is not None and value.dtype != self.state_dtype:
                    state[key] = value.to(self.state_dtype)  # state created by this first step

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        sd[self._STATE_KEY] = self._extra_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        extra = sd.pop(self._STATE_KEY, None)
        if extra is None:
            raise ValueError(
                f"this optimizer state_dict has no {self._STATE_KEY!r} entry: it was not saved by a "
                f"{type(self).__name__}; load it into the optimizer that saved it"
            )
        self.optimizer.load_state_dict(sd)
        # torch casts loaded state to the parameter dtype; restore the saved dtypes exactly.
        params = list(self.params())
        for index, saved in sd.get("state", {}).items():
            param = params[int(index)]
            live = self.optimizer.state.get(param, {})
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape:
                    live[key] = value.detach().clone().to(param.device)
        self._load_extra_state(extra)


class KahanOptimizer(LowPrecisionOptimizer):
    """bf16/fp16 weights with Kahan-compensated updates: no update is lost, no fp32 master copy.

    Args:
        optimizer: any torch optimizer over low-precision parameters.
        state_dtype: dtype the optimizer state is kept in between steps (None: fp32).

    Training-state memory for AdamW: 2 (weight) + 2 (grad) + 2 (compensation) +
    4 (two bf16 moments) = 10 bytes per parameter, against 16 for fp32 training.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, state_dtype: torch.dtype | str | None = torch.bfloat16) -> None:
        super().__init__(optimizer, state_dtype=state_dtype)
        self._comp: dict[torch.Tensor, torch.Tensor] = {}

    def _compensation(self, param: torch.Tensor) -> torch.Tensor:
        comp = self._comp.get(param)
        if comp is None:
            comp = torch.zeros_like(param, memory_format=torch.preserve_format)
            self._comp[param] = comp
        return comp

    def _expand_into(self, param: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(param).add_(self._compensation(param))

    def _store(self, param: torch.Tensor, value32: torch.Tensor, low: torch.Tensor) -> None:
        low.copy_(value32)
        # value32 is scratch of this step: reuse it for the residual
        self._comp[param].copy_(value32.sub_(low))

    def _extra_state(self) -> dict[str, Any]:
        params = list(self.params())
        return {"compensation": {i: self._comp[p].clone() for i, p in enumerate(params) if p in self._comp}}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        params = list(self.params())
        self._comp = {}
        for index, comp in extra.get("compensation", {}).items():
            param = params[int(index)]
            if comp.shape != param.shape:
                raise ValueError(f"saved compensation {index} has shape {tuple(comp.shape)}, expected {tuple(param.shape)}")
            self._comp[param] = comp.detach().clone().to(device=param.device, dtype=param.dtype)


class StochasticRoundingOptimizer(LowPrecisionOptimizer):
    """bf16 weights updated with stochastic rounding: unbiased, no extra buffer per weight.

    Args:
        optimizer: any torch optimizer over bf16 parameters.
        state_dtype: dtype the optimizer state is kept in between steps (None: fp32).
        seed: seed of the rounding noise (its generator state is checkpointed).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        state_dtype: torch.dtype | str | None = torch.bfloat16,
        seed: int = 0,
    ) -> None:
        super().__init__(optimizer, state_dtype=state_dtype)
        for p in self._low_params():
            if p.dtype != torch.bfloat16:
                raise ValueError(
                    f"StochasticRoundingOptimizer needs bf16 parameters, got {p.dtype}; use KahanOptimizer for fp16"
                )
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device).manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    def _store(self, param: torch.Tensor, value32: torch.Tensor, low: torch.Tensor) -> None:
        low.copy_(stochastic_round(value32, generator=self._generator(value32.device)))

    def _extra_state(self) -> dict[str, Any]:
        return {"generators": {str(dev): g.get_state() for dev, g in self._generators.items()}, "seed": self._seed}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        self._seed = int(extra.get("seed", self._seed))
        self._generators = {}
        for dev, state in extra.get("generators", {}).items():
            self._generator(torch.device(dev)).set_state(state)


def _is_param_state(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape
