"""What the running torch's autocast does with each op, found by running the op.

The dispatcher says which ops torch gives an autocast kernel, not which class the
kernel applies. The probe finds the class from the dtypes that come out: each op's
sample call (:mod:`mixprec.amp.samples`) runs under autocast on a few elements,

- with float32 inputs: a low-precision output means ``low``;
- with low-precision inputs: a float32 output means ``fp32``;
- with both kinds mixed, in either order: a float32 output, where uniform inputs keep
  their dtype, means ``promote``;
- "unsafe to autocast" means autocast refuses the op.

Anything else (the sample fails, no floating result, no sample for the op, or the
overload it calls has no autocast kernel here) leaves the op *unresolved*: its pinned
class stands. Complex results count as their real dtype; an op with only integer
results (``linalg_matrix_rank``) is read by the dtype its first computation gets.

The probe runs on the CPU always, and on CUDA once CUDA is initialized in the process
(it never initializes a GPU itself: in a multi-process job that would put a context on
the wrong device); until then the CUDA tables are the pinned classes of the ops torch
registers. It runs with torch-function and dispatch modes, gradients and other autocast
regions set aside, so nothing around it sees or changes it, and it uses its own seeded
generators, never torch's global one. ``simulate=True`` runs it on fake tensors of the
device instead (no GPU needed, but ``torch._subclasses.fake_tensor`` imports the
compiler, about a second): tests check the CUDA samples that way on a CPU-only machine.

:func:`probe_table` is the table source :mod:`mixprec.amp` installs in
:func:`mixprec.policy.set_torch_table_source`; it runs once per process, device type and
dtype (a few hundred sample calls of a few elements: well under a second on a CPU).

>>> import torch
>>> from mixprec.amp.probe import classify_op
>>> classify_op("mm", "cpu", torch.bfloat16), classify_op("cat", "cpu", torch.bfloat16)
(<Precision.LOW: 'low'>, <Precision.PROMOTE: 'promote'>)
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from mixprec.amp.samples import PYTHON_CALLS, SAMPLES, Builder, SampleInputs
from mixprec.policy import OpTable, Precision

__all__ = ["REFUSED", "Outcome", "can_probe", "classify_op", "probe_table"]

#: An op autocast refuses to run ("unsafe to autocast").
REFUSED: Literal["refused"] = "refused"
#: A probe's answer for one op: its class, :data:`REFUSED`, or None (unresolved).
Outcome = Precision | Literal["refused"] | None

_FP32 = torch.float32
_REAL_OF_COMPLEX = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def can_probe(device_type: str) -> str | None:
    """None when the probe can run ops on ``device_type`` now, else why not."""
    if device_type == "cpu":
        return None
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device"
        if not torch.cuda.is_initialized():
            return "CUDA is not initialized in this process yet"
        if torch.cuda.is_current_stream_capturing():
            return "a CUDA graph is being captured"
        return None
    return f"the probe has no samples for device type {device_type!r}"


def _autocast_key(device_type: str) -> str:
    return "Autocast" + torch._C._dispatch_key_for_device(device_type)


def _sample(op: str, device_type: str) -> tuple[Any, Builder] | None:
    """The op's sample overload and builder, if it has one and that overload has an
    autocast kernel on ``device_type`` in this torch."""
    entry = SAMPLES.get(op)
    if entry is None:
        return None
    try:
        overload = getattr(getattr(torch.ops.aten, op), entry[0])
    except (AttributeError, RuntimeError):  # not an op, or not that overload, in this torch
        return None
    try:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), _autocast_key(device_type)):
            return None
    except (AttributeError, RuntimeError):  # the dispatcher does not say: try it
        pass
    return PYTHON_CALLS.get(op, overload), entry[1]


def _floating_dtype(value: Any) -> torch.dtype | None:
    """The dtype of the first floating (or complex: its real dtype) tensor in ``value``."""
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            return _REAL_OF_COMPLEX.get(value.dtype)
        return value.dtype if value.is_floating_point() else None
    if isinstance(value, list | tuple):
        for item in value:
            found = _floating_dtype(item)
            if found is not None:
                return found
    return None


def _flat_tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, list | tuple):
            yield from _flat_tensors(value)


_CASTS = frozenset({"_to_copy", "to", "copy_", "clone", "empty_like", "_copy_from_and_resize"})


class _ComputeDtype(TorchDispatchMode):
    """Records the floating dtype the first computation (not a cast) of a call gets."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # else torch wraps __torch_dispatch__ and imports the compiler
        return False

    def __init__(self) -> None:
        super().__init__()
        self.dtype: torch.dtype | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.dtype is None and func.overloadpacket.__name__ not in _CASTS:
            for t in _flat_tensors((*args, *kwargs.values())):
                if t.is_floating_point():
                    self.dtype = t.dtype
                    break
        return func(*args, **kwargs)


@contextlib.contextmanager
def _autocast_on(device_type: str, dtype: torch.dtype) -> Iterator[None]:
    """Autocast on ``device_type`` with ``dtype`` and no weight-cast cache; then exactly as before.

    Set directly rather than through ``torch.autocast``, which refuses CUDA without a
    GPU (the simulated probe) and would share the caller's cast cache."""
    enabled, before, cache = (
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
        torch.is_autocast_cache_enabled(),
    )
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(cache)
        torch.set_autocast_dtype(device_type, before)
        torch.set_autocast_enabled(device_type, enabled)


