"""Loss scalers from other systems' own configuration keys: DeepSpeed, Paddle, Megatron-LM, apex.

Each preset takes the keys as that system's users have them (a DeepSpeed JSON config,
``paddle.amp.GradScaler``'s arguments or Fleet's ``amp_configs``, Megatron's
``OptimizerConfig`` fields, ``amp.initialize``'s arguments), refuses a key it does not know
(naming it and the accepted ones), and returns the scaler whose scale sequence is that
system's, bit for bit, for the same overflow pattern: a :class:`~mixprec.DynamicLossScaler`,
or a :class:`~mixprec.ConstantLossScaler` / :class:`~mixprec.NoOpScaler` where the
configuration asks for a static scale or no scaling. Keys of the same configuration that
do not concern the scaler (op lists, casting, ``opt_level``...) are accepted and left to
:func:`~mixprec.get_plan`.

Where a system multiplies the scale by its factors in fp32 (Paddle, Megatron), the preset
rounds the factors to fp32: mixprec's fp64 product of two fp32 numbers is exact, so its
single rounding to fp32 is that fp32 multiply. DeepSpeed and apex double and halve a Python
float: exact in fp32 too, within the fp32 range.

>>> from mixprec import DynamicLossScaler
>>> ds = {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2,
...                "hysteresis": 2, "consecutive_hysteresis": True}, "zero_optimization": {"stage": 2}}
>>> DynamicLossScaler.from_deepspeed(ds)
DynamicLossScaler(scale=256.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=2, hysteresis_mode='deepspeed', min_scale=1.0, max_scale=None, growth_delay=1, raise_at_min_scale=True, enabled=True)
>>> DynamicLossScaler.from_paddle(decr_ratio=0.8).get_backoff_factor()  # fp32(0.8), as Paddle multiplies
0.800000011920929
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection, Mapping
from typing import Any, cast

from mixprec.scaling import _checks as checks
from mixprec.scaling._checks import show
from mixprec.scaling.base import LossScaler
from mixprec.scaling.constant import ConstantLossScaler, NoOpScaler

__all__ = ["ScalerPresets"]

# DeepSpeed: deepspeed/runtime/precision_config.py (DeepSpeedFP16Config), with its defaults.
_DEEPSPEED = {
    "enabled": True,  # DeepSpeed's default is False; a section given to a scaler preset is meant to scale
    "auto_cast": False,
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
    "fp16_master_weights_and_grads": False,
}
# Paddle: python/paddle/amp/grad_scaler.py (GradScaler) and python/paddle/static/amp/decorator.py
# (decorate; Fleet's DistributedStrategy.amp_configs has the same scaling keys and defaults).
_PADDLE = {
    "dygraph": {
        "enable": True, "init_loss_scaling": 2.0**16, "incr_ratio": 2.0, "decr_ratio": 0.5,
        "incr_every_n_steps": 2000, "decr_every_n_nan_or_inf": 1, "use_dynamic_loss_scaling": True,
    },
    "static": {
        "init_loss_scaling": 2.0**15, "incr_ratio": 2.0, "decr_ratio": 0.8, "incr_every_n_steps": 1000,
        "decr_every_n_nan_or_inf": 2, "use_dynamic_loss_scaling": True,
    },
}
_PADDLE_OTHER = {  # accepted, not about the scaler: op lists and casting (get_plan's business)
    "dygraph": (),
    "static": ("custom_white_list", "custom_black_list", "custom_black_varnames", "use_pure_fp16",
               "use_fp16_guard", "use_pure_bf16", "use_bf16", "use_promote", "amp_lists"),
}
# Megatron-LM: megatron/core/optimizer/grad_scaler.py (DynamicGradScaler's arguments) and the
# loss-scaling fields of megatron/core/optimizer/optimizer_config.py (OptimizerConfig, = the CLI).
_MEGATRON = {
    "initial_scale": 2.0**32, "min_scale": 1.0, "growth_factor": 2.0, "backoff_factor": 0.5,
    "growth_interval": 1000, "hysteresis": 2, "loss_scale": None,
}
_MEGATRON_SYNONYMS = {"initial_loss_scale": "initial_scale", "min_loss_scale": "min_scale",
                      "loss_scale_window": "growth_interval"}
# apex: apex/amp/scaler.py (LossScaler) and apex/amp/frontend.py (initialize), before apex removed amp.
_APEX = {
    "loss_scale": None, "init_scale": 2.0**16, "scale_factor": 2.0, "scale_window": 2000,
    "min_loss_scale": None, "max_loss_scale": 2.0**24,
}
_APEX_OTHER = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
               "master_weights", "cast_model_outputs", "num_losses", "verbosity")

_Recipe = dict[str, Any] | LossScaler


class ScalerPresets:
    """Mixin of :class:`~mixprec.DynamicLossScaler`: constructors from other systems' configurations."""

    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any], *, zero_stage: int | None = None) -> LossScaler:
        """The scaler of a DeepSpeed run, from its JSON config (the whole config, or its ``"fp16"`` section).

        ``loss_scale`` 0 (dynamic) gives a DynamicLossScaler, as DeepSpeed's
        ``DynamicLossScaler`` (``deepspeed/runtime/fp16/loss_scaler.py``, ``update_scale``):
        scale ``2**initial_scale_power``, doubled (``scale_factor`` is fixed at 2) when
        ``(cur_iter - last_overflow_iter) - 1`` is a positive multiple of ``loss_scale_window``,
        that is on the ``window + 1``-th clean step after the start or an overflow, then every
        ``window`` steps (``growth_delay=1``); halved down to ``min_loss_scale``.
        ``hysteresis`` overflows are tolerated: ``consecutive_hysteresis=True`` refills the
        budget on every clean step (``hysteresis_mode="deepspeed"``), False only when the
        scale grows (``"since_growth"``); once spent every overflow backs off. An overflow
        that would back off a scale already at ``min_loss_scale`` raises (DeepSpeed's
        ``raise_error_at_min_scale``). That is ZeRO stages 1-3; without ZeRO (stage 0,
        ``FP16_Optimizer``) DeepSpeed ignores the hysteresis keys and never raises. The stage
        is read from ``config["zero_optimization"]["stage"]`` when the whole config is given
        (0 when absent, as in DeepSpeed), else from ``zero_stage`` (None: ZeRO).

        ``loss_scale`` > 0 gives ``ConstantLossScaler(loss_scale)``; ``"enabled": false``
        gives ``NoOpScaler()`` (a missing ``"enabled"`` counts as true here).
        """
        return _build(cls, "from_deepspeed", _deepspeed(config, zero_stage))

    @classmethod
    def from_paddle(
        cls, config: Mapping[str, Any] | None = None, /, *, api: str = "dygraph", **keys: Any
    ) -> LossScaler:
        """The scaler of a Paddle run, from a mapping and/or keyword arguments with Paddle's names.

        ``api="dygraph"``: ``paddle.amp.GradScaler``'s arguments and defaults (``enable``,
        ``init_loss_scaling=2**16``, ``incr_ratio=2.0``, ``decr_ratio=0.5``,
        ``incr_every_n_steps=2000``, ``decr_every_n_nan_or_inf=1``,
        ``use_dynamic_loss_scaling``); its ``_update`` (eager mode, in Python) multiplies the
        fp32 scale tensor, with no lower bound: the scale can go below 1 there, and does here.
        ``api="static"``: ``paddle.static.amp.decorate`` and Fleet's ``strategy.amp_configs``
        (defaults 2**15, 2.0, 0.8, 1000, 2); its ``update_loss_scaling`` kernel
        (``paddle/phi/kernels/impl/amp_kernel_impl.h``) floors a backoff at 1
        (``new_scale < 1 ? 1 : new_scale``), so ``min_scale=1.0``: the scale never goes below
        1.0, a backoff that would gives exactly 1.0, and an overflow at 1.0 skips its step
        without an error (``raise_at_min_scale`` stays False) while clean steps train on, as
        Paddle keeps running at 1 (an ``init_loss_scaling`` below 1, which the kernel only
        raises to 1 at the first backoff, is refused). Both back off after
        ``decr_every_n_nan_or_inf`` consecutive overflows (``hysteresis_mode="consecutive"``)
        and grow on the ``incr_every_n_steps``-th clean step; the ratios are rounded to fp32,
        as Paddle multiplies in fp32. ``use_dynamic_loss_scaling=False`` gives
        ``ConstantLossScaler(init_loss_scaling)``, ``enable=False`` ``NoOpScaler()``.
        """
        if api not in _PADDLE:
            raise ValueError(f"from_paddle(api={show(api)}): pass api='dygraph' (paddle.amp.GradScaler) or "
                             "api='static' (paddle.static.amp.decorate, Fleet's strategy.amp_configs)")
        return _build(cls, "from_paddle", _paddle(_gather(f"Paddle ({api})", config, keys), api))

    @classmethod
    def from_megatron(cls, config: Mapping[str, Any] | None = None, /, **keys: Any) -> LossScaler:
        """The scaler of a Megatron-LM run, from ``DynamicGradScaler``'s or ``OptimizerConfig``'s names.

        ``initial_scale`` (``initial_loss_scale``, default 2**32), ``min_scale``
        (``min_loss_scale``, 1.0), ``growth_factor`` (2.0), ``backoff_factor`` (0.5),
        ``growth_interval`` (``loss_scale_window``, 1000), ``hysteresis`` (2), ``loss_scale``
        (None). As ``megatron/core/optimizer/grad_scaler.py``: each overflow spends one of
        ``hysteresis``, once spent every overflow backs off, a growth refills it
        (``hysteresis_mode="since_growth"``); the factors are fp32 tensors there, so they are
        rounded to fp32 here. A ``loss_scale`` (truthy) gives ``ConstantLossScaler(loss_scale)``.
        """
        return _build(cls, "from_megatron", _megatron(_gather("Megatron-LM", config, keys)))

    @classmethod
    def from_apex(cls, config: Mapping[str, Any] | None = None, /, **keys: Any) -> LossScaler:
        """The scaler of an apex ``amp`` run, from ``amp.initialize``'s / ``LossScaler``'s arguments.

        ``loss_scale="dynamic"`` (the default of ``opt_level`` O1 and O2; O0 and O3 default to
        1.0) gives a DynamicLossScaler as ``apex/amp/scaler.py``: ``init_scale`` (2**16)
        capped at ``max_loss_scale`` (2**24), doubled on the ``scale_window``-th (2000) clean
        step up to ``max_loss_scale``, halved on each overflow down to ``min_loss_scale``
        (None or 0: no bound). apex never used ``scale_factor`` (it always doubles and
        halves), so only 2.0 is accepted. A number (or numeric string) gives
        ``ConstantLossScaler(loss_scale)``; ``enabled=False`` ``NoOpScaler()``.
        """
        return _build(cls, "from_apex", _apex(_gather("apex", config, keys)))


