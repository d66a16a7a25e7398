"""Loads are all or nothing in every path, refuse what would crash the next step, never drop
masters silently, and a checkpoint whose bits changed on disk is an error (issue 27, cases 8, 10)."""

from __future__ import annotations

import re
import warnings
import zipfile

import pytest
import torch
from torch import nn

from mixprec import MixedPrecision, get_plan, load_checkpoint, save_checkpoint
from mixprec.checkpoint.integrity import checksums
from mixprec.optim import KahanOptimizer, MasterWeightOptimizer
from mixprec.resume import fp32_state_dict, load_plain_optimizer_state


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _run(plan: str, opt_cls=torch.optim.AdamW, steps: int = 4, seed: int = 0, **opt_kw):
    mp = MixedPrecision(plan)
    model = _model(seed)
    model, opt = mp.prepare(model, opt_cls(model.parameters(), lr=1e-2, **opt_kw))
    _train(model, mp, steps, seed)
    return model, opt, mp


def _train(model, mp, steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    for _ in range(steps):
        with mp.autocast():
            loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
        mp.backward(loss)
        mp.step()  # fp16 plans skip their first steps while the loss scale settles


def _snapshot(model, opt, mp):
    sd = opt.state_dict()
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        repr(sd["param_groups"]),
        {k: {n: t.clone() for n, t in s.items() if isinstance(t, torch.Tensor)} for k, s in sd["state"].items()},
        [m.clone() for m in sd.get("mixprec_master_weights", [])],
        repr(mp.state_dict()),
    )


def _unchanged(before, after) -> bool:
    (ma, ga, sa, wa, pa), (mb, gb, sb, wb, pb) = before, after
    return (
        ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
        and ga == gb and pa == pb
        and sa.keys() == sb.keys() and all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k])
        and len(wa) == len(wb) and all(torch.equal(x, y) for x, y in zip(wa, wb, strict=True))
    )


def _rewrite(path, change) -> None:
    payload = torch.load(path, weights_only=True)
    change(payload)
    payload["checksum"] = checksums(payload)
    torch.save(payload, path)


# ------------------------------------------------ masters carried over, never dropped (case 8)
@pytest.mark.parametrize("target", ["bf16-mixed", "fp8-mixed", "fp32"])
@pytest.mark.parametrize("source", ["bf16-master", "fp16-master"])
def test_a_master_checkpoint_loads_its_masters_into_fp32_weights_exactly(tmp_path, source, target):
    model, opt, mp = _run(source)
    expected = fp32_state_dict(model, [opt])
    assert any(not torch.equal(expected[k], v.float()) for k, v in model.state_dict().items())  # masters matter
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _run(target, seed=1)
    message = (
        f"checkpoint {str(path)!r} was saved under plan {source!r}, whose optimizer kept the true values of its "
        "low-precision weights beside them; this run's optimizer keeps none, and its weights are fp32, so they were "
        "loaded from those values, exactly, not from the rounded weights (optimizers[0]: 4 weight(s) loaded from "
        "their fp32 masters)"
    )
    with pytest.warns(UserWarning, match=re.escape(message)):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2, allow_plan_change=True)
    loaded = model2.state_dict()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    _train(model2, mp2, 1)


def test_a_kahan_checkpoint_loads_weight_plus_compensation_into_fp32_weights(tmp_path):
    model, opt, mp = _run("bf16-kahan")
    assert isinstance(opt, KahanOptimizer)
    expected = {
        name: p.detach().float() + opt.compensation(p).float() for name, p in model.named_parameters()
        if opt.compensation(p) is not None
    }
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _run("bf16-mixed", seed=1)
    with pytest.warns(UserWarning, match=re.escape("(optimizers[0]: 4 weight(s) loaded as weight + Kahan compensation)")):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2, allow_plan_change=True)
    loaded = model2.state_dict()
    assert len(expected) == 4
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


