"""AdamW's implementation chosen by measurement: the faster candidate wins, ranks decide on summed timings, the
candidates give the same update, the measurement never touches the drafter, a run records its choice and keeps it
on resume, and the settings that cannot work are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflashkit.errors import ConfigError
from dflashkit.train import optimizer_choice
from dflashkit.train.config import TrainConfig
from dflashkit.train.optimizer_choice import (
    available_impls,
    choose_adamw_impl,
    make_adamw,
    time_adamw_step,
)
from helpers.choices import set_choice

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).requires_grad_() for shape in ((64, 32), (32,), (7, 5, 3))]


def test_the_faster_candidate_wins_and_ranks_sum_their_timings(monkeypatch: pytest.MonkeyPatch) -> None:
    set_choice(monkeypatch, "optimizer", None)
    assert available_impls(torch.device("cpu")) == ["fused", "foreach"]
    fast = {"fused": 0.002, "foreach": 0.005}
    assert choose_adamw_impl(_params(), timer=lambda p, impl: fast[impl]) == ("fused", {"fused": 2.0, "foreach": 5.0})
    slow_fused = {"fused": 0.004, "foreach": 0.003}
    assert choose_adamw_impl(_params(), timer=lambda p, impl: slow_fused[impl])[0] == "foreach"

    def other_rank_adds(ms: torch.Tensor) -> torch.Tensor:  # a peer that found fused much slower
        return ms + torch.tensor([10.0, 0.0], dtype=ms.dtype)

    impl, timings = choose_adamw_impl(_params(), timer=lambda p, impl: fast[impl], all_reduce=other_rank_adds)
    assert impl == "foreach" and timings == {"fused": 12.0, "foreach": 5.0}


def test_the_environment_names_one_and_a_bad_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(p, impl):
        raise AssertionError("measured although named")

    set_choice(monkeypatch, "optimizer", "foreach")
    assert choose_adamw_impl(_params(), timer=never) == ("foreach", {})
    set_choice(monkeypatch, "optimizer", "turbo")
    with pytest.raises(ConfigError, match=r"DFLASHKIT_CHOICES: optimizer='turbo'.*fused, foreach, default"):
        choose_adamw_impl(_params(), timer=never)


def test_every_candidate_makes_the_same_update_and_timing_leaves_the_drafter_alone() -> None:
    stepped = []
    for impl in ("fused", "foreach", "default"):
        ps = _params()
        for i, p in enumerate(ps):
            p.grad = torch.full_like(p, 0.1 * (i + 1)) + torch.linspace(-1, 1, p.numel()).view_as(p)
        opt = make_adamw(ps, impl, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01)
        for _ in range(3):
            opt.step()
        stepped.append([p.detach().clone() for p in ps])
    for other in stepped[1:]:
        for a, b in zip(stepped[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    ps = _params()
    before = [p.detach().clone() for p in ps]
    assert time_adamw_step(ps, "fused", repeats=2) > 0
    assert all(torch.equal(a, b) and p.grad is None for a, b, p in zip(before, ps, ps, strict=True))
    with pytest.raises(ValueError, match="one of fused, foreach, default"):
        make_adamw(_params(), "turbo", lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)


def test_a_run_records_its_measured_choice_and_keeps_it_on_resume(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from dflashkit.data.samples import Sample
    from dflashkit.target.model import Target
    from dflashkit.train.loop import train

    target = Target.load(tiny_llama_dir)
    set_choice(monkeypatch, "optimizer", None)
    calls = []

    def measured(params, impl):
        calls.append(impl)
        return {"fused": 0.009, "foreach": 0.001}[impl]  # foreach "faster" here: not torch's default either

    monkeypatch.setattr(optimizer_choice, "time_adamw_step", measured)
    g = torch.Generator().manual_seed(0)
    width = 3 * target.hidden_size
    samples = [
        Sample(f"s{i}", torch.randint(3, 97, (24,), generator=g), torch.ones(24, dtype=torch.bool),
               torch.randn(24, width, generator=g))
        for i in range(3)
    ]  # fmt: skip
    drafter = {"num_hidden_layers": 1, "block_size": 4, "target_layer_ids": [1, 3, 5]}
    cfg = dict(
        out=str(tmp_path / "run"), drafter=drafter, max_tokens=48, save_every=2, progress=False, tensorboard=False
    )

    def kill(end) -> None:
        if end.step == 2:
            raise RuntimeError("simulated kill")

    with pytest.raises(RuntimeError, match="simulated kill"):
        train(TrainConfig(**cfg, max_steps=4), dataset=samples, target=target, callbacks=[kill])
    assert calls == ["fused", "foreach"]
    assert "AdamW: fused 9.0 ms/step, foreach 1.0 ms/step on this machine → foreach" in capsys.readouterr().out
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-000002" / "train_state.pt", weights_only=True)
    assert state["state"]["optimizer_impl"] == "foreach"
    seen = []
    train(TrainConfig(**cfg, max_steps=4), dataset=samples, target=target, callbacks=[lambda e: seen.append(e.run)])
    assert calls == ["fused", "foreach"]  # not measured again: the run's own choice
    assert seen[-1].state.optimizer_impl == "foreach" and seen[-1].optimizer.defaults["foreach"] is True
    with pytest.raises(ConfigError, match='optimizer_impl = "fused": expected auto, foreach or default with fsdp'):
        TrainConfig(**cfg, fsdp=True, optimizer_impl="fused").validate()