# ------------------------------------------------------------------ reading keys
def _gather(system: str, config: object, keys: Mapping[str, Any]) -> dict[str, Any]:
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"{system} configuration must be a mapping (a dict of its keys), got {type(config).__name__}")
    merged = dict(config or {})
    twice = sorted(k for k in keys if k in merged)
    if twice:
        raise ValueError(f"{system} keys {twice} are given both in the mapping and as keyword arguments; pass each once")
    merged.update(keys)
    return merged


def _known(system: str, settings: Mapping[Any, Any], accepted: Collection[str], hint: str = "") -> None:
    unknown = [k for k in settings if not isinstance(k, str) or k not in accepted]
    if unknown:
        raise ValueError(
            f"{system} configuration has unknown key(s) {', '.join(show(k) for k in unknown)}; "
            f"the accepted keys are {sorted(accepted)}{hint}"
        )


def _auto(name: str, value: object) -> str:
    if value == "auto":
        return f"; {name}='auto' is a placeholder Hugging Face fills in from TrainingArguments: pass the resolved value"
    return ""


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {show(value)} ({type(value).__name__}){_auto(name, value)}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {show(value)}")
    return x


def _int(name: str, value: object) -> int:
    x = _number(name, value)
    if x != int(x):
        raise ValueError(f"{name} must be an integer, got {show(value)}")
    return int(x)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be true or false, got {show(value)} ({type(value).__name__}){_auto(name, value)}")
    return value


