"""keep_best: OUT/best holds the drafter of the validation pass with the highest τ — bit-exactly the weights of that
step — survives a kill + resume, and is refused without validation passes to choose from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.data.samples import Sample
from dflashkit.drafter.checkpoint import read_tensors
from dflashkit.errors import ConfigError
from dflashkit.target.model import Target
from dflashkit.train.config import TrainConfig
from dflashkit.train.loop import train
from dflashkit.train.metrics import read_metrics

DRAFTER = {"num_hidden_layers": 1, "block_size": 4}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def samples(target: Target) -> list[Sample]:
    """Four copies of one sequence: the held-out copy is learnable, so validation τ moves as training goes."""
    from dflashkit.drafter.defaults import default_drafter_config

    layer_ids = default_drafter_config(target, **DRAFTER).target_layer_ids
    ids = torch.randint(3, target.vocab_size, (30,), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(30, dtype=torch.bool)
    mask[:4] = False
    res = target.forward(ids[None], layer_ids=layer_ids)
    return [Sample(f"s{i}", ids, mask, res.features[0], res.logits[0].argmax(-1)) for i in range(4)]


def cfg_for(out: Path, **kw) -> TrainConfig:
    base = dict(
        out=str(out),
        drafter=dict(DRAFTER),
        max_tokens=64,
        max_steps=10,
        save_every=1,
        keep_checkpoints=0,
        progress=False,
        tensorboard=False,
        lr=1e-2,
        val_samples=1,
        eval_every=1,
        keep_best=True,
    )
    base.update(kw)
    return TrainConfig(**base)


def damage_after(step: int):
    """A callback that scrambles the drafter's weights after `step`: later validation passes get worse."""

    def hook(end) -> None:
        if end.step == step:
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in end.run.module.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * p.detach().std().clamp_min(1e-3))

    return hook


def val_taus(out: Path) -> dict[int, float]:
    return {r["step"]: r["tau"] for r in read_metrics(out / "metrics.jsonl") if r["split"] == "val"}


def test_best_is_the_highest_validation_pass_bit_exact(tmp_path: Path, target: Target, samples) -> None:
    res = train(cfg_for(tmp_path, max_steps=10), dataset=samples, target=target, callbacks=[damage_after(6)])
    taus = val_taus(tmp_path)
    assert sorted(taus) == list(range(1, 11))
    first_best = min(s for s, t in taus.items() if t == max(taus.values()))  # a tie keeps the earlier pass
    assert max(taus[s] for s in range(1, 7)) > max(taus[s] for s in range(7, 11)), taus  # the damage shows
    assert res.best_val_step == first_best < 10 and res.best_val_tau == pytest.approx(taus[first_best])
    assert res.best_dir == tmp_path / "best"
    best, at_step = read_tensors(tmp_path / "best"), read_tensors(tmp_path / "checkpoints" / f"step-{first_best:06d}")
    assert best.keys() == at_step.keys()
    for k in best:
        assert torch.equal(best[k], at_step[k]), k
    meta = json.loads((tmp_path / "best" / "best.json").read_text())
    assert meta["step"] == first_best and meta["val"]["tau"] == pytest.approx(taus[first_best])
    final = read_tensors(tmp_path / "final")  # final is still the last step
    assert all(torch.equal(final[k], read_tensors(tmp_path / "checkpoints" / "step-000010")[k]) for k in final)


def test_best_survives_a_kill_and_resume(tmp_path: Path, target: Target, samples) -> None:
    straight = train(cfg_for(tmp_path / "a"), dataset=samples, target=target, callbacks=[damage_after(6)])

    def kill(end) -> None:
        if end.step == 8:
            raise RuntimeError("simulated kill")

    with pytest.raises(RuntimeError, match="simulated kill"):
        train(cfg_for(tmp_path / "b"), dataset=samples, target=target, callbacks=[damage_after(6), kill])
    resumed = train(cfg_for(tmp_path / "b"), dataset=samples, target=target, callbacks=[damage_after(6)])
    assert resumed.step == 10 and resumed.best_val_step == straight.best_val_step
    a, b = read_tensors(tmp_path / "a" / "best"), read_tensors(tmp_path / "b" / "best")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_without_keep_best_no_best_dir(tmp_path: Path, target: Target, samples) -> None:
    res = train(cfg_for(tmp_path, max_steps=2, keep_best=False), dataset=samples, target=target)
    assert res.best_dir is None and not (tmp_path / "best").exists()


@pytest.mark.parametrize("kw", [{"eval_every": 0}, {"val_samples": None}])
def test_keep_best_without_validation_passes_is_refused(kw, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"test.yaml: keep_best = true: expected validation passes with it: eval_every > 0"
    ):
        cfg_for(tmp_path, **kw).validate(source="test.yaml")


def test_quickstart_screen_names_the_chosen_step() -> None:
    from dflashkit.quickstart.screen import _chosen_step

    assert _chosen_step({"steps": 700, "final": "f"}) == ""
    assert (
        _chosen_step({"steps": 700, "best_step": 700, "best_val_tau": 1.252})
        == "; drafter of the last step (best validation τ 1.25)"
    )
    assert (
        _chosen_step({"steps": 2800, "best_step": 1300, "best_val_tau": 1.29})
        == "; drafter of step 1300 (best validation τ 1.29)"
    )
