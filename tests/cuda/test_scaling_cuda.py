"""The loss scaler on CUDA: bit for bit ``torch.amp.GradScaler("cuda")`` over a stream of
clean, inf and NaN steps (fused and foreach AdamW and SGD), and a hot path that never
synchronises with the device (``torch.cuda.set_sync_debug_mode("error")``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

from mixprec import DynamicLossScaler

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

INF, NAN = float("inf"), float("nan")
# Clean steps, overflows (inf and NaN, alone and in a row), growth (interval 2) in between.
PATTERN = [None, None, INF, None, None, None, NAN, None, INF, INF, None, None, None, None, NAN, None]

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "sgd-foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True),
}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).cuda()


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 4, generator=g).cuda(), torch.randn(16, 2, generator=g).cuda()


def _train_step(model, opt, scaler, step: int, poison: float | None, *, unscale_first: bool) -> None:
    x, y = _data(step)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    if poison is not None:
        loss = loss * poison
    scaler.scale(loss).backward()
    if unscale_first:
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)


def _opt_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_matches_torch_gradscaler_bit_for_bit(optimizer: str, unscale_first: bool) -> None:
    make_opt = OPTIMIZERS[optimizer]
    ours_model, ref_model = _model(), _model()
    ours_opt, ref_opt = make_opt(ours_model.parameters()), make_opt(ref_model.parameters())
    kwargs = {"init_scale": 2.0**8, "growth_interval": 2}
    ours = DynamicLossScaler(**kwargs)
    ref = torch.amp.GradScaler("cuda", **kwargs)
    for step, poison in enumerate(PATTERN):
        _train_step(ours_model, ours_opt, ours, step, poison, unscale_first=unscale_first)
        _train_step(ref_model, ref_opt, ref, step, poison, unscale_first=unscale_first)
        assert ours.scale_tensor().device.type == "cuda"
        assert ours.get_scale() == ref.get_scale(), f"scale differs at step {step}"
        for a, b in zip(ours_model.parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(a, b), f"parameters differ at step {step}"
        for a, b in zip(_opt_state(ours_opt), _opt_state(ref_opt), strict=True):
            assert torch.equal(a, b), f"optimizer state differs at step {step}"
    assert ours.state_dict()["_growth_tracker"] == ref.state_dict()["_growth_tracker"]
    assert ours.overflow_steps == sum(p is not None for p in PATTERN)


def test_fp16_gradients_unscale_on_the_gpu_like_fp32_ones() -> None:
    """unscale_ accepts fp16 gradients (torch refuses them) and computes in fp32."""
    w16 = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16, device="cuda"))
    w32 = torch.nn.Parameter(torch.zeros(8, device="cuda"))
    grads = torch.tensor([1.0, -2.0, 3.5, 0.25, 1024.0, -0.5, 8.0, 6.0], device="cuda") * 2.0**4
    w16.grad, w32.grad = grads.half(), grads.clone()
    s = DynamicLossScaler(init_scale=2.0**4)
    s.scale(torch.ones((), device="cuda"))  # moves the scale to the GPU
    opt16, opt32 = torch.optim.SGD([w16], lr=1.0), torch.optim.SGD([w32], lr=1.0)
    s.unscale_(opt16)
    s.unscale_(opt32)
    assert w16.grad.dtype == torch.float16 and torch.equal(w16.grad.float(), w32.grad)
    assert s.found_inf(opt16).item() == 0.0
    w16.grad[3] = float("inf")
    s.update()
    s.unscale_(opt16)
    assert s.found_inf(opt16).item() == 1.0


@contextlib.contextmanager
def _sync_forbidden() -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def test_sync_debug_mode_catches_a_host_read() -> None:
    """The guard below works: a host read of a GPU tensor raises under it."""
    t = torch.ones((), device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), _sync_forbidden():
        t.item()


@pytest.mark.parametrize(
    "scaler_kwargs",
    [
        {"init_scale": 2.0**8, "growth_interval": 2},  # torch's fused update kernel
        {"init_scale": 2.0**8, "growth_interval": 2, "hysteresis": 2, "max_scale": 2.0**20},  # mixprec's own
        {"init_scale": 2.0**8, "growth_interval": 2, "hysteresis": 2, "hysteresis_mode": "since_growth", "min_scale": 1.0},
    ],
    ids=["torch-update", "hysteresis-bounds", "since-growth"],
)
@pytest.mark.parametrize("optimizer", ["adamw-fused", "sgd-fused"])
def test_hot_path_never_synchronises(optimizer: str, scaler_kwargs: dict) -> None:
    """scale, unscale_, a fused step and update never wait for the device, clean or overflowing."""
    model = _model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    s = DynamicLossScaler(**scaler_kwargs)

    def loss_of(step: int, poison: float | None) -> torch.Tensor:
        x, y = _data(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        return loss if poison is None else loss * poison

    # Warm-up: the scale moves to the GPU (a host-to-device copy) and the optimizer
    # creates its state on the first step; neither is the hot path.
    s.scale(loss_of(0, None)).backward()
    s.step(opt)
    s.update()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    for step, poison in enumerate([None, INF, None, NAN, None, None], start=1):
        loss = loss_of(step, poison)
        with _sync_forbidden():
            scaled = s.scale(loss)
        scaled.backward()
        with _sync_forbidden():
            if step % 2:
                s.unscale_(opt)  # then the fused step takes the already unscaled gradients
            s.step(opt)
            s.update()
        opt.zero_grad(set_to_none=True)
    assert s.overflow_steps == 2  # and the state machine still did its job
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_non_fused_step_is_the_documented_sync_point() -> None:
    """A non-fused optimizer needs the skip decision on the host: exactly one read, in step()."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, foreach=True)
    s = DynamicLossScaler(init_scale=2.0**8)
    x, y = _data(0)
    s.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    with _sync_forbidden():
        s.unscale_(opt)
        with pytest.raises(RuntimeError, match="synchroniz"):
            s.step(opt)
