"""The update rule, written once: torch's Adam/AdamW and SGD arithmetic on fp32 values.

Every route of the low-precision wrappers runs the arithmetic of this module on fp32
values; how each stored form becomes fp32 and goes back is the codecs' business
(:mod:`mixprec.optim.codecs`), which parameters run where the executors' (the eager fast
path :mod:`mixprec.optim.fast`, the compiled route :mod:`mixprec.optim.compiled`). The rule
is written against a small set of operations, given as one of two backends:

- :data:`FOREACH`: in place on lists of fp32 tensors with torch's ``_foreach_*`` kernels (on
  the CPU the same bits as torch's single-tensor Adam and SGD, which the eager executor is
  held to bit for bit);
- :data:`FUSED`: out of place on one fp32 tensor, for a compiler to fuse into one loop
  (``torch.compile``); hyperparameters may be 0-dim tensors, so new values do not recompile.

Both run the operations in torch's order: the gradient negated (``maximize``), weight decay
(decoupled: the weight scaled; else added to the gradient), ``exp_avg.lerp_(grad, 1 - beta1)``,
``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)``, with ``amsgrad`` the running
maximum, ``denom = sqrt(v) / bias_correction2_sqrt + eps``, ``param.addcdiv_(exp_avg, denom,
value=-step_size)``. The native CPU kernel (:file:`native_adam.c`) is the one sanctioned mirror
of this arithmetic in another language; its tests hold it to this module's results.

>>> import torch
>>> h = AdamHyper(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
...               amsgrad=False, maximize=False)
>>> step_size, bc2_sqrt = bias_corrections(h, 1.0)
>>> w, g = torch.ones(3), torch.full((3,), 0.5)
>>> w, m, v, _ = adam(FUSED, h, step_size, bc2_sqrt, w, g, torch.zeros(3), torch.zeros(3), None)
>>> [round(x, 4) for x in w.tolist()]  # Adam's first step moves each weight by lr
[0.9, 0.9, 0.9]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = [
    "FOREACH", "FUSED", "AdamHyper", "SgdHyper", "adam", "adam_hyper", "bias_corrections", "scalar_value", "sgd",
    "sgd_hyper",
]


def scalar_value(value: Any) -> float:
    """A hyperparameter as a Python float (tensors are read once)."""
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


class AdamHyper(NamedTuple):
    """Adam/AdamW's hyperparameters of one param group (floats, or 0-dim tensors on the
    compiled route) and its options (Python bools: they choose the operations)."""

    lr: Any
    beta1: Any
    beta2: Any
    eps: Any
    weight_decay: Any
    decoupled: bool
    amsgrad: bool
    maximize: bool
    decays: bool = False  # weight_decay != 0 (a flag, so a tensor weight_decay needs no host read)


def adam_hyper(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> AdamHyper:
    """The hyperparameters of ``group`` as torch's Adam (AdamW: decoupled weight decay) reads
    them, read at every step (an LR scheduler's new value counts)."""
    beta1, beta2 = (scalar_value(b) for b in group["betas"])
    weight_decay = float(group["weight_decay"])
    return AdamHyper(
        lr=scalar_value(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]), weight_decay=weight_decay,
        decoupled=bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))),
        amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]), decays=weight_decay != 0,
    )


def bias_corrections(h: AdamHyper, step: float) -> tuple[float, float]:
    """(step_size, bias_correction2_sqrt) of step number ``step`` (counted from 1), in double
    precision as torch's Adam computes them on the host."""
    bias_correction1 = 1 - h.beta1**step
    bias_correction2 = 1 - h.beta2**step
    return h.lr / bias_correction1, bias_correction2**0.5


class SgdHyper(NamedTuple):
    """torch.optim.SGD's hyperparameters of one param group."""

    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool


def sgd_hyper(group: dict[str, Any]) -> SgdHyper:
    return SgdHyper(
        lr=scalar_value(group["lr"]), momentum=scalar_value(group["momentum"]),
        dampening=scalar_value(group["dampening"]), weight_decay=float(group["weight_decay"]),
        nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]),
    )