@contextlib.contextmanager
def _fake_mode_quiet(mode: Any) -> Iterator[None]:
    """``mode`` entered, without its error log for ops that have no fake kernel for the
    device (those only stay unresolved here)."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with mode:
            yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _set_aside() -> Iterator[None]:
    """No torch-function or dispatch modes, no autograd, no warnings: the caller sees nothing."""
    with (
        torch._C.DisableTorchFunction(),  # first: no_grad itself is seen by torch-function modes
        _disable_current_modes(),
        warnings.catch_warnings(),
        torch.no_grad(),
    ):
        warnings.simplefilter("ignore")
        yield


_FAKE_MODE: list[Any] = []


def _fake_mode() -> Any:
    if not _FAKE_MODE:  # importing it imports the compiler: only when simulating
        from torch._subclasses.fake_tensor import FakeTensorMode

        _FAKE_MODE.append(FakeTensorMode())
    return _FAKE_MODE[0]


class _Runner:
    """Runs sample calls on ``device_type`` (real tensors, or fake ones when simulating)."""

    def __init__(self, device_type: str, dtype: torch.dtype, simulate: bool) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self._fake: Any = _fake_mode() if simulate else None

    def _convert(self, t: torch.Tensor, device: str, dtype: torch.dtype) -> torch.Tensor:
        if self._fake is None:
            return t.to(device=device, dtype=dtype)
        with self._fake:  # fake tensors carry no values: shape, dtype and device are what counts
            return torch.empty(t.shape, dtype=dtype, device=device)

    def output_dtype(
        self, op: Any, build: Builder, floating: Callable[[int], torch.dtype]
    ) -> tuple[torch.dtype | Literal["refused"] | None, int]:
        """The dtype the call's output comes in under autocast (None: failed or no floating
        result) and how many floating inputs it took."""
        inputs = SampleInputs(self.device_type, floating, self._convert)
        try:
            with torch._C._DisableAutocast():  # the samples' own arithmetic, whatever region we are in
                args, kwargs = build(inputs)
            record = _ComputeDtype()
            with _fake_mode_quiet(self._fake) if self._fake is not None else contextlib.nullcontext():
                with _autocast_on(self.device_type, self.dtype):
                    out = op(*args, **kwargs)
                found = _floating_dtype(out)
                if found is None:  # integer results: what did the computation get?
                    with _autocast_on(self.device_type, self.dtype), record:
                        op(*args, **kwargs)
                    found = record.dtype
        except Exception as err:  # any failure only leaves the op unresolved
            refused = "unsafe to autocast" in str(err)
            return (REFUSED if refused else None), inputs.floating
        return found, inputs.floating


def classify_op(
    op: str, device_type: str, dtype: torch.dtype, *, simulate: bool = False
) -> Outcome:
    """The class the running torch's autocast gives ``op`` (an aten name without
    overload) on ``device_type`` with ``dtype``: a :class:`~mixprec.policy.Precision`,
    :data:`REFUSED`, or None when the probe cannot tell."""
    return _classify(op, _Runner(device_type, dtype, simulate))


def _classify(op: str, run: _Runner) -> Outcome:
    sample = _sample(op, run.device_type)
    if sample is None:
        return None
    overload, build = sample
    low = run.dtype
    with _set_aside():
        from_fp32, n = run.output_dtype(overload, build, lambda i: _FP32)
        if from_fp32 == REFUSED or from_fp32 is None:
            return from_fp32
        if from_fp32 == low:
            return Precision.LOW
        from_low, _ = run.output_dtype(overload, build, lambda i: low)
        if from_fp32 == _FP32 and from_low == _FP32:
            return Precision.FP32
        if from_fp32 == _FP32 and from_low == low and n >= 2:
            mixed, _ = run.output_dtype(overload, build, lambda i: low if i % 2 == 0 else _FP32)
            swapped, _ = run.output_dtype(overload, build, lambda i: _FP32 if i % 2 == 0 else low)
            if mixed == _FP32 and swapped == _FP32:
                return Precision.PROMOTE
    return None


def probe_table(
    device_type: str, dtype: torch.dtype, ops: Iterable[str], *, simulate: bool = False
) -> OpTable | str:
    """The classes of ``ops`` in the running torch's autocast on ``device_type`` with
    ``dtype``, as an :class:`~mixprec.policy.OpTable` (``unresolved``: the ops the probe
    could not classify); or why it cannot run on ``device_type`` now.

    The table source :mod:`mixprec.amp` installs (:func:`mixprec.policy.torch_table`
    calls it once per device type and dtype, with the ops torch autocasts).

    >>> import torch
    >>> from mixprec.amp.probe import probe_table
    >>> table = probe_table("cpu", torch.bfloat16, ["mm", "prod", "relu"])
    >>> sorted(table.low), sorted(table.fp32), sorted(table.unresolved)
    (['mm'], ['prod'], ['relu'])
    """
    why = None if simulate else can_probe(device_type)
    if why is not None:
        return why
    sets: dict[str, set[str]] = {"low": set(), "fp32": set(), "promote": set(), REFUSED: set(), "unknown": set()}
    threads = torch.get_num_threads()
    with _set_aside():
        torch.set_num_threads(1)  # a few elements per op: a thread pool only adds its wake-ups
        try:
            for op in sorted(ops):
                outcome = classify_op(op, device_type, dtype, simulate=simulate)
                word = "unknown" if outcome is None else REFUSED if outcome == REFUSED else outcome.value
                sets[word].add(op)
        finally:
            torch.set_num_threads(threads)
    where = f"fake {device_type} tensors" if simulate else device_type
    return OpTable(
        device_type,
        dtype,
        frozenset(sets["low"]),
        frozenset(sets["fp32"]),
        frozenset(sets["promote"]),
        frozenset(sets[REFUSED]),
        frozenset(sets["unknown"]),
        source=f"each op run under its autocast on {where}",
    )
