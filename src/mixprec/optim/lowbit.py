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
expanded to fp32 (with its gradient and optimizer state) into a proxy parameter, the
inner optimizer runs its usual fp32 math on the proxy, and the result is stored back in
low precision; the parameters' ``data`` and ``grad`` are never swapped (DDP's hooks stay
attached). ``torch.optim.Adam``, ``AdamW`` and ``SGD`` take a multi-tensor fast path
(:mod:`mixprec.optim.fast`) with the same results and state. Between steps optimizer
state is kept in ``state_dtype`` (bf16 by default, halving its memory). The rounding variants
live in :mod:`mixprec.optim.kahan` and :mod:`mixprec.optim.stochastic`, steps skipped on the device
in :mod:`mixprec.optim.skipping`.

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

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar

import torch

from mixprec.compiling import check_environment
from mixprec.dtypes import LOW_PRECISION_DTYPES
from mixprec.optim import checks, codecs, footprint, generic, routing, shards
from mixprec.optim import states as qstates
from mixprec.optim.base import WrappedOptimizer
from mixprec.optim.compiled import CompileSetting, RemainderIO, check_compile_setting
from mixprec.optim.fast import Piece, default_chunk_numel, fast_kind
from mixprec.optim.loads import keep_state_dtype
from mixprec.optim.skipping import DeviceSkipping
from mixprec.optim.snapshot import Snapshot, all_or_nothing

__all__ = ["LowPrecisionOptimizer"]