def _inplace(op: Callable[..., Any]) -> Any:
    """A ``_foreach_*_`` kernel as an operation that returns the list it updated."""
    return staticmethod(lambda x, *args, **kwargs: (op(x, *args, **kwargs), x)[1])


class _Foreach:
    """The operations in place on lists of fp32 tensors (``sqrt`` makes new ones)."""

    neg, mul, add, add_scalar = (_inplace(torch._foreach_neg_), _inplace(torch._foreach_mul_),
                                 _inplace(torch._foreach_add_), _inplace(torch._foreach_add_))
    div_scalar, lerp, maximum = _inplace(torch._foreach_div_), _inplace(torch._foreach_lerp_), _inplace(torch._foreach_maximum_)
    addcmul, addcdiv = _inplace(torch._foreach_addcmul_), _inplace(torch._foreach_addcdiv_)
    sqrt = staticmethod(torch._foreach_sqrt)


class _Fused:
    """The operations out of place on one fp32 tensor (scalars may be 0-dim tensors)."""

    neg = staticmethod(lambda x: -x)
    mul = staticmethod(lambda x, s: x * s)
    add = staticmethod(lambda x, y, alpha: x + y * alpha)
    add_scalar = staticmethod(lambda x, s: x + s)
    div_scalar = staticmethod(lambda x, s: x / s)
    lerp = staticmethod(lambda x, y, weight: x.lerp(y, weight))
    addcmul = staticmethod(lambda x, a, b, value: x + a * b * value)
    addcdiv = staticmethod(lambda x, a, b, value: x + value * (a / b))
    maximum = staticmethod(torch.maximum)
    sqrt = staticmethod(torch.sqrt)


#: the rule's operations on lists of fp32 tensors, in place (the eager executor)
FOREACH = _Foreach()
#: the rule's operations on one fp32 tensor, out of place (a compiled loop)
FUSED = _Fused()
Ops = _Foreach | _Fused


def adam(ops: Ops, h: AdamHyper, step_size: Any, bc2_sqrt: Any, w: Any, g: Any, m: Any, v: Any, vmax: Any) -> tuple[Any, Any, Any, Any]:
    """One Adam/AdamW step on fp32 ``w`` (weights), ``g`` (gradients, scratch: it may be
    written), ``m``, ``v`` and ``vmax`` (the moments; ``vmax`` with ``amsgrad`` only); returns
    the new (w, m, v, vmax). With :data:`FOREACH` these are the lists given, updated in place."""
    if h.maximize:
        g = ops.neg(g)
    if h.decays:
        if h.decoupled:
            w = ops.mul(w, 1 - h.lr * h.weight_decay)
        else:
            g = ops.add(g, w, alpha=h.weight_decay)
    m = ops.lerp(m, g, 1 - h.beta1)
    v = ops.mul(v, h.beta2)
    v = ops.addcmul(v, g, g, value=1 - h.beta2)
    if h.amsgrad:
        vmax = ops.maximum(vmax, v)
        denom = ops.sqrt(vmax)
    else:
        denom = ops.sqrt(v)
    denom = ops.div_scalar(denom, bc2_sqrt)
    denom = ops.add_scalar(denom, h.eps)
    w = ops.addcdiv(w, m, denom, value=-step_size)
    return w, m, v, vmax


def sgd(ops: Ops, h: SgdHyper, w: Any, g: Any, buf: Any, keep_buf: Callable[[Any], None]) -> Any:
    """One SGD step on fp32 ``w`` and ``g`` (scratch: it may be written); ``buf`` is the momentum
    buffer (None on the first step, when it becomes the gradient). The new buffer is handed to
    ``keep_buf`` as soon as it is known (before a Nesterov step reuses it); returns the new ``w``."""
    if h.maximize:
        g = ops.neg(g)
    if h.weight_decay != 0:
        g = ops.add(g, w, alpha=h.weight_decay)
    if h.momentum != 0:
        if buf is None:
            buf = g
        else:
            buf = ops.mul(buf, h.momentum)
            buf = ops.add(buf, g, alpha=1 - h.dampening)
        keep_buf(buf)
        g = ops.add(g, buf, alpha=h.momentum) if h.nesterov else buf
    return ops.add(w, g, alpha=-h.lr)
