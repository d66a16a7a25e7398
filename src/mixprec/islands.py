"""fp32 islands: modules whose forward runs with autocast off and fp32 inputs.

Some layers overflow or lose too much precision in fp16/bf16 no matter which op
lists are used: a T5 feed-forward whose activations pass 65504, an attention
softmax over long rows, a loss head. An island runs such a module entirely in
fp32: autocast is off inside it and its floating inputs are cast to float32.

Islands are chosen by :attr:`mixprec.OpPolicy.fp32_modules`: module classes
(``nn.LayerNorm``) or glob patterns over qualified names (``"*.attn.softmax"``,
``"encoder.block.*.layer.1"``). :func:`apply_fp32_islands` marks the matching
modules of a model in place, returns their names, and is idempotent;
:func:`remove_fp32_islands` (or the handle's ``remove()``) undoes it.

Marking swaps the module's class for a subclass that overrides ``forward`` (as
``torch.nn.utils.parametrize`` does): parameters, buffers, hooks and
``state_dict`` keys are unchanged, ``isinstance`` checks still hold, and
``torch.compile`` traces the island like any module. Like parametrized modules,
marked models are saved with ``state_dict()``, not by pickling the module.

Dtypes: the island's floating parameters and buffers are cast to fp32 when it is
marked. Its outputs are fp32 under autocast (autocast handles what follows). With
autocast off and a low-precision input (the pure and master-weight plans, where
the rest of the model runs in bf16/fp16), outputs are cast back to that input's
dtype, so the island is transparent to its neighbours.

>>> import torch
>>> from torch import nn
>>> from mixprec.policy import OpPolicy
>>> from mixprec.islands import apply_fp32_islands, remove_fp32_islands
>>> model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
>>> apply_fp32_islands(model, OpPolicy(fp32_modules=[nn.LayerNorm]))
['1']
>>> with torch.autocast("cpu", dtype=torch.bfloat16):
...     h = model[1](model[0](torch.randn(3, 4)))
>>> h.dtype
torch.float32
>>> sorted(model.state_dict()) == ['0.bias', '0.weight', '1.bias', '1.weight', '2.bias', '2.weight']
True
>>> remove_fp32_islands(model)
['1']
"""

from __future__ import annotations

import difflib
import fnmatch
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.dtypes import LOW_PRECISION_DTYPES, cast_floating, cast_module_
from mixprec.nested import first_tensor, map_tensors
from mixprec.policy import ModuleRule, OpPolicy, as_module_rules

__all__ = [
    "FP32Island",
    "IslandHandle",
    "apply_fp32_islands",
    "cast_outside_islands",
    "fp32_island_names",
    "install_input_cast",
    "is_fp32_island",
    "match_fp32_modules",
    "remove_fp32_islands",
]


class FP32Island:
    """Marker base of island classes: ``isinstance(module, FP32Island)`` tells an island.

    Converters that cast a model to low precision should keep these modules in fp32
    (or call :func:`apply_fp32_islands` after converting, which restores fp32).
    """

    _mixprec_island_base: type[nn.Module]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the original forward with autocast off and fp32 floating inputs."""
        base = type(self)._mixprec_island_base
        _check_fp32_state(self)  # type: ignore[arg-type]
        first = first_tensor((args, kwargs))
        device_type = first.device.type if first is not None else _module_device_type(self)  # type: ignore[arg-type]
        autocast_was_on = torch.is_autocast_enabled(device_type)
        low = first_tensor((args, kwargs), lambda t: t.dtype in LOW_PRECISION_DTYPES)
        low_input = low.dtype if low is not None else None
        with torch.autocast(device_type, enabled=False):
            args, kwargs = _fp32_inputs(args, kwargs)
            out = base.forward(self, *args, **kwargs)  # type: ignore[arg-type]
        if not autocast_was_on:
            # Transparent to its neighbours: back to the input's low dtype, or to the dtype
            # the model runs in (a pure-plan island fed by integer ids or fp32 values).
            target = low_input or getattr(self, "_mixprec_output_dtype", None)
            if target is not None:
                out = cast_floating(out, target)
        return out


_ISLAND_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
# What selects islands: a policy (its fp32_modules), or module rules directly.
_Rules = OpPolicy | Iterable[ModuleRule] | ModuleRule


def _island_class(cls: type[nn.Module]) -> type[nn.Module]:
    island = _ISLAND_CLASSES.get(cls)
    if island is None:
        island = type(
            f"FP32Island{cls.__name__}",
            (FP32Island, cls),
            {
                "_mixprec_island_base": cls,
                "__module__": __name__,
                "__qualname__": f"FP32Island{cls.__name__}",
            },
        )
        _ISLAND_CLASSES[cls] = island
    return island


def is_fp32_island(module: nn.Module) -> bool:
    """True if ``module`` is marked as an fp32 island."""
    return isinstance(module, FP32Island)


def _matches(name: str, module: nn.Module, rules: Sequence[ModuleRule]) -> bool:
    base = type(module)._mixprec_island_base if isinstance(module, FP32Island) else type(module)
    for rule in rules:
        if isinstance(rule, str):
            if fnmatch.fnmatchcase(name, rule):
                return True
        elif issubclass(base, rule):
            return True
    return False


def _rules_of(policy_or_rules: _Rules) -> tuple[ModuleRule, ...]:
    if isinstance(policy_or_rules, OpPolicy):
        return policy_or_rules.fp32_modules
    return as_module_rules(policy_or_rules)


def match_fp32_modules(model: nn.Module, policy: _Rules) -> list[str]:
    """Qualified names of the modules of ``model`` that ``policy.fp32_modules`` selects.

    The root module's name is ``""``. Nothing is changed.
    """
    rules = _rules_of(policy)
    if not rules:
        return []
    return [name for name, module in model.named_modules() if _matches(name, module, rules)]


class IslandHandle:
    """Returned by :func:`apply_fp32_islands`; ``remove()`` unmarks the modules it marked."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self._model = model
        self.names = names

    def remove(self) -> list[str]:
        """Unmark the islands this call marked (still present); returns their names."""
        removed: list[str] = []
        modules = dict(self._model.named_modules())
        for name in self.names:
            module = modules.get(name)
            if module is not None and _unmark(module):
                removed.append(name)
        return removed