def test_kahan_compensation_is_not_dropped_by_a_plan_that_cannot_keep_it(tmp_path):
    model, opt, mp = _run("bf16-kahan")
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _run("bf16-pure", seed=1)
    before = _snapshot(model2, opt2, mp2)
    message = (
        f"checkpoint {str(path)!r}: optimizers[0] holds Kahan compensation (the bits rounding dropped from the "
        "weights), saved under plan 'bf16-kahan'; this run's LowPrecisionOptimizer keeps the weights alone, rounded: "
        "loading would round them away. To go on, resume under the plan that saved it, or one that keeps them "
        "exactly"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2, allow_plan_change=True)
    assert _unchanged(before, _snapshot(model2, opt2, mp2))


_REMAINDERS = get_plan("bf16-master", remainders=True)


@pytest.mark.parametrize("where", ["export", "resume"])
def test_remainder_masters_are_exported_exactly(where):
    """export_fp32_state_dict() / resume.fp32_state_dict give the remainder plan's fp32 masters,
    bit for bit those of bf16-master, not the bf16 weights upcast."""
    model, opt, mp = _run(_REMAINDERS)
    ref_model, ref_opt, ref_mp = _run("bf16-master")
    sd = mp.export_fp32_state_dict() if where == "export" else fp32_state_dict(model, [opt])
    expected = ref_mp.export_fp32_state_dict()
    assert any(not torch.equal(expected[k], v.float()) for k, v in model.state_dict().items())  # masters matter
    assert sd.keys() == expected.keys()
    for key, value in expected.items():
        assert sd[key].dtype == torch.float32
        assert torch.equal(sd[key], value), key


@pytest.mark.parametrize("target", ["bf16-mixed", "fp8-mixed", "fp32", "plain"])
def test_a_remainder_checkpoint_loads_its_masters_into_fp32_weights_exactly(tmp_path, target):
    model, opt, mp = _run(_REMAINDERS)
    expected = _run("bf16-master")[2].export_fp32_state_dict()
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    if target == "plain":
        model2 = _model(1)
        opt2, mp2 = torch.optim.AdamW(model2.parameters(), lr=1e-2), None
    else:
        model2, opt2, mp2 = _run(target, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2, allow_plan_change=True)
    notes = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(notes) == 1 and "(optimizers[0]: 4 weight(s) loaded from their fp32 masters (bf16 weight + remainder))" in notes[0]
    loaded = model2.state_dict()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize(("source", "target"), [
    ("bf16-master", _REMAINDERS), (_REMAINDERS, "bf16-master"),
])
def test_fp32_masters_and_remainders_convert_into_each_other_and_train_on_bit_for_bit(tmp_path, source, target):
    """bf16-master and its remainder form are the same numbers: a checkpoint of one, loaded into the
    other with allow_plan_change, goes on exactly as the saving plan would have."""
    model, opt, mp = _run(source)
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    _train(model, mp, 3, seed=7)  # the saving plan, uninterrupted
    model2, opt2, mp2 = _run(target, seed=1)
    with pytest.warns(UserWarning, match=r"converted, exactly \(optimizers\[0\]: the fp32 master weights.* of 4 weight"):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2, allow_plan_change=True)
    _train(model2, mp2, 3, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True))
    ours, theirs = mp.export_fp32_state_dict(), mp2.export_fp32_state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("target", ["bf16-master", _REMAINDERS])
def test_a_kahan_checkpoint_becomes_masters_as_weight_plus_compensation(tmp_path, target):
    model, opt, mp = _run("bf16-kahan")
    expected = {name: p.detach().float() + opt.compensation(p).float() for name, p in model.named_parameters()
                if opt.compensation(p) is not None}
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _run(target, seed=1)
    with pytest.warns(UserWarning, match="Kahan compensation"):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2, allow_plan_change=True)
    exported = mp2.export_fp32_state_dict()
    assert len(expected) == 4
    for key, value in expected.items():
        assert torch.equal(exported[key], value), key
    _train(model2, mp2, 2)


