"""FSDP2 under Accelerate: the plugin mixprec runs with, what it refuses of it, and the sharding.

Under an Accelerator with an FSDP2 plugin (``FullyShardedDataParallelPlugin(fsdp_version=2)``),
:func:`mixprec.integrations.accelerate.prepare` shards the model itself with the plan's
policy (:func:`shard_for_fsdp2`: :func:`~mixprec.distributed.fully_shard_model`, units from
the plugin's auto-wrap policy) before Accelerate's ``prepare``, which then finds it sharded
and keeps it.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.session import MixedPrecision

__all__ = ["check_fsdp2_plugin", "fsdp2_plugin", "fsdp2_units", "shard_for_fsdp2"]


def fsdp2_plugin(accelerator: Any) -> Any | None:
    """The FSDP plugin of an accelerator that runs FSDP2 (``fsdp_version=2``); None otherwise."""
    state = getattr(accelerator, "state", None)
    plugin = getattr(state, "fsdp_plugin", None)
    running = str(getattr(state, "distributed_type", "")).split(".")[-1] == "FSDP"
    return plugin if running and plugin is not None and getattr(plugin, "fsdp_version", 1) == 2 else None


def check_fsdp2_plugin(plugin: Any) -> None:
    """Refuse the FSDP2 plugin options mixprec does not take, naming the fix."""
    if getattr(plugin, "mixed_precision_policy", None) is not None:
        raise ValueError(
            f"FullyShardedDataParallelPlugin(mixed_precision_policy={plugin.mixed_precision_policy!r}) and mixprec would "
            "both set the precision; leave it unset: mixprec shards with the plan's own policy (fsdp_policy(plan))"
        )
    if getattr(plugin, "activation_checkpointing", False):
        raise ValueError(
            "FullyShardedDataParallelPlugin(activation_checkpointing=True) wraps the layers after mixprec has sharded "
            "them; leave it False and checkpoint inside the model (torch.utils.checkpoint, or the model's own "
            "gradient_checkpointing_enable())"
        )
    if getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ValueError(
            "FullyShardedDataParallelPlugin(cpu_ram_efficient_loading=True) (accelerate launch's "
            "--fsdp_cpu_ram_efficient_loading, on by default there) loads the weights on rank 0 only and relies on "
            "Accelerate's own sharding to broadcast them, which mixprec's sharding with the plan's policy replaces. "
            "Pass --fsdp_cpu_ram_efficient_loading false (fsdp_config={'cpu_ram_efficient_loading': False})"
        )
    if getattr(plugin, "ignored_modules", None):
        raise ValueError(
            "FullyShardedDataParallelPlugin(ignored_modules=...) is not supported under mixprec: the plan converts and "
            "shards every module. Leave it unset (freeze those parameters instead: requires_grad=False)"
        )
    offload = getattr(plugin, "cpu_offload", None)
    if offload is not None and type(offload).__name__ == "CPUOffloadPolicy":
        raise ValueError(
            "FullyShardedDataParallelPlugin(cpu_offload=True) is not supported under mixprec: its optimizer wrappers "
            "step the shards where FSDP2 keeps them, which was not tested with offloading. Leave cpu_offload unset"
        )


def fsdp2_units(plugin: Any, model: torch.nn.Module) -> tuple[type[torch.nn.Module], ...]:
    """The module classes the plugin's auto-wrap policy makes FSDP2 units (transformer-based
    wrapping: ``transformer_cls_names_to_wrap``, else the model's ``_no_split_modules``); none
    without a policy (the root alone, as Accelerate does). Resolved before sharding renames the
    classes, and left resolved on the plugin, as Accelerate leaves it."""
    import functools

    plugin.set_auto_wrap_policy(model)
    policy = getattr(plugin, "auto_wrap_policy", None)
    if policy is None:
        return ()
    keywords = policy.keywords if isinstance(policy, functools.partial) else {}
    if "transformer_layer_cls" in keywords:
        return tuple(keywords["transformer_layer_cls"])
    raise ValueError(
        f"FullyShardedDataParallelPlugin(auto_wrap_policy={policy!r}): mixprec shards by module class (norm layers "
        "a plan keeps in fp32 form their own unit); use auto_wrap_policy='transformer_based_wrap' with "
        "transformer_cls_names_to_wrap (or the model's _no_split_modules), or no auto-wrap policy"
    )


def shard_for_fsdp2(accelerator: Any, session: MixedPrecision, model: torch.nn.Module,
                    optimizers: list[torch.optim.Optimizer]) -> None:
    """Shard ``model`` as Accelerate's FSDP2 plugin asks, with the plan's policy (mixprec's
    :func:`~mixprec.distributed.fully_shard_model`: converted first under the plans without masters
    and fp8, norm layers in one fp32 unit), and point ``optimizers`` at the sharded parameters.
    Accelerate then finds the model sharded and keeps it."""
    from mixprec.distributed import fully_shard_model, has_fsdp

    if has_fsdp(model):
        return
    plugin = fsdp2_plugin(accelerator)
    assert plugin is not None, "called for an accelerator running FSDP2 only"
    names = {id(p): n for n, p in model.named_parameters()}
    for i, opt in enumerate(optimizers):
        if opt.state:
            raise ValueError(
                f"optimizer {i} ({type(opt).__name__}) has state already; under FSDP2 it is pointed at the sharded "
                "parameters, so build it fresh and pass it to prepare() before its first step"
            )
        strangers = [p for g in opt.param_groups for p in g["params"] if id(p) not in names]
        if strangers:
            raise ValueError(
                f"optimizer {i} ({type(opt).__name__}) holds {len(strangers)} tensor(s) that are not parameters of the "
                "model given to prepare(); under FSDP2 it is pointed at the sharded parameters by name. Build it over "
                "model.parameters()"
            )
    if getattr(session.plan, "auto_reason", None):
        raise ValueError(
            f"MixedPrecision('auto') chooses its plan when the model is prepared, and under FSDP2 the model is sharded "
            f"for the plan before that; name the plan (here 'auto' chose {session.plan.name!r})"
        )
    if len(optimizers) + len(session.optimizers) > 1:
        raise ValueError(
            "under FSDP2 Accelerate checkpoints one optimizer per model (save_state pairs them by index); pass one "
            "optimizer, with several param groups if needed"
        )
    mesh = accelerator.torch_device_mesh
    config = getattr(accelerator, "parallelism_config", None)
    if mesh is not None and config is not None:
        mesh = mesh[tuple(config.fsdp_dim_names)]
    elif mesh is None:  # on the accelerator's device, wherever the model is now (the Trainer leaves it on the CPU)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    fully_shard_model(model, session.plan, mesh=mesh, units=fsdp2_units(plugin, model),
                      reshard_after_forward=plugin.reshard_after_forward)
    sharded = dict(model.named_parameters())
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