class _IslandList(list[str]):
    """A list of island names that also carries the :class:`IslandHandle`."""

    handle: IslandHandle


def apply_fp32_islands(
    model: nn.Module, policy: _Rules, *, output_dtype: torch.dtype | None = None
) -> list[str]:
    """Mark the modules ``policy.fp32_modules`` selects as fp32 islands, in place.

    Returns the qualified names of all matching modules (marked now or before), in
    module order; calling it again marks nothing new. Island parameters and buffers
    are cast to fp32 (on every call, so calling it after a model was cast to low
    precision restores its islands). The returned list has a ``handle`` attribute whose
    ``remove()`` unmarks exactly the modules this call marked;
    :func:`remove_fp32_islands` unmarks all.

    A glob that matches no module raises ``ValueError`` naming it (a typo would
    otherwise leave the layer in low precision silently). ``output_dtype`` (the pure
    plans pass their weight dtype) is the dtype island outputs are cast to when
    autocast is off and no low-precision input tells it.

    >>> import torch
    >>> from torch import nn
    >>> from mixprec.policy import OpPolicy
    >>> from mixprec.islands import apply_fp32_islands
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    >>> names = apply_fp32_islands(net, OpPolicy(fp32_modules=["1.*"]))
    >>> names, apply_fp32_islands(net, OpPolicy(fp32_modules=["1.*"]))
    (['1.0'], ['1.0'])
    >>> names.handle.remove()
    ['1.0']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_fp32_islands() expects an nn.Module, got {type(model).__name__}")
    if output_dtype is not None and (
        not isinstance(output_dtype, torch.dtype) or output_dtype not in (torch.float16, torch.bfloat16, torch.float32)
    ):
        raise ValueError(f"output_dtype must be torch.float16, torch.bfloat16 or torch.float32, got {output_dtype!r}")
    rules = _rules_of(policy)
    _check_globs_match(model, rules)
    names = _IslandList()
    marked: list[str] = []
    for name, module in list(model.named_modules()):
        if not rules or not _matches(name, module, rules):
            continue
        names.append(name)
        cast_module_(module, torch.float32, only_from=LOW_PRECISION_DTYPES)  # also restores islands cast down
        if not isinstance(module, FP32Island):
            module.__class__ = _island_class(type(module))
            marked.append(name)
        if output_dtype is not None:
            module._mixprec_output_dtype = output_dtype  # type: ignore[assignment]
    names.handle = IslandHandle(model, marked)
    return names


def _check_globs_match(model: nn.Module, rules: Sequence[ModuleRule]) -> None:
    globs = [r for r in rules if isinstance(r, str)]
    if not globs:
        return
    all_names = [name for name, _ in model.named_modules()]
    for glob in globs:
        if not any(fnmatch.fnmatchcase(name, glob) for name in all_names):
            shown = [n if n else "''" for n in all_names[:12]]
            more = f", ... ({len(all_names)} modules)" if len(all_names) > 12 else ""
            close = difflib.get_close_matches(glob, [n for n in all_names if n], n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(
                f"fp32_modules glob {glob!r} matches no module of {type(model).__name__}{hint} "
                f"Module names: {', '.join(shown)}{more}. Fix the pattern (globs match qualified "
                "names as model.named_modules() gives them, e.g. 'encoder.*.attn')"
            )


def _island_tensor_ids(model: nn.Module) -> set[int]:
    """ids of the parameters and buffers that belong to an island or its submodules."""
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, FP32Island):
            ids.update(id(t) for t in (*module.parameters(), *module.buffers()))
    return ids


def cast_outside_islands(
    model: nn.Module,
    dtype: torch.dtype,
    policy: OpPolicy | None,
    *,
    keep: tuple[type[nn.Module], ...] = (),
    keep_dtype: torch.dtype = torch.float32,
    output_dtype: torch.dtype | None = None,
) -> dict[torch.Tensor, torch.Tensor]:
    """Cast ``model`` to ``dtype`` in place as a plan's ``convert_model`` does, leaving islands fp32.

    The modules ``policy.fp32_modules`` selects are marked as islands first
    (:func:`apply_fp32_islands`), so their parameters never go through the
    low-precision cast and keep their exact fp32 values (a 1e5 weight stays 1e5 under
    fp16). Modules of the types in ``keep`` get ``keep_dtype``. Parameter objects keep
    their identity; integer buffers are untouched. Returns the fp32 values of the
    parameters that were cast down (to seed fp32 master weights).
    """
    if policy is not None and policy.fp32_modules:
        apply_fp32_islands(model, policy, output_dtype=output_dtype)
    return cast_module_(model, dtype, keep=keep, keep_dtype=keep_dtype, skip=_island_tensor_ids(model))


def _unmark(module: nn.Module) -> bool:
    if not isinstance(module, FP32Island):
        return False
    module.__class__ = type(module)._mixprec_island_base  # type: ignore[assignment]
    module.__dict__.pop("_mixprec_output_dtype", None)
    return True


def remove_fp32_islands(model: nn.Module) -> list[str]:
    """Unmark every fp32 island in ``model``; returns their names.

    Parameters keep the fp32 dtype they were given when marked.
    """
    return [name for name, module in model.named_modules() if _unmark(module)]


def fp32_island_names(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` currently marked as fp32 islands."""
    return [name for name, module in model.named_modules() if isinstance(module, FP32Island)]


