"""fp8 linear layers inside a bf16-mixed model ("fp8-mixed", "fp8")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from mixprec.formatting import Text
from mixprec.plans.mixed import MixedPlan

__all__ = ["Fp8Plan"]


def _default_recipe() -> Any:
    from mixprec.fp8 import DelayedScaling

    return DelayedScaling()


@dataclass(frozen=True)
class Fp8Plan(MixedPlan):
    """bf16-mixed, with eligible ``nn.Linear`` layers swapped for fp8 linear layers.

    Inputs and weights are quantised to E4M3 and output gradients to E5M2 (the
    "hybrid" recipe) with per-tensor scales; the GEMM runs natively where the
    hardware has fp8 tensor cores and is emulated exactly elsewhere.
    ``module_filter(qualified_name, module) -> bool`` keeps chosen layers in bf16.

    Which eligible layers become fp8 follows the measured pay-off table of the device the
    model is on when it is prepared (:func:`mixprec.fp8.table_for`): a layer whose
    predicted fp8-over-bf16 speedup at ``tokens`` rows per step is below ``min_payoff``
    stays bf16 (``explain()`` names it and the predicted ratio). Where no table is measured
    (a CPU, where fp8 is emulated for accuracy rather than speed, or a GPU kind without a
    table) every eligible layer is converted, as with ``min_payoff=None``. ``cast`` picks
    the quantiser (:class:`mixprec.fp8.Fp8Linear`); with a fused cast the amax histories
    and scales of all layers are updated in one call per step (before the gradients are
    unscaled; a skipped step restores them).
    """

    recipe: Any = field(default_factory=_default_recipe)
    module_filter: Callable[[str, torch.nn.Module], bool] | None = None
    emulate: bool | None = None
    cast: Literal["auto", "eager", "compile", "triton"] = "auto"
    min_payoff: float | None = 1.0
    tokens: int = 8192
    #: per eligible Linear layer of the last model converted: "fp8" or why it stayed bf16
    layer_choices: dict[str, str] = field(default_factory=dict, init=False, compare=False, repr=False)

    family: ClassVar[str] = "fp8"
    supports_fsdp: ClassVar[bool] = True  # converted before sharding; FSDP2 gathers the fp32 weights they quantise
    summary: ClassVar[str] = "bf16-mixed with fp8 (E4M3 forward, E5M2 gradient) linear layers"

    def __post_init__(self) -> None:
        super().__post_init__()
        from mixprec.fp8.linear import check_cast

        check_cast(self.cast, "layer", f"get_plan({self.name!r})")
        if self.min_payoff is not None and (
            isinstance(self.min_payoff, bool) or not isinstance(self.min_payoff, int | float) or not self.min_payoff > 0
        ):
            raise ValueError(
                f"get_plan({self.name!r}, min_payoff={self.min_payoff!r}): expected a positive speedup over bf16 "
                "(1.0: fp8 only where measured at least as fast) or None (every eligible layer in fp8)"
            )
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(
                f"get_plan({self.name!r}, tokens={self.tokens!r}): expected a positive int, the rows of a Linear "
                "layer's input per step (batch x sequence length), e.g. tokens=8192"
            )

    def tensor_dtypes(self) -> dict[str, str]:
        rows = super().tensor_dtypes()
        rows["compute"] = "fp8 GEMMs in eligible Linear layers (fp32 accumulation), bf16 autocast elsewhere"
        rows["fp8 recipe"] = repr(self.recipe)
        rows["fp8 cast"] = {
            "auto": "fused (one kernel per tensor) where the native fp8 GEMM runs, eager elsewhere",
            "eager": "eager quantiser",
            "compile": "fused, torch.compile",
            "triton": "fused, Triton kernels",
        }[self.cast]
        if self.min_payoff is None:
            rows["fp8 layers"] = "every eligible Linear layer"
        else:
            rows["fp8 layers"] = (
                f"eligible Linear layers predicted >= {self.min_payoff:g}x of bf16 at {self.tokens} tokens "
                "(the device's measured table; without one, every eligible layer)"
            )
        return rows

    def explain(self) -> Text:
        """The plan's table; after a model was prepared, which layers became fp8 and why
        the others stayed bf16."""
        text = str(super().explain())
        if self.layer_choices:
            width = max(len(name) for name in self.layer_choices)
            lines = ["", "fp8 layers of the prepared model:"]
            lines += [f"  {name.ljust(width)}  {why}" for name, why in self.layer_choices.items()]
            text += "\n" + "\n".join(lines)
        return Text(text)

    def convert_model(self, model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        from mixprec.fp8 import Fp8Linear, convert_to_fp8, default_module_filter, table_for
        from mixprec.islands import apply_fp32_islands, is_fp32_island

        if self.policy is not None and self.policy.fp32_modules:  # islands first: they stay out of fp8
            apply_fp32_islands(model, self.policy)
        islands = [name for name, module in model.named_modules() if is_fp32_island(module)]
        user_filter = self.module_filter
        first = next(model.parameters(), None)
        device = None if first is None else first.device
        table = None if self.min_payoff is None else table_for(device)
        choices = self.layer_choices
        choices.clear()
        if table is None and self.min_payoff is not None:
            where = "a CPU (fp8 is emulated there)" if device is None or device.type != "cuda" else (
                f"this GPU kind ({device})")
            no_table = f"fp8 (no measured pay-off table for {where}: every eligible layer converted)"
        else:
            no_table = "fp8"

        def chosen(name: str, module: torch.nn.Module) -> bool:
            if not default_module_filter(name, module):
                return False  # (not eligible: convert_to_fp8 says why in its docs)
            if any(name == i or name.startswith(f"{i}.") or i == "" for i in islands):
                choices[name] = "bf16: inside an fp32 island (fp32 there)"
                return False
            if user_filter is not None and not user_filter(name, module):
                choices[name] = "bf16: module_filter kept it"
                return False
            if table is not None:
                assert self.min_payoff is not None
                p = table.predict(self.tokens, module.in_features, module.out_features)  # type: ignore[arg-type]
                ratio = f"predicted {p.speedup:.2f}x of bf16 at (M, K, N) = {(self.tokens, module.in_features, module.out_features)}"
                source = f"nearest measured {p.shape} on {table.kind}"
                if p.speedup < self.min_payoff:
                    choices[name] = f"bf16: {ratio}, below min_payoff={self.min_payoff:g} ({source})"
                    return False
                choices[name] = f"fp8: {ratio} ({source})"
                return True
            choices[name] = no_table
            return True

        convert_to_fp8(model, self.recipe, module_filter=chosen, emulate=self.emulate, cast=self.cast,
                       scale_update="step")
        ordered: dict[str, str] = {}
        for name, module in model.named_modules():  # every Linear layer, in the model's order
            if name in choices:
                ordered[name] = choices[name]
            elif isinstance(module, torch.nn.Linear) and not isinstance(module, Fp8Linear):
                ordered[name] = ("bf16: not eligible (fp8 takes an exact nn.Linear with in and out features "
                                 "positive multiples of 16)")
        choices.clear()
        choices.update(ordered)
        return super().convert_model(model)  # fp32 weights, as bf16-mixed: a half-precision model is upcast

    def before_unscale(self, model: torch.nn.Module, process_group: Any) -> None:
        """Every rank computes the next fp8 scales from the same (MAX-reduced) amaxes; with a
        fused cast, every layer's history and scales are updated here, in one call (a
        skipped step restores them with the other buffers)."""
        from mixprec.fp8 import all_reduce_amax, update_scales

        all_reduce_amax(model, process_group)
        update_scales(model)

    def nonfinite_flag(self, model: torch.nn.Module) -> torch.Tensor | None:
        """Whether an fp8 layer saw an inf/NaN input, weight or output gradient since the last step."""
        from mixprec.fp8 import nonfinite_flag

        return nonfinite_flag(model)

    def after_step(self, model: torch.nn.Module) -> None:
        """Clear the fp8 layers' non-finite flags for the next step."""
        from mixprec.fp8 import reset_nonfinite

        reset_nonfinite(model)
