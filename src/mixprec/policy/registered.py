"""The record of user ops declared with :func:`mixprec.register_op`.

The autocast engine (:mod:`mixprec.amp`) applies the declared precisions; this
record is what :meth:`~mixprec.policy.OpPolicy.explain` prints.

>>> from mixprec.policy import Precision, record_registered_op, registered_ops
>>> record_registered_op("mylib::op", Precision.FP32)
>>> registered_ops()["mylib::op"]
<Precision.FP32: 'fp32'>
>>> record_registered_op("mylib::op", None)
>>> "mylib::op" in registered_ops()
False
"""

from __future__ import annotations

from mixprec.policy.tables import Precision

__all__ = ["record_registered_op", "registered_ops"]

_REGISTERED: dict[str, Precision] = {}


def registered_ops() -> dict[str, Precision]:
    """User ops declared with :func:`mixprec.register_op`, by name -> precision."""
    return dict(_REGISTERED)


def record_registered_op(name: str, precision: Precision | None) -> None:
    """Record that user op ``name`` runs in ``precision`` (None: forget it).

    Called by :func:`mixprec.register_op` / :func:`mixprec.unregister_op`; the
    record only informs :meth:`~mixprec.policy.OpPolicy.explain`.
    """
    if precision is None:
        _REGISTERED.pop(name, None)
    else:
        _REGISTERED[name] = precision