@pytest.mark.parametrize("source", ["bf16-master", _REMAINDERS])
@pytest.mark.parametrize("target", ["bf16-pure", "bf16-sr", "bf16-kahan"])
def test_masters_are_refused_by_a_plan_that_would_round_them_with_why_and_the_way(tmp_path, source, target):
    model, opt, mp = _run(source)
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _run(target, seed=1)
    before = _snapshot(model2, opt2, mp2)
    with pytest.raises(ValueError, match=r"optimizers\[0\] holds fp32 master weights.*loading would round them "
                       r"away.*get_plan\('bf16-master', remainders=True\).*'bf16-mixed'.*model.load_state_dict"):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2, allow_plan_change=True)
    assert _unchanged(before, _snapshot(model2, opt2, mp2))


def test_a_plain_optimizer_refuses_a_state_with_masters():
    _, opt, _ = _run("bf16-master")
    _, opt2, _ = _run("bf16-mixed", seed=1)
    groups = repr(opt2.param_groups)
    with pytest.raises(ValueError, match=re.escape(
        "this optimizer state_dict holds 'mixprec_master_weights', kept by a mixprec optimizer of another plan (fp32 "
        "masters, Kahan compensation), which this run's plain AdamW cannot keep: loading it would drop them "
        "silently. Resume it under the plan that saved it"
    )):
        load_plain_optimizer_state(opt2, opt.state_dict())
    assert repr(opt2.param_groups) == groups


@pytest.mark.parametrize("target", ["bf16-kahan", "bf16-sr"])
def test_bf16_pure_resumes_under_kahan_and_sr(tmp_path, target):
    model, opt, mp = _run("bf16-pure")
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _run(target, seed=1)
    load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2, allow_plan_change=True)
    norm = model2[1].weight
    assert norm.dtype == torch.float32  # kept fp32 by these plans, bf16 under bf16-pure
    assert all(v.dtype == torch.float32 for k, v in opt2.state[norm].items() if k != "step")
    _train(model2, mp2, 2)  # failed with a dtype error in the update


# ---------------------------------- the optimizer's class and hyper-parameters (cases 8, 10)
@pytest.mark.parametrize(("saved", "now"), [(torch.optim.Adam, torch.optim.AdamW), (torch.optim.AdamW, torch.optim.Adam)])
@pytest.mark.parametrize("plan", ["bf16-mixed", "bf16-master"])
def test_adam_and_adamw_checkpoints_do_not_load_into_each_other(tmp_path, plan, saved, now):
    model, opt, mp = _run(plan, saved)
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _run(plan, now, seed=1)
    before = _snapshot(model2, opt2, mp2)
    message = (
        f"checkpoint {str(path)!r}: optimizers[0] was saved from a torch.optim.{saved.__name__}, this run's optimizer "
        f"is a torch.optim.{now.__name__}: its state and hyper-parameters belong to another update rule. Pass the "
        "optimizer class that was saved"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)
    assert _unchanged(before, _snapshot(model2, opt2, mp2))
    # a checkpoint that recorded no class (written before classes were): the update rule tells them apart
    _rewrite(path, lambda p: p.pop("optimizer_classes"))
    message = (
        f"checkpoint {str(path)!r}: optimizers[0]: the optimizer state_dict's param_groups[0]"
        f"['decoupled_weight_decay'] is {saved is torch.optim.AdamW}, this {now.__name__}'s is "
        f"{now is torch.optim.AdamW}: it was saved from an optimizer with another update rule"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)
    assert _unchanged(before, _snapshot(model2, opt2, mp2))