class LowPrecisionOptimizer(DeviceSkipping, WrappedOptimizer):
    """Low-precision weights and state, fp32 arithmetic inside ``step()``, round-to-nearest store.

    The inner optimizer's math runs on fp32 expansions of the bf16/fp16 parameters,
    gradients and state, so constants such as Adam's ``eps=1e-8`` (zero in fp16) and
    small second moments do not break it; results are rounded back. Updates smaller
    than half a unit in the last place are still lost: see :class:`KahanOptimizer` and
    :class:`StochasticRoundingOptimizer`.

    Args:
        optimizer: any torch optimizer; its fp32 parameters are stepped as usual.
        state_dtype: dtype the optimizer state of low-precision parameters is kept in
            between steps (None: fp32; ``"8bit"``: 8-bit blockwise, :mod:`mixprec.optim.states`).
        fast: use the multi-tensor fast path (:mod:`mixprec.optim.fast`) for
            ``torch.optim.Adam``, ``AdamW`` and ``SGD`` param groups it supports; other
            optimizers and options (``capturable``, ``differentiable``, ``fused``) take the
            generic per-parameter path either way. Both keep the same state under torch's
            key names, so state_dicts move freely between them.
        chunk_numel: the fast path expands at most this many elements to fp32 at a time (a
            larger contiguous parameter is cut into pieces). None: 2**17 on CPU, where small
            chunks keep the fp32 temporaries in the caches, 2**22 elsewhere.
        fused: on the fast path, run Adam/AdamW's arithmetic in torch's fused kernel (one
            pass; CPU and CUDA) rather than torch's foreach sequence (bit-identical to the
            generic path on CPU, several passes). Fused results equal the generic path's
            within fp32 rounding: a stored weight or moment can differ by one unit in the
            last place of its dtype where the fp32 result lies next to a rounding boundary.
        compile: which executor steps Adam/AdamW groups (:func:`mixprec.optim.routing.plan`):
            ``True`` the compiled route (:func:`~mixprec.optim.compiled.compiled_adam_step`: one
            ``torch.compile``-d loop per parameter, nothing materialised in fp32, within fp32
            rounding of the generic path; the first step compiles), ``False`` the eager fast path,
            ``"auto"`` (the default) the native C kernel on the CPU for 8-bit moments and remainder
            masters with bf16 moments (:func:`~mixprec.optim.native.use_native_route`) and the
            compiled route for the Kahan and stochastic-rounding stores and 8-bit moments of large
            groups (:func:`~mixprec.optim.compiled.use_compiled_route`), falling back to the eager
            path, with one warning, if compilation fails. Parameters with different step counts,
            or past 48 compiled layouts per process, step eagerly.

    The wrapper never changes a parameter's ``data`` or ``grad`` (DDP's gradient hooks
    and bucket views stay attached): the generic path runs the inner optimizer on fp32
    proxy parameters and moves their state back under the real parameters after each
    step. With fp16 parameters, whose range a finite update can overflow, ``step()``
    snapshots parameters and state first, and undoes an update that stores a non-finite
    weight (see :meth:`step_nonfinite` and :meth:`undo_step`).
    """

    _STATE_KEY = "mixprec_lowbit"
    #: how updated weights are stored (:mod:`mixprec.optim.codecs`): nearest, kahan, stochastic, remainder
    rounding: ClassVar[str] = "nearest"
    #: the least the fast path expands at a time on the CPU when ``chunk_numel`` is None
    #: (the CPU default keeps a chunk in the caches; a wrapper with more host work per chunk
    #: raises it)
    cpu_chunk_numel: ClassVar[int] = 0
    _noise: codecs.Noise | None = None  # the stochastic-rounding noise of the call being stepped

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        state_dtype: torch.dtype | str | None = torch.bfloat16,
        fast: bool = True,
        chunk_numel: int | None = None,
        fused: bool = True,
        compile: CompileSetting = "auto",
    ) -> None:
        super().__init__(optimizer)
        self.state_dtype = qstates.parse_state_dtype(state_dtype)
        self.compile: CompileSetting = check_compile_setting(compile)
        if self.compile == "auto" and (self.rounding != "nearest" or qstates.block_codec(self.state_dtype)):
            check_environment()  # read at the first compiled step otherwise, mid-training
        for name, flag in (("fast", fast), ("fused", fused)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        self.fused = fused
        if chunk_numel is not None and (
            isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel < 1
        ):
            raise ValueError(
                f"chunk_numel must be a positive int (elements expanded to fp32 at a time) or None (the "
                f"device's default), got {chunk_numel!r}"
            )
        self.fast = fast
        self.chunk_numel = chunk_numel
        self._snapshot: Snapshot | None = None
        self._compiled_layouts: set[str] = set()  # layouts the compiled route took (checkpointed)
        self._layout_keys: dict[tuple[Any, ...], str] = {}  # (param ids, grad dtypes, options) -> layout
        self._index: dict[int, tuple[int, int]] = {}  # id(param) -> (group, position), for step_selected({param})
        self._nonfinite: torch.Tensor | None = None
        # factors this step's low-precision gradients still owe, applied to their fp32
        # expansions (a clip of :class:`RemainderOptimizer`, see ``scale_grads_later``)
        self._grad_scales: list[torch.Tensor] = []
        # FSDP2: id(sharded parameter) -> (it, the plain stand-in of its local shard), see _step_shards
        self._shard_views: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}
        if any(shards.is_dtensor(p) for p in self._low_params()):
            shards.check_shardable(optimizer, self.state_dtype, type(self).__name__)

    def _low_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.params() if p.dtype in LOW_PRECISION_DTYPES]

    # ------------------------------------ expand / store: the weight codec, many pieces or one parameter
    def _expand_into(self, param: torch.Tensor, out: torch.Tensor) -> None:
        self._expand_many([Piece(param, 0, param.numel())], [out])

    def _store(self, param: torch.Tensor, value32: torch.Tensor) -> None:
        self._store_many([Piece(param, 0, param.numel())], [value32], value32.view(-1))  # contiguous scratch

    def _expand_many(self, pieces: list[Piece], values: list[torch.Tensor]) -> None:
        codecs.nearest_load(pieces, values)

    def _store_many(self, pieces: list[Piece], values: list[torch.Tensor], flat: torch.Tensor) -> None:
        codecs.nearest_store(pieces, values)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step: fp32 parameters by the inner optimizer, low-precision ones expanded.

        Low-precision parameters without a gradient are left alone (as torch does).
        Supported torch optimizers take the multi-tensor fast path, chunk by chunk; the
        others are stepped one parameter at a time on fp32 proxies whose scratch memory
        is reused from parameter to parameter (the inner optimizer's step hooks then run
        once per low-precision parameter).
        """
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step() does not take a closure; compute the loss before step()")
        if shards.zero_step(self):  # an FSDP2 checkpoint's step that only creates state
            return None
        guarded = any(p.dtype == torch.float16 for p in self._low_params())
        self.follow_writes(self._low_params())  # before the snapshot: an undo must not bring back a stale residual
        self._snapshot = Snapshot(self.optimizer, self.kinds, extra=self.rounding_state()).add(
            [p for p in self.params() if p.grad is not None]  # what the step can change (not a frozen base)
        ) if guarded else None
        self._nonfinite = None
        result = self.step_selected(None)
        self._grad_scales = []  # applied (kept by an interrupted step: a retry still owes them)
        if self._snapshot is not None:
            self._nonfinite = self._snapshot.became_nonfinite()
            if bool(self._nonfinite):
                self._restore(self._snapshot)
        return result

    def _init_kinds(self, params: list[torch.nn.Parameter]) -> None:
        """Create what a first step creates beside the optimizer's state for ``params``
        (compensation, rounding noise), changing nothing (see :func:`mixprec.optim.shards.zero_step`)."""

    @torch.no_grad()
    def step_selected(self, selected: set[torch.Tensor] | None) -> Any:
        """Step every parameter with a gradient, or only those in ``selected`` (no overflow
        guard, no snapshot: :class:`~mixprec.optim.InBackwardOptimizer` keeps its own copies)."""
        self.settle()  # a step decided on the device before: counted first
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        picked = saved if selected is None else self._pick(saved, selected)
        low = [[p for p in params if p.dtype in LOW_PRECISION_DTYPES] for params in picked]
        written = [p for params in low for p in params]
        stepped = [p for params in picked for p in params if p.grad is not None]
        self.kinds.before_step(stepped)
        self.follow_writes(written)
        scratch: dict[tuple[int, torch.device], torch.Tensor] = {}
        result = None
        try:
            for group, params in zip(groups, picked, strict=True):
                group["params"] = [p for p in params if p.dtype not in LOW_PRECISION_DTYPES]
            if selected is None or any(group["params"] for group in groups):
                result = self._step_full_precision()
            for group in groups:
                group["params"] = []
            for group, params in zip(groups, low, strict=True):
                active = [p for p in params if p.grad is not None]
                if not active:
                    continue
                group["params"] = active
                kind = self._fast_kind(group)
                sharded = [p for p in active if shards.is_dtensor(p)]
                if sharded:  # FSDP2: each rank steps its own shards; plain parameters as usual
                    self._step_shards(group, sharded, kind, scratch)
                    active = group["params"] = [p for p in active if not shards.is_dtensor(p)]
                    if not active:
                        group["params"] = []
                        continue
                routing.run_group(self, group, active, kind, scratch, whole_step=selected is None)
                group["params"] = []
        finally:
            for group, params in zip(groups, saved, strict=True):
                group["params"] = params
            self.note_written(written)
        self.kinds.after_step(stepped)  # the state kinds' own rules (none of the built-in kinds has one)
        return result

    def _step_shards(self, group: dict[str, Any], active: list[torch.nn.Parameter], kind: str | None,
                     scratch: generic.Scratch) -> None:
        """``active`` (FSDP2 DTensors) stepped as their local shards (:mod:`mixprec.optim.shards`),
        on the route an unsharded step takes (compiled, fast or generic)."""
        shards.check_shardable(self.optimizer, self.state_dtype, type(self).__name__)
        added = sorted(set(self.kinds.kinds) - {k.name for k in type(self).state_kinds})
        if added:
            raise ValueError(
                f"{type(self).__name__}: state kinds added with add_state_kind ({', '.join(added)}) are not supported "
                "on FSDP2 shards (their tensors would be made whole, not sharded); train unsharded, or drop them"
            )
        with shards.ShardViews(self.optimizer, active, self._shard_cache()) as views:
            group["params"] = views
            routing.run_group(self, group, views, kind, scratch, whole_step=True)

    def __getstate__(self) -> dict[str, Any]:
        self.settle()
        state = dict(super().__getstate__())
        state["_shard_views"] = {}  # stand-ins of this run's shards: a copy makes its own
        return state

    def _shard_cache(self) -> dict[int, tuple[torch.Tensor, torch.nn.Parameter]]:
        cache = self.__dict__.get("_shard_views")
        if cache is None:  # (a wrapper pickled before shards were stepped)
            cache = self._shard_views = {}
        return cache

    def _chunk_limit(self, device: torch.device) -> int:
        """Elements the fast path expands at a time on ``device``: ``chunk_numel``, else the
        device's default (:func:`~mixprec.optim.fast.default_chunk_numel`), at least
        :attr:`cpu_chunk_numel` on the CPU."""
        if self.chunk_numel:
            return self.chunk_numel
        default = default_chunk_numel(device)
        return max(default, self.cpu_chunk_numel) if device.type == "cpu" else default

    def _fast_kind(self, group: dict[str, Any]) -> str | None:
        return fast_kind(self.optimizer, group, fused=self.fused) if self.fast else None

    def follow_writes(self, params: Sequence[torch.Tensor]) -> None:
        """Before an update: bring what this wrapper keeps beside ``params`` in line with
        weights written from outside since it last wrote them (Kahan compensation; nothing
        for the other wrappers)."""

    def note_written(self, params: Sequence[torch.Tensor]) -> None:
        """``params`` were just written by this wrapper (a step, an undo, a load)."""

    def _pick(self, saved: list[list[Any]], selected: set[torch.Tensor]) -> list[list[Any]]:
        """``selected`` split by param group, in group order; one parameter (an update in backward)
        through a cached index, so a backward costs O(parameters), not O(parameters²)."""
        if len(selected) != 1:
            return [[p for p in params if p in selected] for params in saved]
        (param,) = selected
        picked: list[list[Any]] = [[] for _ in saved]
        where = self._index.get(id(param))
        if where is None or not _holds(saved, where, param):  # new or rearranged groups: index again
            self._index = {id(p): (i, j) for i, params in enumerate(saved) for j, p in enumerate(params)}
            where = self._index.get(id(param))
        if where is not None and _holds(saved, where, param):
            picked[where[0]].append(param)
        return picked

    # what the compiled and native routes round with: the compensation (or remainder) of a weight,
    # the stochastic-rounding noise of one call over ``params`` (``self._noise`` meanwhile), the ties
    # of remainder masters (:class:`~mixprec.optim.RemainderOptimizer`); the subclasses give theirs
    def _compiled_rounding_inputs(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return None

    def _noise_for(self, params: list[torch.nn.Parameter]) -> AbstractContextManager[codecs.Noise | None]:
        return nullcontext()

    def _compiled_remainder(self) -> RemainderIO | None:
        return None

    def _step_one(self, p: torch.nn.Parameter, group: dict[str, Any], scratch: generic.Scratch) -> None:
        """The generic path for ``p`` (:func:`mixprec.optim.generic.step_one`)."""
        generic.step_one(self.optimizer, p, group, scratch, expand=self._expand_into, store=self._store,
                         state_dtype=self.state_dtype, grad_scales=self._pending_grad_scales())

    def _pending_grad_scales(self) -> list[torch.Tensor]:
        return getattr(self, "_grad_scales", [])  # (a wrapper pickled before it had them)

    # ------------------------------------------------------------- overflow guard (fp16)
    def refuses_nonfinite(self) -> bool:
        """Whether steps are checked for non-finite stored weights (wrappers over fp16 parameters)."""
        return any(p.dtype == torch.float16 for p in self._low_params())

    def step_nonfinite(self) -> torch.Tensor | None:
        """After ``step()``: True when the update would have stored a non-finite weight (then undone).

        Only wrappers over fp16 parameters check (a finite fp32 result can exceed fp16's
        65504; bf16 has fp32's range): None otherwise. A weight that was already
        non-finite before the step does not count.
        """
        return None if self._snapshot is None else self._nonfinite

    def undo_step(self) -> None:
        """Restore parameters, state kinds (compensation), RNG and optimizer state (step counts
        included) to before the last ``step()``: after a step of a wrapper over fp16 parameters
        (those snapshot their state first); undoing twice, or an undone step, changes nothing more."""
        snapshot = self._snapshot
        if snapshot is not None:
            self._restore(snapshot)
        elif any(p.dtype == torch.float16 for p in self._low_params()):
            raise RuntimeError(f"{type(self).__name__}.undo_step() needs a step() to undo; none was taken since the last load")
        else:
            super().undo_step()

    def _restore(self, snapshot: Snapshot) -> None:
        if snapshot.restore():
            self.load_rounding_state(snapshot.extra)
        self.note_written(self._low_params())

    # ------------------------------------------------- compensation and rounding noise
    def compensation(self, param: torch.Tensor) -> torch.Tensor | None:
        """The Kahan compensation buffer of ``param`` (None: none kept, or ``param`` not stepped yet)."""
        return None

    def set_compensation(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Replace the compensation buffer of ``param`` (Kahan wrappers only)."""
        raise TypeError(f"{type(self).__name__} keeps no compensation buffers; only KahanOptimizer does")

    def drop_compensation(self, param: torch.Tensor) -> None:
        """Forget the compensation of ``param`` (the next step starts it at zero; no-op without one)."""

    def rounding_state(self) -> dict[str, Any]:
        """The state of the rounding noise (small; ``{}`` for deterministic rounding)."""
        return {}

    def load_rounding_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`rounding_state` returned."""

    # ------------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict[str, Any]:
        """This wrapper's own state besides the inner optimizer's (the rounding noise, the
        tensors of its state kinds by kind name): what :meth:`state_dict` stores under its own key."""
        self.settle()  # then, a weight written since its last step: its kinds follow
        self.follow_writes(self._low_params())
        out = {**self.rounding_state(), **self.kinds.state(list(self.params()))}
        if self.kinds:
            out[checks.KINDS_KEY] = sorted(self.kinds.kinds)
        return out

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` returned (checked first by :func:`~mixprec.optim.checks.check_kind_state`)."""
        self.load_rounding_state(extra)
        self.kinds.load(extra, list(self.params()))

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict and this wrapper's own entry (compensation, rounding
        noise, compiled layouts) under ``"mixprec_lowbit"``. Over FSDP2 shards the entry goes into
        the first param group instead, where ``torch.distributed.checkpoint``'s
        ``get_optimizer_state_dict`` (Fabric's and Lightning's sharded checkpoints) keeps it: it
        keeps only ``state`` and ``param_groups``. :meth:`load_state_dict` reads either place."""
        self.settle()  # (the step counts of a step skipped on the device)
        sd = self.optimizer.state_dict()
        extra = {**self.extra_state(), "compiled_layouts": sorted(self._compiled_layouts)}
        if sd.get("param_groups") and any(shards.is_dtensor(p) for p in self._low_params()):
            sd["param_groups"][0][self._STATE_KEY] = extra  # (torch's state_dict copies each group)
        else:
            sd[self._STATE_KEY] = extra
        return sd

    def check_state_dict(self, state_dict: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """What :meth:`load_state_dict` checks, changing nothing: (inner state_dict, this wrapper's entry)."""
        owner, params = type(self).__name__, list(self.params())
        sd, extra = checks.split_wrapper_state(checks.lift_wrapper_state(state_dict, self._STATE_KEY), self._STATE_KEY, owner)
        checks.check_rounding_state(extra, self.rounding, owner)
        checks.check_kind_state(self.kinds, extra, params, owner)
        checks.check_inner_state_dict(self.optimizer, sd)
        checks.check_state_shapes(params, sd)
        return sd, extra

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the inner optimizer's state and this wrapper's own (compensation, rounding
        noise); all or nothing: a refused state_dict (ValueError/TypeError) changes nothing."""
        sd, extra = self.check_state_dict(state_dict)
        params, owner = list(self.params()), type(self).__name__
        with all_or_nothing(self.optimizer, self, what=f"cannot load this {owner} state_dict"):
            self.optimizer.load_state_dict(sd)
            keep_state_dtype(self.optimizer, params, sd, self.state_dtype)  # torch cast it to the params' dtype
            self._compiled_layouts = routing.loaded_layouts(self, extra.get("compiled_layouts", []), params)
            self.load_extra_state(extra)
        self._snapshot = self._unsettled = None
        self.note_written(self._low_params())  # the loaded compensation stands for the weights as they are

    # ------------------------------------------------------------------ memory facts
    def state_bytes(self) -> dict[str, int]:
        """The inner optimizer's state: low-precision parameters' per-element state in
        ``state_dtype`` (predicted before the first step), the rest as the optimizer keeps it."""
        total = footprint.low_precision_state_bytes(self.optimizer, list(self.params()), self._low_params(), self.state_dtype)
        return self.kind_bytes({"optimizer_state": total})

    def step_transient_bytes(self) -> int:
        """Peak temporaries of one :meth:`step`, as it runs them
        (:func:`mixprec.optim.footprint.low_precision_step_transient`)."""
        return footprint.low_precision_step_transient(
            self.optimizer, state_dtype=self.state_dtype, fast=self.fast, fused=self.fused, compile=self.compile,
            chunk_numel=self._chunk_limit(low[0].device) if (low := self._low_params()) else self.chunk_numel,
            rounding=self.rounding,
            snapshot_extra=sum(self.kinds.bytes_by_category(self.params()).values()),
        )


def _holds(saved: list[list[torch.Tensor]], where: tuple[int, int], param: torch.Tensor) -> bool:
    group, position = where
    return group < len(saved) and position < len(saved[group]) and saved[group][position] is param