# ------------------------------------------------------------ model input cast
class _InputOriginals(threading.local):
    def __init__(self) -> None:
        self.stack: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []


_INPUT_ORIGINALS = _InputOriginals()


def _fp32_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The inputs with their floating tensors in fp32 (float64 kept); tensors the model's input
    cast produced are replaced by the inputs they were cast from (fp32 values, not rounded)."""
    table = _INPUT_ORIGINALS.stack[-1] if _INPUT_ORIGINALS.stack else {}

    def to_fp32(t: torch.Tensor) -> torch.Tensor:
        hit = table.get(id(t))
        if hit is not None and hit[0] is t:
            t = hit[1]
        if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64):
            return t.to(torch.float32)
        return t

    return map_tensors(to_fp32, args), {k: map_tensors(to_fp32, v) for k, v in kwargs.items()}


def install_input_cast(model: nn.Module, dtype: torch.dtype) -> list[Any]:
    """Cast the floating inputs of ``model`` to ``dtype`` (what the pure plans need), islands excepted.

    Returns the hook handles (``remove()`` each to undo). Float64 inputs are cast too. An
    fp32 island that receives one of those inputs directly (an island as the first
    layer) gets the original fp32 value, not the rounded one (1e5 stays 1e5 under fp16);
    a model that is itself an island gets its inputs unchanged.
    """
    if isinstance(model, FP32Island):
        return []

    def before(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        table: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def cast(t: torch.Tensor) -> torch.Tensor:
            if t.is_floating_point() and t.dtype != dtype:
                low = t.to(dtype)
                table[id(low)] = (low, t)
                return low
            return t

        _INPUT_ORIGINALS.stack.append(table)
        return map_tensors(cast, args), map_tensors(cast, kwargs)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if _INPUT_ORIGINALS.stack:
            _INPUT_ORIGINALS.stack.pop()

    return [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, always_call=True),
    ]


# ----------------------------------------------------------------------- helpers
def _check_fp32_state(module: nn.Module) -> None:
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if t.dtype in (torch.float16, torch.bfloat16):
            raise RuntimeError(
                f"fp32 island {type(module).__name__} holds {t.dtype} tensor {name!r}: islands "
                "compute in fp32, so their parameters must stay fp32. Keep FP32Island modules "
                "in fp32 when converting the model (skip isinstance(m, FP32Island)), or call "
                "apply_fp32_islands() after converting, which casts them back"
            )


def _module_device_type(module: nn.Module) -> str:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device.type
    return "cpu"