@pytest.mark.parametrize(
    ("saved", "now", "missing"),
    [(torch.optim.SGD, torch.optim.AdamW, "'betas', 'eps'"), (torch.optim.AdamW, torch.optim.SGD, "'dampening', 'momentum'")],
)
@pytest.mark.parametrize("plan", ["fp16-mixed", "bf16-master", "fp32"])
def test_sgd_and_adamw_checkpoints_are_refused_before_anything_changes(tmp_path, plan, saved, now, missing):
    kw = {"momentum": 0.9}
    model, opt, mp = _run(plan, saved, **(kw if saved is torch.optim.SGD else {}))
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _run(plan, now, seed=1, **(kw if now is torch.optim.SGD else {}))
    before = _snapshot(model2, opt2, mp2)
    with pytest.raises(ValueError, match=re.escape(f"was saved from a torch.optim.{saved.__name__}, this run's")):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)
    assert _unchanged(before, _snapshot(model2, opt2, mp2))
    _rewrite(path, lambda p: p.pop("optimizer_classes"))
    with pytest.raises(ValueError, match=re.escape(
        f"optimizers[0]: the optimizer state_dict's param_groups[0] has no {missing}, which this {now.__name__} needs"
    )):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)
    assert _unchanged(before, _snapshot(model2, opt2, mp2))
    _train(model2, mp2, 1)  # the optimizer still works (KeyError 'betas' / 'momentum' before)


@pytest.mark.parametrize("plan", ["bf16-master", "bf16-pure", "bf16-mixed"])
def test_a_plain_sgd_state_is_refused_by_every_optimizer_before_anything_changes(plan):
    plain = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    sd = plain.state_dict()
    _, opt, mp = _run(plan)
    groups, state = repr(opt.param_groups), repr(opt.state_dict()["state"])
    with pytest.raises(ValueError, match=re.escape("param_groups[0] has no 'betas', 'eps', which this AdamW needs")):
        load_plain_optimizer_state(opt, sd)
    if plan != "bf16-mixed":  # a wrapper's own load (bf16-mixed steps the plain torch optimizer)
        with pytest.raises(ValueError, match=re.escape("param_groups[0] has no 'betas', 'eps', which this AdamW needs")):
            opt.load_state_dict({**opt.state_dict(), "state": sd["state"], "param_groups": sd["param_groups"]})
    assert (repr(opt.param_groups), repr(opt.state_dict()["state"])) == (groups, state)


def test_a_state_torch_fails_on_half_way_leaves_the_optimizer_as_it_was():
    """torch replaces groups and state, then its __setstate__ fails (no 'step'): put them back."""
    _, opt, _ = _run("bf16-master")
    assert isinstance(opt, MasterWeightOptimizer)
    sd = opt.state_dict()
    groups, state = repr(opt.param_groups), repr(opt.state_dict()["state"])
    crafted = {**sd, "state": {k: {n: v for n, v in s.items() if n != "step"} for k, s in sd["state"].items()}}
    with pytest.raises(ValueError, match=re.escape(
        "cannot load this optimizer state_dict into AdamW (KeyError: 'step'); nothing was changed"
    )):
        opt.load_state_dict(crafted)
    assert (repr(opt.param_groups), repr(opt.state_dict()["state"])) == (groups, state)


def test_a_load_that_fails_late_restores_every_optimizer_and_its_masters(tmp_path, monkeypatch):
    model, opt, mp = _run("bf16-master")
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _run("bf16-master", seed=1)
    before = _snapshot(model2, opt2, mp2)

    real, calls = opt2.load_state_dict, []

    def broken(state_dict):  # the checkpoint's state fails to apply, after the model was loaded
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        real(state_dict)

    monkeypatch.setattr(opt2, "load_state_dict", broken)
    with pytest.raises(ValueError, match=re.escape("could not be applied (device lost); nothing was changed")):
        load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)
    monkeypatch.undo()
    assert _unchanged(before, _snapshot(model2, opt2, mp2))


# ------------------------------------------------------------------- integrity (case 8)
def _data_records(path) -> list[tuple[int, int]]:
    """(offset, size) in the file of each tensor data record torch.save wrote."""
    out = []
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            if "/data/" in info.filename and info.file_size > 0:
                with open(path, "rb") as f:  # local header: 30 bytes + name + extra
                    f.seek(info.header_offset + 26)
                    n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                out.append((info.header_offset + 30 + n + m, info.file_size))
    return out


