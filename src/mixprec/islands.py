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
``torch.compile`` traces the island like any module.

A marked model stays an ordinary module: ``copy.deepcopy`` gives a copy whose islands
are islands of the copy, and ``torch.save(model)`` / ``torch.load(..., weights_only=False)``
work (an island pickles as its original class plus the mark, and is marked again when
loaded: the island classes are made on demand, so the pickle names the original class,
which must be importable as for any pickled module). The input casting of the pure
plans (:func:`install_input_cast`) is a picklable hook holding only the dtype, so copies
and loaded models cast their inputs as the original does.

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

import copyreg
import difflib
import fnmatch
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec.dtypes import (
    LOW_PRECISION_DTYPES,
    cast_floating,
    cast_module_,
    check_frozen_casts,
    lossy_frozen_casts,
)
from mixprec.inputs import InputCast, end_input_cast, fp32_inputs
from mixprec.nested import first_tensor
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
        """Run the original forward with autocast off and fp32 floating inputs (tensors it
        creates are fp32 too where a framework made a low-precision dtype the default)."""
        base = type(self)._mixprec_island_base
        _check_fp32_state(self)  # type: ignore[arg-type]
        first = first_tensor((args, kwargs))
        device_type = first.device.type if first is not None else _module_device_type(self)  # type: ignore[arg-type]
        autocast_was_on = torch.is_autocast_enabled(device_type)
        low = first_tensor((args, kwargs), lambda t: t.dtype in LOW_PRECISION_DTYPES)
        low_input = low.dtype if low is not None else None
        # A framework may have made a low dtype the default for the step (Lightning's
        # bf16-true, the pure plans under Lightning): tensors the island creates are fp32.
        default = torch.get_default_dtype()
        low_default = default in LOW_PRECISION_DTYPES
        if low_default:
            torch.set_default_dtype(torch.float32)
        try:
            with torch.autocast(device_type, enabled=False):
                args, kwargs = fp32_inputs(args, kwargs)
                out = base.forward(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            if low_default:
                torch.set_default_dtype(default)
        if not autocast_was_on:
            # Transparent to its neighbours: back to the input's low dtype, or to the dtype
            # the model runs in (a pure-plan island fed by integer ids or fp32 values).
            target = low_input or getattr(self, "_mixprec_output_dtype", None)
            if target is not None:
                out = cast_floating(out, target)
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle (and ``copy.deepcopy``) as the original class, marked again when rebuilt: the
        island class is made on demand, so no module attribute names it."""
        island, base = type(self), type(self)._mixprec_island_base
        reduced = super().__reduce_ex__(max(2, protocol))  # type: ignore[misc]
        if not isinstance(reduced, tuple) or not reduced:
            return reduced
        func, args, *rest = reduced
        if func in (_NEWOBJ, _NEWOBJ_EX) and args and args[0] is island:
            return (_new_island, (func is _NEWOBJ_EX, base, *args[1:]), *rest)
        if func is island:  # a __reduce__ of the original class that calls the class
            return (_call_island, (base, *args), *rest)
        return reduced


_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]
_NEWOBJ_EX = copyreg.__newobj_ex__  # type: ignore[attr-defined]


def _new_island(ex: bool, base: type[nn.Module], *args: Any) -> nn.Module:
    """Unpickle an island: a new instance of ``base``'s island class (its state follows)."""
    island = _island_class(base)
    if ex:
        new_args, new_kwargs = args
        return island.__new__(island, *new_args, **new_kwargs)  # type: ignore[no-any-return]
    return island.__new__(island, *args)  # type: ignore[no-any-return]


def _call_island(base: type[nn.Module], *args: Any) -> nn.Module:
    return _island_class(base)(*args)


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
    plan_name: str = "",
    convert_frozen: bool = False,
    keeps_fp32_values: bool = False,
    known_plans: Collection[str] = (),
) -> dict[torch.Tensor, torch.Tensor]:
    """Cast ``model`` to ``dtype`` in place as a plan's ``convert_model`` does, leaving islands fp32.

    The modules ``policy.fp32_modules`` selects are marked as islands first
    (:func:`apply_fp32_islands`), so their parameters never go through the
    low-precision cast and keep their exact fp32 values (a 1e5 weight stays 1e5 under
    fp16). Modules of the types in ``keep`` get ``keep_dtype``. Parameter objects keep
    their identity; integer buffers are untouched. Returns the fp32 values of the
    parameters that were cast down (to seed fp32 master weights). A frozen parameter the
    cast would round (fp16 to bf16 or back; fp32 to half where the plan ``keeps_fp32_values``
    of trainable weights, in masters or compensation) is refused before anything is cast,
    unless ``convert_frozen`` (see :func:`mixprec.dtypes.check_frozen_casts`).
    """
    skip = _island_tensor_ids(model)  # islands marked before, and those the policy will mark
    for name in match_fp32_modules(model, policy) if policy is not None and policy.fp32_modules else ():
        module = model.get_submodule(name)
        skip.update(id(t) for t in (*module.parameters(), *module.buffers()))
    check_frozen_casts(
        plan_name,
        lossy_frozen_casts(model, dtype, keep=keep, keep_dtype=keep_dtype, skip=skip, narrowing=keeps_fp32_values),
        convert_frozen,
        known_plans,
    )
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
def install_input_cast(model: nn.Module, dtype: torch.dtype) -> list[Any]:
    """Cast the floating inputs of ``model`` to ``dtype`` (what the pure plans need), islands excepted.

    Returns the hook handles (``remove()`` each to undo). Float64 inputs are cast too. An
    fp32 island that receives one of those inputs directly (an island as the first
    layer) gets the original fp32 value, not the rounded one (1e5 stays 1e5 under fp16);
    a model that is itself an island gets its inputs unchanged.

    Only calls of ``model`` itself are hooked: a framework that calls its submodules from
    elsewhere (a LightningModule's ``training_step`` calling ``self.net(x)``) casts the
    batch itself (:func:`cast_inputs`; see :mod:`mixprec.integrations.lightning`).

    The hooks hold the dtype, nothing else: ``copy.deepcopy(model)`` and a pickled model
    (``torch.save``) cast their inputs the same way.
    """
    if isinstance(model, FP32Island):
        return []
    return [
        model.register_forward_pre_hook(InputCast(dtype).before, with_kwargs=True),
        model.register_forward_hook(end_input_cast, always_call=True),
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