def _constant(system: str, name: str, value: float) -> ConstantLossScaler:
    try:
        return ConstantLossScaler(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{system}: {name}={show(value)} as a constant scale: {exc}") from None


def _build(cls: type, call: str, recipe: _Recipe) -> LossScaler:
    if isinstance(recipe, LossScaler):
        return recipe
    make = cast(Callable[..., LossScaler], cls)
    try:
        return make(**recipe)
    except (TypeError, ValueError) as exc:
        shown = ", ".join(f"{k}={v!r}" for k, v in recipe.items())
        raise type(exc)(f"{call}(): the keys translate to DynamicLossScaler({shown}), which refuses them: {exc}") from None


# ------------------------------------------------------------------ translations
def _deepspeed(config: object, zero_stage: int | None) -> _Recipe:
    if not isinstance(config, Mapping):
        raise TypeError(f"from_deepspeed() takes a DeepSpeed config (a dict), got {type(config).__name__}")
    stage: int | None = zero_stage
    section: object = config
    if "fp16" in config:  # the whole config: read its fp16 section and its ZeRO stage (0 when absent)
        section = config["fp16"]
        zero = config.get("zero_optimization") or {}
        saved = _int("zero_optimization.stage", zero.get("stage", 0) if isinstance(zero, Mapping) else zero)
        if zero_stage is not None and zero_stage != saved:
            raise ValueError(f"from_deepspeed(zero_stage={zero_stage}) contradicts the config's "
                             f"zero_optimization.stage={saved}; drop one")
        stage = saved
        if not isinstance(section, Mapping):
            raise TypeError(f"the DeepSpeed config's 'fp16' entry must be a dict, got {type(section).__name__}")
    if stage is not None and _int("zero_stage", stage) not in (0, 1, 2, 3):
        raise ValueError(f"the ZeRO stage must be 0, 1, 2 or 3, got {show(stage)}")
    _known("DeepSpeed fp16", cast(Mapping[Any, Any], section), _DEEPSPEED,
           "; pass the 'fp16' section of a DeepSpeed config, or the whole config (with an 'fp16' key)")
    fp16 = {**_DEEPSPEED, **cast(Mapping[str, Any], section)}
    if not _bool("fp16.enabled", fp16["enabled"]):
        return NoOpScaler()
    _bool("fp16.auto_cast", fp16["auto_cast"])
    _bool("fp16.fp16_master_weights_and_grads", fp16["fp16_master_weights_and_grads"])
    loss_scale = _number("fp16.loss_scale", fp16["loss_scale"])
    if loss_scale < 0:
        raise ValueError(f"fp16.loss_scale must be >= 0 (0 enables dynamic loss scaling), got {show(loss_scale)}")
    if loss_scale != 0:  # DeepSpeedEngine.dynamic_loss_scale(): loss_scale == 0
        return _constant("from_deepspeed", "fp16.loss_scale", loss_scale)
    power = _int("fp16.initial_scale_power", fp16["initial_scale_power"])
    if not -126 <= power <= 127:
        raise ValueError(f"fp16.initial_scale_power={power} puts 2**{power} outside the fp32 scale range; "
                         "pass a power in [-126, 127] (DeepSpeed's default is 16)")
    zero_path = stage is None or stage >= 1  # stage 0: FP16_Optimizer._update_scale, no hysteresis, no raise
    return {
        "init_scale": 2.0**power,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": _int("fp16.loss_scale_window", fp16["loss_scale_window"]),
        "hysteresis": _int("fp16.hysteresis", fp16["hysteresis"]) if zero_path else 1,
        "hysteresis_mode": "deepspeed" if _bool("fp16.consecutive_hysteresis", fp16["consecutive_hysteresis"])
        else "since_growth",
        "min_scale": _number("fp16.min_loss_scale", fp16["min_loss_scale"]),
        "growth_delay": 1,
        "raise_at_min_scale": zero_path,
    }


def _paddle(settings: dict[str, Any], api: str) -> _Recipe:
    defaults = _PADDLE[api]
    hint = "" if api == "static" else "; for Fleet's strategy.amp_configs or paddle.static.amp.decorate pass api='static'"
    _known(f"Paddle ({api})", settings, (*defaults, *_PADDLE_OTHER[api]), hint)
    p = {**defaults, **settings}
    if not _bool("enable", p.get("enable", True)):
        return NoOpScaler()
    init = _number("init_loss_scaling", p["init_loss_scaling"])
    if not _bool("use_dynamic_loss_scaling", p["use_dynamic_loss_scaling"]):
        return _constant("from_paddle", "init_loss_scaling", init)
    return {
        "init_scale": init,
        "growth_factor": checks.fp32(_number("incr_ratio", p["incr_ratio"])),
        "backoff_factor": checks.fp32(_number("decr_ratio", p["decr_ratio"])),
        "growth_interval": _int("incr_every_n_steps", p["incr_every_n_steps"]),
        "hysteresis": _int("decr_every_n_nan_or_inf", p["decr_every_n_nan_or_inf"]),
        "hysteresis_mode": "consecutive",
        "min_scale": 1.0 if api == "static" else None,
    }


def _megatron(settings: dict[str, Any]) -> _Recipe:
    _known("Megatron-LM", settings, (*_MEGATRON, *_MEGATRON_SYNONYMS))
    p = dict(_MEGATRON)
    for key, value in settings.items():
        name = _MEGATRON_SYNONYMS.get(key, key)
        if name != key and name in settings:
            raise ValueError(f"Megatron-LM keys {key!r} and {name!r} are the same setting; pass one of them")
        p[name] = value
    loss_scale = p["loss_scale"]
    if loss_scale is not None and _number("loss_scale", loss_scale):  # get_megatron_optimizer: `if config.loss_scale`
        return _constant("from_megatron", "loss_scale", _number("loss_scale", loss_scale))
    return {
        "init_scale": _number("initial_scale", p["initial_scale"]),
        "growth_factor": checks.fp32(_number("growth_factor", p["growth_factor"])),
        "backoff_factor": checks.fp32(_number("backoff_factor", p["backoff_factor"])),
        "growth_interval": _int("growth_interval", p["growth_interval"]),
        "hysteresis": _int("hysteresis", p["hysteresis"]),
        "hysteresis_mode": "since_growth",
        "min_scale": _number("min_scale", p["min_scale"]),
    }


def _apex(settings: dict[str, Any]) -> _Recipe:
    _known("apex", settings, (*_APEX, *_APEX_OTHER))
    if not _bool("enabled", settings.get("enabled", True)):
        return NoOpScaler()
    opt_level = settings.get("opt_level", "O1")
    if opt_level not in ("O0", "O1", "O2", "O3"):
        raise ValueError(f"opt_level must be 'O0', 'O1', 'O2' or 'O3', got {show(opt_level)}")
    p = {**_APEX, **settings}
    loss_scale = p["loss_scale"]
    if loss_scale is None:  # frontend.py: O1 and O2 default to "dynamic", O0 and O3 to 1.0
        loss_scale = "dynamic" if opt_level in ("O1", "O2") else 1.0
    if loss_scale != "dynamic":
        if isinstance(loss_scale, str):  # Properties.__setattr__: float(value)
            try:
                loss_scale = float(loss_scale)
            except ValueError:
                raise ValueError(f"loss_scale must be 'dynamic' or a number, got {show(loss_scale)}") from None
        return _constant("from_apex", "loss_scale", _number("loss_scale", loss_scale))
    if _number("scale_factor", p["scale_factor"]) != 2.0:
        raise ValueError(
            f"scale_factor={show(p['scale_factor'])}: apex's LossScaler stores scale_factor but its update_scale "
            "always doubles and halves, so an apex run grew by 2 whatever it said; pass scale_factor=2.0 or omit "
            "it (for another factor build DynamicLossScaler(growth_factor=...) yourself)"
        )
    init = _number("init_scale", p["init_scale"])
    cap = None if p["max_loss_scale"] is None else _number("max_loss_scale", p["max_loss_scale"])
    floor = None if not p["min_loss_scale"] else _number("min_loss_scale", p["min_loss_scale"])
    return {
        "init_scale": init if cap is None else min(cap, init),  # LossScaler.__init__: min(max_loss_scale, init_scale)
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": _int("scale_window", p["scale_window"]),
        "min_scale": floor,
        "max_scale": cap,
    }
