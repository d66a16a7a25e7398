"""fp8 linear layers inside a bf16-mixed model ("fp8-mixed", "fp8")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

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
    """

    recipe: Any = field(default_factory=_default_recipe)
    module_filter: Callable[[str, torch.nn.Module], bool] | None = None
    emulate: bool | None = None

    family: ClassVar[str] = "fp8"
    supports_fsdp: ClassVar[bool] = True  # converted before sharding; FSDP2 gathers the fp32 weights they quantise
    summary: ClassVar[str] = "bf16-mixed with fp8 (E4M3 forward, E5M2 gradient) linear layers"

    def tensor_dtypes(self) -> dict[str, str]:
        rows = super().tensor_dtypes()
        rows["compute"] = "fp8 GEMMs in eligible Linear layers (fp32 accumulation), bf16 autocast elsewhere"
        rows["fp8 recipe"] = repr(self.recipe)
        return rows

    def convert_model(self, model: torch.nn.Module) -> dict[torch.Tensor, torch.Tensor]:
        from mixprec.fp8 import convert_to_fp8
        from mixprec.islands import apply_fp32_islands, is_fp32_island

        if self.policy is not None and self.policy.fp32_modules:  # islands first: they stay out of fp8
            apply_fp32_islands(model, self.policy)
        islands = [name for name, module in model.named_modules() if is_fp32_island(module)]
        user_filter = self.module_filter

        def outside_islands(name: str, module: torch.nn.Module) -> bool:
            if any(name == i or name.startswith(f"{i}.") or i == "" for i in islands):
                return False
            return user_filter is None or bool(user_filter(name, module))

        convert_to_fp8(model, self.recipe, module_filter=outside_islands, emulate=self.emulate)
        return super().convert_model(model)  # fp32 weights, as bf16-mixed: a half-precision model is upcast

    def before_unscale(self, model: torch.nn.Module, process_group: Any) -> None:
        """Every rank computes the next fp8 scales from the same (MAX-reduced) amaxes."""
        from mixprec.fp8 import all_reduce_amax

        all_reduce_amax(model, process_group)

    def nonfinite_flag(self, model: torch.nn.Module) -> torch.Tensor | None:
        """Whether an fp8 layer saw an inf/NaN input, weight or output gradient since the last step."""
        from mixprec.fp8 import nonfinite_flag

        return nonfinite_flag(model)

    def after_step(self, model: torch.nn.Module) -> None:
        """Clear the fp8 layers' non-finite flags for the next step."""
        from mixprec.fp8 import reset_nonfinite

        reset_nonfinite(model)
