"""The real engine: dflashkit's serving export inside vLLM's CPU build (opt-in: `pytest -m vllm`, skipped unless
scripts/setup_vllm.sh has made .venv-vllm; about 15 minutes on a 2-core CPU, mostly vLLM start-ups).

A short quickstart trains a drafter of the quickstart's shape (reduced 8192-token vocabulary, the row of
`<empty_output>` as mask, block 4), so acceptance is not zero; from it:
- the quickstart's drafter, a learned-mask drafter (the mask vector is another row, so it drafts differently from
  the row mask vLLM falls back to), the same body over the full vocabulary, and an untrained block-16 drafter each
  load in vLLM with output identical to dflashkit's greedy output and drafts / accepted per position equal to
  dflashkit's chain decoding, per prompt (`serve-check`);
- without its mask_embedding.pt the learned-mask drafter still loads in vLLM, runs another drafter, and
  serve-check says so (the silent failure it exists to catch);
- the quickstart's drafter exported in the speculators layout (`--to speculators`), which vLLM reads natively.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflashkit.drafter.checkpoint import MASK_FILE
from dflashkit.export.convert import load_any
from dflashkit.export.serve_check import serve_check, vllm_python
from dflashkit.export.serving import write_serving

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.integration,
    pytest.mark.timeout(2400),
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM environment (scripts/setup_vllm.sh)"),
]

MINI = [
    "--regen-minutes",
    "0.3",
    "--regen-batch",
    "8",
    "--max-new-tokens-regen",
    "64",
    "--original-text",
    "40",
    "--train-minutes",
    "2.5",
    "--eval-prompts",
    "1",
    "--eval-max-new-tokens",
    "8",
    "--methods",
    "ar,chain",
]


@pytest.fixture(scope="module")
def target():
    from dflashkit.target.model import Target

    return Target.load("default")


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    from dflashkit.evaluate.stats import load_prompts

    found, _ = load_prompts(target, "mtbench", limit=3, max_new_tokens=40)
    return [list(p.ids) for p in found]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    from dflashkit.cli import main

    out = tmp_path_factory.mktemp("vllm_engine") / "qs"
    assert main(["quickstart", "--out", str(out), *MINI]) == 0
    return out / "drafter"


def _variant(trained: Path, out: Path, target, change) -> Path:
    cfg, tensors, _ = load_any(trained)
    cfg, tensors = change(cfg, dict(tensors))
    write_serving(out, cfg, tensors, target.lm_head_weight, str(trained))
    return out


def _learned(target):
    def change(cfg, tensors):
        tensors["mask_embedding"] = target.embed_weight[0].detach().clone()  # another row than the trained mask's
        return cfg.replace(learned_mask_embedding=True), tensors

    return change


def _full_vocab(cfg, tensors):
    tensors.pop("draft_to_target")
    return cfg.replace(draft_vocab_size=None), tensors


def _check(target, drafter_dir, prompts, *, accepted: bool):
    report = serve_check(target, drafter_dir, prompts=prompts, max_new_tokens=40, progress=False)
    print("\n" + report.render())
    assert report.agrees, report.render()
    ours = report.engines[0].ours
    assert sum(c.drafts for c in ours) >= len(prompts) * 10
    assert (sum(c.accepted for c in ours) > 0) == accepted, report.render()
    return report


def test_the_quickstart_drafter_runs_in_vllm_as_dflashkit_measures(target, trained, prompts):
    assert (trained / "config.json").is_file() and not (trained / MASK_FILE).exists()
    _check(target, trained, prompts, accepted=True)


def test_a_learned_mask_runs_in_vllm_and_its_loss_is_caught(target, trained, prompts, tmp_path):
    learned = _variant(trained, tmp_path / "learned", target, _learned(target))
    assert (learned / MASK_FILE).is_file()
    _check(target, learned, prompts, accepted=True)
    (learned / MASK_FILE).unlink()  # vLLM now feeds the row mask_token_id: another drafter, no error
    report = serve_check(target, learned, prompts=prompts, max_new_tokens=40, progress=False)
    assert not report.agrees and "different acceptance" in report.engines[0].mismatches[0], report.render()


def test_the_full_vocabulary_drafter_runs_in_vllm(target, trained, prompts, tmp_path):
    full = _variant(trained, tmp_path / "full", target, _full_vocab)
    _check(target, full, prompts, accepted=True)


def test_an_untrained_block_16_drafter_runs_in_vllm(target, prompts, tmp_path):
    from dflashkit.drafter.defaults import default_drafter_config
    from dflashkit.drafter.model import DFlashDrafter
    from dflashkit.export.serving import write_serving as write

    cfg = default_drafter_config(target, num_hidden_layers=1, block_size=16)
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    tensors = {k: v.detach() for k, v in d.state_dict().items() if not k.startswith("rotary_emb.")}
    write(tmp_path / "b16", cfg, tensors, None, "untrained")
    report = _check(target, tmp_path / "b16", prompts, accepted=False)
    assert len(report.engines[0].theirs[0].accepted_per_pos) == 15


def test_the_speculators_export_runs_in_vllm_as_dflashkit_measures(target, trained, prompts, tmp_path):
    """vLLM reads the speculators layout natively: the quickstart's drafter exported `--to speculators` (reduced
    vocabulary, layer ids + 1, the geometry nested) drafts in vLLM exactly as dflashkit measures it."""
    from dflashkit.export.convert import convert

    convert(trained, tmp_path / "spec", to="speculators", target=target)
    _check(target, tmp_path / "spec", prompts, accepted=True)
