"""The native CPU kernel alone, and variants of it, on one real optimizer state, interleaved.

Builds each C source given (default: mixprec's own ``native_adam.c``) as mixprec builds its
kernel (the same compiler flags; the target from ``MIXPREC_NATIVE_TARGET``, default
``-march=native``), takes the state of GPT-small's bf16-kahan step with 8-bit moments after a
few training steps (19.6M elements in one range), and calls each build's ``mp_adam`` in turn,
``--repeats`` times. The minimum of each is printed: on a shared machine whose speed changes
from one second to the next, interleaving puts every build through the same conditions, so
only the ratios between builds are meaningful. The kernel steps the state in place (the
builds see slightly different moments: the time does not depend on them).

    python benchmarks/bench_native_kernel.py
    MIXPREC_NATIVE_TARGET=-march=x86-64-v3 python benchmarks/bench_native_kernel.py /tmp/variant.c
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_optim
from mixprec.cli.models import build_task
from mixprec.optim import native, native_build
from mixprec.optim import states as qstates
from mixprec.optim.codecs import compact_q8_tables


def build(source: Path, where: Path) -> ctypes.CDLL:
    """``source`` compiled as mixprec compiles its kernel."""
    cc = native_build._compiler()
    if not cc:
        raise SystemExit("no C compiler on PATH")
    target = os.environ.get(native_build.FLAGS_ENV, "-march=native").split()
    out = where / f"{source.stem}_{abs(hash(str(source)))}.so"
    cmd = [*cc, "-O3", *target, "-ffp-contract=off", "-fno-math-errno", "-fno-strict-aliasing",
           "-fPIC", "-shared", "-o", str(out), str(source)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    lib.mp_adam.restype = ctypes.c_int64
    lib.mp_adam.argtypes = [ctypes.POINTER(native_build.Args), ctypes.POINTER(ctypes.c_void_p)]
    return lib


def real_state(steps: int) -> dict[str, torch.Tensor]:
    """GPT-small's bf16 weights with 8-bit moments under bf16-kahan, after ``steps`` training
    steps, with gradients: every weight whose length is whole 8-bit blocks, concatenated."""
    task = build_task("gpt", size="small", seed=0)
    setup = bench_optim.ROWS["bf16-kahan-8bit"](task, torch.device("cpu"))
    x, y = task.batch(task.default_batch_size, torch.Generator().manual_seed(0))
    for _ in range(steps):
        setup.train_step(x, y)
    bench_optim._fill_grads(setup.params)
    opt = setup.opt
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("w", "comp", "g", "m", "v", "m_scale", "v_scale")}
    for p in setup.params:
        state = opt.state.get(p, {})
        if p.dtype != torch.bfloat16 or f"exp_avg{qstates.ABSMAX}" not in state or p.numel() % qstates.BLOCK:
            continue
        assert p.grad is not None
        for key, t in (("w", p.detach()), ("comp", opt._compensation_for(p)), ("g", p.grad.float()),
                       ("m", state["exp_avg"]), ("v", state["exp_avg_sq"]),
                       ("m_scale", state[f"exp_avg{qstates.ABSMAX}"]), ("v_scale", state[f"exp_avg_sq{qstates.ABSMAX}"])):
            parts[key].append(t.reshape(-1))
    return {k: torch.cat(v) for k, v in parts.items()}


def args_for(state: dict[str, torch.Tensor], tables: list[torch.Tensor]) -> native_build.Args:
    """AdamW(lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01) at step 5, Kahan store."""
    ptr = {k: t.data_ptr() for k, t in state.items()}
    beta1, beta2, lr, step = 0.9, 0.999, 1e-3, 5
    return native_build.Args(
        begin=0, end=state["w"].numel(), w=ptr["w"], g=ptr["g"], m=ptr["m"], v=ptr["v"],
        m_scale=ptr["m_scale"], v_scale=ptr["v_scale"], comp=ptr["comp"],
        smap=tables[0].data_ptr(), slookup=tables[1].data_ptr(), spoints=tables[2].data_ptr(),
        umap=tables[3].data_ptr(), ulookup=tables[4].data_ptr(), upoints=tables[5].data_ptr(),
        scompact=tables[6].data_ptr(), ucompact=tables[7].data_ptr(),
        w_kind=native._KINDS[torch.bfloat16], g_kind=native._KINDS[torch.float32], s_kind=native._KINDS[qstates.Q8],
        comp_kind=native._KINDS[torch.bfloat16], rounding=native._ROUNDINGS["kahan"], wd_mode=2,
        lerp_weight=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2, eps=1e-8, decay=1 - lr * 0.01,
        step_size=lr / (1 - beta1**step), bc2_sqrt=(1 - beta2**step) ** 0.5,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sources", nargs="*", type=Path, help="C sources (default: mixprec's native_adam.c)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--train-steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, resources.as_file(resources.files("mixprec.optim") / "native_adam.c") as own:
        sources = args.sources or [own]
        libs = [build(s, Path(tmp)) for s in sources]
        state = real_state(args.train_steps)
        tables = compact_q8_tables(int(native_build.library().mp_compact_e0()))  # type: ignore[union-attr]
        call = args_for(state, tables)
        best = [float("inf")] * len(libs)
        out = ctypes.c_void_p()
        for _ in range(args.repeats):
            for i, lib in enumerate(libs):
                t0 = time.perf_counter()
                if lib.mp_adam(ctypes.byref(call), ctypes.byref(out)) < 0:
                    raise SystemExit(f"{sources[i]} refused the call")
                best[i] = min(best[i], time.perf_counter() - t0)
    n = state["w"].numel()
    target = os.environ.get(native_build.FLAGS_ENV, "-march=native")
    print(f"bf16-kahan, 8-bit moments, {n:,} elements, one thread, {target}, minimum of {args.repeats}:")
    for source, t in zip(sources, best, strict=True):
        print(f"  {source}: {1e3 * t:.1f} ms ({1e9 * t / n:.2f} ns per element, {t / best[0]:.2f}x of the first)")


if __name__ == "__main__":
    main()
