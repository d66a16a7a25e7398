"""fp32 master weights and fp32 gradient accumulation for a low-precision model.

The model keeps bf16/fp16 weights (fast compute, half the weight memory); the inner
optimizer updates fp32 copies ("masters") so small updates are not rounded away,
and every step copies the masters back into the model. Gradients of low-precision
parameters are moved into fp32 buffers as soon as autograd produces them, so
accumulating several micro-batches adds in fp32.

>>> import torch
>>> from mixprec.optim import MasterWeightOptimizer
>>> model = torch.nn.Linear(4, 2)
>>> sgd = torch.optim.SGD(model.parameters(), lr=1e-4)
>>> fp32_values = {p: p.detach().clone() for p in model.parameters()}
>>> _ = model.to(torch.bfloat16)  # parameters keep their identity, sgd still holds them
>>> opt = MasterWeightOptimizer(sgd, master_values=fp32_values)
>>> model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
>>> opt.step(); opt.zero_grad()
>>> opt.param_groups[0]["params"][0].dtype, model.weight.dtype
(torch.float32, torch.bfloat16)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.optim.base import WrappedOptimizer

__all__ = ["MasterWeightOptimizer"]

_MASTER_KEY = "mixprec_master_weights"


class MasterWeightOptimizer(WrappedOptimizer):
    """Keep fp32 master copies of the low-precision parameters of ``optimizer``.

    Args:
        optimizer: any torch optimizer over the model's parameters.
        master_values: optional fp32 values to start the masters from, by parameter
            (pass the fp32 weights captured before the model was cast down, so the
            masters lose nothing). Parameters not in it start from their own values.
        accumulate_grads_in_fp32: move each low-precision gradient into the master's
            fp32 ``.grad`` as soon as autograd produces it (post-accumulate-grad hook),
            so micro-batches accumulate in fp32 and the low-precision ``.grad`` is freed.
            With False (for example under DDP, whose reducer owns ``.grad``), gradients
            are copied into the masters at :meth:`step` time.

    ``param_groups`` hold the masters (fp32 parameters are used directly, without a
    copy). The masters are part of :meth:`state_dict`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        master_values: Mapping[torch.Tensor, torch.Tensor] | None = None,
        accumulate_grads_in_fp32: bool = True,
    ) -> None:
        super().__init__(optimizer)
        self._values = master_values or {}
        self._hook_mode = accumulate_grads_in_fp32
        self._pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self._hooks: list[Any] = []
        for group in optimizer.param_groups:
            group["params"] = self._masters_for(group["params"])
        self._values = {}

    def _masters_for(self, params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        out = []
        for p in params:
            if p.dtype not in LOW_PRECISION_DTYPES:
                out.append(p)
                continue
            source = self._values.get(p, p)
            if source.shape != p.shape:
                raise ValueError(f"master value has shape {tuple(source.shape)} but the parameter {tuple(p.shape)}")
            master = torch.nn.Parameter(source.detach().to(torch.float32, copy=True), requires_grad=p.requires_grad)
            self._adopt_state(p, master)
            self._pairs.append((p, master))
            if self._hook_mode and p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_into(master)))
            out.append(master)
        return out

    def _adopt_state(self, param: torch.Tensor, master: torch.Tensor) -> None:
        state = self.optimizer.state.pop(param, None)
        if state:
            self.optimizer.state[master] = {
                k: v.to(torch.float32) if _is_param_shaped(v, master) else v for k, v in state.items()
            }

    @property
    def masters(self) -> list[torch.nn.Parameter]:
        """The fp32 master parameters, in parameter order."""
        return [m for _, m in self._pairs]

    def master_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """The master of a model parameter (None if it has none, e.g. an fp32 norm weight)."""
        for p, m in self._pairs:
            if p is param:
                return m
        return None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        group["params"] = self._masters_for(params)
        self.optimizer.add_param_group(group)

    def gather_grads(self) -> None:
        """Without grad hooks: add the model's low-precision grads into the fp32 master grads."""
        with torch.no_grad():
            for p, m in self._pairs:
                if p.grad is None:
                    continue
                if m.grad is None:
                    m.grad = p.grad.to(torch.float32)
                else:
                    m.grad.add_(p.grad)
                p.grad = None

    @torch.no_grad()
    def sync_model(self) -> None:
        """Copy the masters into the model's low-precision parameters (one foreach copy)."""
        if self._pairs:
            torch._foreach_copy_([p for p, _ in self._pairs], [m for _, m in self._pairs])

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError("MasterWeightOptimizer.step() does not take a closure; compute the loss before step()")
        if not self._hook_mode:
            self.gather_grads()
        result = self.optimizer.step()
        self.sync_model()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for p, _ in self._pairs:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        sd[_MASTER_KEY] = [m.detach().clone() for m in self.masters]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        masters = sd.pop(_MASTER_KEY, None)
        if masters is None:
            raise ValueError(
                "this optimizer state_dict has no fp32 master weights (key "
                f"{_MASTER_KEY!r}): it was saved without master weights. To start the masters from "
                "the current model weights instead, call opt.optimizer.load_state_dict(sd) and then "
                "opt.reset_masters_from_model()."
            )
        if len(masters) != len(self._pairs):
            raise ValueError(
                f"the state_dict holds {len(masters)} master weights but this optimizer has {len(self._pairs)}; "
                "was it saved from a different model or plan?"
            )
        self.optimizer.load_state_dict(sd)
        with torch.no_grad():
            for (_, m), saved in zip(self._pairs, masters, strict=True):
                if saved.shape != m.shape:
                    raise ValueError(f"saved master weight has shape {tuple(saved.shape)}, expected {tuple(m.shape)}")
                m.copy_(saved)
        self.sync_model()

    @torch.no_grad()
    def reset_masters_from_model(self) -> None:
        """Set every master to the current (low-precision) value of its model parameter."""
        for p, m in self._pairs:
            m.copy_(p)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the model (the wrapper stops accumulating)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _accumulate_into(master: torch.nn.Parameter) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        with torch.no_grad():
            if master.grad is None:
                master.grad = grad.to(torch.float32)
            else:
                master.grad.add_(grad)
        param.grad = None

    return hook


def _is_param_shaped(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape
