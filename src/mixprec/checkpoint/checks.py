"""Checking every part of a checkpoint against what it will be loaded into, changing nothing.

:func:`~mixprec.load_checkpoint` runs these before it applies any part, so a mismatch
(another architecture, another optimizer, another plan, a foreign RNG state) raises a
``ValueError`` naming the path and the part, and leaves the training state as it was.

>>> import torch
>>> check_model("c.pt", torch.nn.Linear(2, 2), torch.nn.Linear(2, 3).state_dict())
Traceback (most recent call last):
    ...
ValueError: checkpoint 'c.pt': model entry 'weight' has shape (3, 2), the model's is (2, 2); pass the same architecture that was saved
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.checkpoint.convert import ROUNDING_KEY
from mixprec.optim import LowPrecisionOptimizer, WrappedOptimizer
from mixprec.optim.checks import check_group_keys, check_rounding_state
from mixprec.session import MixedPrecision

__all__ = ["check_model", "check_mp", "check_optimizer", "check_rng", "optimizer_class"]


def _innermost(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer inside mixprec's wrappers and those of frameworks that keep it as
    ``.optimizer`` (Accelerate's ``AcceleratedOptimizer``)."""
    for _ in range(8):
        inner = opt.optimizer if isinstance(opt, WrappedOptimizer) else getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is opt:
            break
        opt = inner
    return opt


def optimizer_class(opt: torch.optim.Optimizer) -> str:
    """The class of the optimizer that does the update (inside mixprec's wrappers), by name:
    ``"torch.optim.AdamW"``, recorded by :func:`~mixprec.save_checkpoint`."""
    cls = type(_innermost(opt))
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def check_model(path: str, module: torch.nn.Module, state: dict[str, Any]) -> None:
    """``state`` has ``module``'s keys, and tensors of its shapes and kinds (floating point, complex)."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected keys {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        raise ValueError(
            f"checkpoint {path!r} does not match the model ({'; '.join(parts)}); pass the same architecture "
            "that was saved"
        )
    for key, ours in own.items():
        saved = state[key]
        if not isinstance(ours, torch.Tensor):
            continue
        if not isinstance(saved, torch.Tensor):
            raise ValueError(f"checkpoint {path!r}: model entry {key!r} is a {type(saved).__name__}, expected a tensor")
        if saved.shape != ours.shape:
            raise ValueError(
                f"checkpoint {path!r}: model entry {key!r} has shape {tuple(saved.shape)}, the model's is "
                f"{tuple(ours.shape)}; pass the same architecture that was saved"
            )
        if saved.is_floating_point() != ours.is_floating_point() or saved.is_complex() != ours.is_complex():
            raise ValueError(
                f"checkpoint {path!r}: model entry {key!r} is {saved.dtype}, the model's is {ours.dtype}"
            )


#: entries of a wrapper's state_dict that a checkpoint may lack (the state kinds added to a master wrapper)
OPTIONAL_KEYS = frozenset({"mixprec_state_kinds"})


def check_optimizer(path: str, i: int, opt: torch.optim.Optimizer, state: Any, saved_class: str | None = None) -> None:
    """``state`` is a state_dict of ``opt``'s kind (of the class ``saved_class`` names, when the
    checkpoint recorded it), with its groups, hyper-parameters, parameter counts and state shapes."""
    where = f"checkpoint {path!r}: optimizers[{i}]"
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise ValueError(f"{where} is not an optimizer state_dict (needs 'state' and 'param_groups')")
    now = optimizer_class(opt)
    if saved_class is not None and saved_class != now:
        raise ValueError(
            f"{where} was saved from a {saved_class}, this run's optimizer is a {now}: its state and "
            "hyper-parameters belong to another update rule. Pass the optimizer class that was saved; to change "
            "optimizers on purpose, load only the model (model.load_state_dict(torch.load(path, "
            "weights_only=True)['model'])) and start the optimizer fresh"
        )
    own = opt.state_dict()
    check = getattr(opt, "check_state_dict", None)
    if callable(check):  # a wrapper: its own validator, as its load runs it
        try:
            check(state)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
    missing = sorted(set(own) - set(state) - OPTIONAL_KEYS)
    if missing:
        raise ValueError(f"{where} is missing {missing}; it was saved from another kind of optimizer ({type(opt).__name__} now)")
    groups, own_groups = state["param_groups"], own["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(own_groups):
        n = len(groups) if isinstance(groups, list) else type(groups).__name__
        raise ValueError(f"{where} has {n} parameter groups, the optimizer has {len(own_groups)}")
    for g, (saved_g, own_g) in enumerate(zip(groups, own_groups, strict=True)):
        if not isinstance(saved_g, dict) or len(saved_g.get("params", ())) != len(own_g["params"]):
            got = len(saved_g.get("params", ())) if isinstance(saved_g, dict) else "?"
            raise ValueError(
                f"{where} group {g} has {got} parameters, the optimizer's has {len(own_g['params'])}"
            )
    try:
        check_group_keys(_innermost(opt), groups)
        if isinstance(opt, LowPrecisionOptimizer) and isinstance(state.get(ROUNDING_KEY), dict):
            check_rounding_state(state[ROUNDING_KEY], opt.rounding, type(opt).__name__)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    saved_state, own_state = state["state"], own["state"]
    if not isinstance(saved_state, dict):
        raise ValueError(f"{where}['state'] is a {type(saved_state).__name__}, expected a dict")
    for pid, entry in saved_state.items():
        mine = own_state.get(pid)
        if not isinstance(mine, dict) or not isinstance(entry, dict):
            continue
        for key, value in entry.items():
            cur = mine.get(key)
            if isinstance(cur, torch.Tensor) and isinstance(value, torch.Tensor) and cur.shape != value.shape:
                raise ValueError(
                    f"{where} state {key!r} of parameter {pid} has shape {tuple(value.shape)}, the "
                    f"optimizer's is {tuple(cur.shape)}"
                )


def check_mp(path: str, mp: MixedPrecision, state: Any, allow_plan_change: bool) -> None:
    """``state`` is a MixedPrecision state that ``mp`` accepts (of its plan, unless ``allow_plan_change``)."""
    if state is None:
        raise ValueError(f"checkpoint {path!r} has no MixedPrecision state (it was saved without mp=); pass mp=None")
    if not isinstance(state, dict) or "scaler" not in state or "format" not in state:
        raise ValueError(f"checkpoint {path!r}: the MixedPrecision state is incomplete (no 'format'/'scaler')")
    mp.validate_state_dict(state, allow_plan_change=allow_plan_change)


def check_rng(path: str, state: Any) -> None:
    """``state`` holds a CPU RNG state of this torch's shape."""
    if not isinstance(state, dict) or not isinstance(state.get("cpu"), torch.Tensor):
        raise ValueError(f"checkpoint {path!r}: the RNG state is not what save_checkpoint wrote (no 'cpu' tensor)")
    cpu = state["cpu"]
    current = torch.get_rng_state()
    if cpu.dtype != torch.uint8 or cpu.shape != current.shape:
        raise ValueError(
            f"checkpoint {path!r}: the CPU RNG state is a {cpu.dtype} tensor of shape {tuple(cpu.shape)}, "
            f"expected uint8 of shape {tuple(current.shape)}"
        )