def test_a_flipped_bit_in_any_tensor_is_an_error_and_changes_nothing(tmp_path):
    model, opt, mp = _run("bf16-master")
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    good = path.read_bytes()
    records = _data_records(path)
    assert len(records) > 10
    model2, opt2, mp2 = _run("bf16-master", seed=1)
    before = _snapshot(model2, opt2, mp2)
    gen = torch.Generator().manual_seed(0)
    for n, (offset, size) in enumerate(records):
        at = offset + int(torch.randint(size, (), generator=gen))
        bit = int(torch.randint(8, (), generator=gen))
        data = bytearray(good)
        data[at] ^= 1 << bit
        path.write_bytes(bytes(data))
        with pytest.raises(ValueError, match=re.escape(f"checkpoint {str(path)!r} is corrupt: its ")) as info:
            load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)
        assert "does not match the checksum save_checkpoint stored" in str(info.value), n
        assert "Nothing was loaded; restore the file from a good copy" in str(info.value)
        assert _unchanged(before, _snapshot(model2, opt2, mp2)), n
    path.write_bytes(good)
    load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)


def test_a_checkpoint_written_before_checksums_loads_quietly(tmp_path):
    model, opt, mp = _run("fp16-mixed")
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp, extra={"epoch": 2})
    payload = torch.load(path, weights_only=True)
    assert payload["checksum"]["algorithm"] == "crc32/1"
    del payload["checksum"], payload["optimizer_classes"]
    torch.save(payload, path)
    model2, opt2, mp2 = _run("fp16-mixed", seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2) == {"epoch": 2}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True))


def test_checksums_of_an_unknown_kind_are_refused(tmp_path):
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=nn.Linear(2, 2))
    payload = torch.load(path, weights_only=True)
    payload["checksum"] = {"algorithm": "sha9"}
    torch.save(payload, path)
    with pytest.raises(ValueError, match=re.escape(
        f"checkpoint {str(path)!r} holds checksums of an unknown kind ('sha9', this mixprec knows 'crc32/1')"
    )):
        load_checkpoint(path, model=nn.Linear(2, 2))


def test_keys_a_scheduler_adds_to_the_groups_are_not_required():
    _, opt, _ = _run("bf16-master")
    sd = opt.state_dict()
    _, opt2, _ = _run("bf16-master", seed=1)
    torch.optim.lr_scheduler.StepLR(opt2, 1)  # adds 'initial_lr' to opt2's groups, not to the saved ones
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["betas"] == (0.9, 0.999)


# ------------------------------------------- the MixedPrecision state is never dropped silently
def test_a_checkpoint_saved_with_mp_is_refused_without_it_and_changes_nothing(tmp_path):
    model, opt, mp = _run("fp16-mixed")
    mp.scaler.update(1024.0)
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    model2, opt2, mp2 = _run("fp16-mixed", seed=1)
    before = _snapshot(model2, opt2, mp2)
    with pytest.raises(ValueError, match=r"holds the MixedPrecision state it was saved with \(plan 'fp16-mixed', "
                       rf"loss scale 1024, {mp.state_dict()['optimizer_steps']} optimizer steps.*no mp= was given.*mp=mp\).*allow_plan_change=True"):
        load_checkpoint(path, model=model2, optimizers=[opt2])
    assert _unchanged(before, _snapshot(model2, opt2, mp2))
    load_checkpoint(path, model=model2, optimizers=[opt2], mp=mp2)  # the way that works
    assert mp2.scaler.get_scale() == 1024.0 and mp2.state_dict()["optimizer_steps"] == mp.state_dict()["optimizer_steps"]


def test_leaving_mixprec_on_purpose_says_what_the_load_does_not_restore(tmp_path):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    mp = MixedPrecision("bf16-mixed")
    model, opt, sched = mp.prepare(model, opt, scheduler=sched)
    _train(model, mp, 2)
    path = tmp_path / "c.pt"
    save_checkpoint(path, model=model, optimizers=[opt], mp=mp)
    plain = _model(1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"LR scheduler's state .* does not restore; load it yourself"):
        load_checkpoint(path, model=plain, optimizers=[plain_opt], allow_plan_change=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True))
