"""`doctor`: each known DFlash pitfall built on purpose is flagged with the right line; a healthy drafter passes.

Shifted labels are built by construction: an oracle drafter that knows the target's greedy transcripts and
puts the token at anchor + k (healthy) or anchor + k + 1 (trained with labels shifted by one) in slot k.
"""

from __future__ import annotations

import json

import torch

from dflashkit.cli import main
from dflashkit.diagnose.doctor import (
    capture_findings,
    chat_template_findings,
    geometry_finding,
    greedy_reference,
    mask_finding,
    run_doctor,
)
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.target.model import Target
from helpers.checkpoints import small_config, write_checkpoint


class OracleDrafter(DFlashDrafter):
    """Slot k predicts transcript[anchor + k + shift]; the anchor token is read back from slot 0's embedding."""

    def __init__(self, cfg, target: Target, transcripts: list[list[int]], shift: int = 0) -> None:
        super().__init__(cfg)
        self.embed, self.transcripts, self.shift = target.embed_weight, transcripts, shift

    def forward(
        self, context_features, block_embeds, *, context_positions, block_positions, cache=None, attention_mask=None
    ):
        anchor = int((self.embed == block_embeds[0, 0]).all(-1).float().argmax())
        p0 = int(block_positions[0, 0])
        seq = next((t for t in self.transcripts if len(t) > p0 and t[p0] == anchor), None)
        out = torch.zeros(1, block_embeds.shape[1], self.config.vocab_size)  # (1, bs, V) "logits"
        for k in range(block_embeds.shape[1]):
            if seq is not None and 0 <= p0 + k + self.shift < len(seq):
                out[0, k, seq[p0 + k + self.shift]] = 1.0
        return out

    def logits(self, hidden, lm_head_weight):
        return hidden


def lines(report) -> list[str]:
    return [f.line() for f in report.findings]


def test_healthy_drafter_passes_doctor(tmp_path, tiny_llama_dir, capsys):
    path = write_checkpoint(tmp_path / "ok", small_config())
    code = main(
        ["doctor", "--target", str(tiny_llama_dir), "--drafter", str(path), "--prompts", "2", "--max-new-tokens", "10"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "FAIL" not in out.replace("0 FAIL", "")
    for check in (
        "OK hidden size",
        "OK vocabulary",
        "OK target layers: [1, 2, 3, 4, 5] of 8, distinct",
        "OK fc width",
        "OK geometry",
        "OK chat template",
        "OK feature capture",
        "OK verifier logits",
        "OK mask token: learned mask embedding",
        "draft-and-verify: output equals greedy on 2 prompts",
    ):
        assert check in out
    assert (
        main(
            [
                "doctor",
                "--target",
                str(tiny_llama_dir),
                "--drafter",
                str(path),
                "--prompts",
                "1",
                "--max-new-tokens",
                "4",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["exit_code"] == 0


def test_four_of_five_fc_fails(tmp_path, tiny_llama_dir, capsys):
    path = write_checkpoint(tmp_path / "four", small_config(), fc_features=4)
    code = main(
        ["doctor", "--target", str(tiny_llama_dir), "--drafter", str(path), "--prompts", "1", "--max-new-tokens", "4"]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert (
        "FAIL fc width: fc reads 4 target layers, config names 5 — fix: retrain with an fc over every named "
        "layer (docs/troubleshooting.md#pitfall-fc-layers)" in out
    )
    assert "FAIL load:" in out and "WARN draft-and-verify: not run" in out


def test_geometry_copied_from_target(tmp_path, wide_head_target):
    target = Target.load(wide_head_target)  # 2 heads × 32, 4 layers
    copied = small_config(
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_target_layers=4, target_layer_ids=[0, 1, 2]
    )
    report = run_doctor(target, write_checkpoint(tmp_path / "copy", copied), prompts=1, max_new_tokens=4)
    assert (
        "WARN geometry: drafter attention geometry (2 heads × 32) equals the target's; on a small target this "
        "may be chance — fix: rebuild the drafter with its own geometry (dflashkit's default for hidden 64: "
        "4 heads × 16, 2 kv)"
    ) in lines(report)
    own = small_config(num_target_layers=4, target_layer_ids=[0, 1, 2])
    report = run_doctor(target, write_checkpoint(tmp_path / "own", own), prompts=1, max_new_tokens=4)
    assert "OK geometry: drafter has its own attention geometry (4 heads × 16; target 2 heads × 32)" in lines(report)
    # a large target: Qwen3.6-27B's own 24 heads × 256 copied from Qwen3.6-27B is a FAIL; z-lab's 32 × 128 is fine
    assert (
        geometry_finding(24, 256, 24, 256, 5120)
        .line()
        .startswith(
            "FAIL geometry: drafter attention geometry (24 heads × 256) was copied from the target "
            "(docs/troubleshooting.md#pitfall-geometry)"
        )
    )
    assert geometry_finding(32, 128, 32, 128, 4096).status == "OK"


def test_features_from_wrong_layers(tmp_path, target):
    # a checkpoint built for a 12-layer target, run on an 8-layer one
    cfg = small_config(num_target_layers=12, target_layer_ids=[1, 4, 7, 10])
    report = run_doctor(target, write_checkpoint(tmp_path / "deep", cfg), prompts=1, max_new_tokens=4)
    assert report.exit_code == 1
    assert any(
        x.startswith(
            "FAIL target layers: target_layer_ids [10] out of range: the target has 8 decoder "
            "layers (ids [1, 4, 7, 10])"
        )
        for x in lines(report)
    )
    # features captured from other layers than the checkpoint names
    from dflashkit.features.manifest import Manifest, target_fingerprint

    feats = tmp_path / "features"
    feats.mkdir()
    Manifest(
        target={"fingerprint": target_fingerprint(target), "source": "tiny", "hidden_size": 64},
        layer_ids=[0, 2, 4, 6, 7],
        dtype="fp32",
        store_target_tokens=False,
        shard_max_tokens=1,
        samples_sha256="",
        tokens_file=None,
        shards=[{"first": 0, "count": 1, "tokens": 1, "file": "shard-00000.safetensors", "done": False, "bytes": 0}],
        samples=[{"id": "s0", "shard": 0, "length": 1, "supervised": 1}],
    ).save(feats)
    report = run_doctor(
        target, write_checkpoint(tmp_path / "ok", small_config()), prompts=1, max_new_tokens=4, features=feats
    )
    assert any(
        x.startswith(
            f"FAIL features: capture dir {feats} was made with target_layer_ids [0, 2, 4, 6, 7] but the drafter "
            f"needs [1, 2, 3, 4, 5] (layers [1, 3, 5] were not captured)"
        )
        for x in lines(report)
    )


def test_hook_reading_the_wrong_layer_is_caught(target, monkeypatch):
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(0))
    assert all(f.status == "OK" for f in capture_findings(target, [2, 5, 7], ids))
    real = target.forward
    monkeypatch.setattr(
        target, "forward", lambda x, layer_ids=(), **kw: real(x, layer_ids=[i - 1 for i in layer_ids], **kw)
    )
    found = capture_findings(target, [2, 5], ids)
    assert found[0].line().startswith("FAIL feature capture: layer 2: differs from output_hidden_states[3]")
    assert "closest is output_hidden_states[2]" in found[0].what


def test_shifted_labels_are_detected(target):
    prompts = [torch.randint(3, 97, (10 + i,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    transcripts = [p + greedy_reference(target, p, 12) for p in prompts]
    cfg = small_config(block_size=4)
    healthy = run_doctor(target, OracleDrafter(cfg, target, transcripts), prompt_ids=prompts, max_new_tokens=12)
    assert healthy.exit_code == 0, healthy.render()
    assert healthy.tau > 2.5 and healthy.offsets[0] == 1.0
    assert any(
        x.startswith("OK label shift: slot k predicts the token at a+k (teacher-forced accuracy")
        for x in lines(healthy)
    )
    shifted = run_doctor(
        target, OracleDrafter(cfg, target, transcripts, shift=1), prompt_ids=prompts, max_new_tokens=12
    )
    assert shifted.exit_code == 1 and shifted.offsets[1] == 1.0
    assert any(
        x.startswith(
            "FAIL label shift: slot k predicts the token at a+k+1 far better than the one at a+k "
            "(teacher-forced accuracy a+k-1:"
        )
        and "labels or features shifted by one (docs/troubleshooting.md#pitfall-label-shift)" in x
        for x in lines(shifted)
    )
    # decoding stays lossless (the verifier rejects the shifted drafts), only τ collapses
    assert any(
        x.startswith(("OK draft-and-verify", "WARN draft-and-verify: output equals greedy")) for x in lines(shifted)
    )
    assert shifted.tau < healthy.tau


def test_mask_token_and_chat_template_checks(target):
    transcripts = [[5, 6, 7, 8]]
    assert (
        mask_finding(small_config(learned_mask_embedding=False, mask_token_id=7), None, target, transcripts)
        .line()
        .startswith("FAIL mask token: mask_token_id 7 occurs in ordinary text")
    )
    assert (
        mask_finding(small_config(learned_mask_embedding=False, mask_token_id=9), None, target, transcripts).status
        == "WARN"
    )  # no tokenizer on the tiny target to check against
    zero = DFlashDrafter(small_config())
    torch.nn.init.zeros_(zero.mask_embedding)
    assert mask_finding(zero.config, zero, target, transcripts).status == "FAIL"
    rec = small_config(extra={"chat_template": {"present": True, "thinking_switch": True}})
    (f,) = chat_template_findings(rec, target)
    assert f.line().startswith(
        "FAIL chat template: present: True at training, False now; thinking_switch: True at training, False now"
    )
    (f,) = chat_template_findings(small_config(extra={}), target)
    assert f.status == "WARN" and "not recorded at training" in f.what


def test_unreadable_drafter_is_named(tmp_path, tiny_llama_dir, capsys):
    path = write_checkpoint(tmp_path / "broken", small_config())
    (path / "model.safetensors").write_bytes(b"\x00\x00")
    assert (
        main(
            [
                "doctor",
                "--target",
                str(tiny_llama_dir),
                "--drafter",
                str(path),
                "--prompts",
                "1",
                "--max-new-tokens",
                "2",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "FAIL files: model.safetensors is not a readable safetensors file" in out
    assert main(["doctor", "--target", str(tiny_llama_dir), "--drafter", str(tmp_path / "missing")]) == 1
    assert f"checkpoint {tmp_path / 'missing'} does not exist" in capsys.readouterr().out


def test_doctor_on_a_dspark_drafter(tmp_path, tiny_llama_dir, capsys):
    """A DSpark drafter (every slot drafts, the next position) passes doctor's checks, decoding included."""
    path = write_checkpoint(tmp_path / "sp", small_config(kind="dspark", markov_rank=8))
    code = main(
        ["doctor", "--target", str(tiny_llama_dir), "--drafter", str(path), "--prompts", "2", "--max-new-tokens", "10"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "draft-and-verify: output equals greedy on 2 prompts" in out and "FAIL label shift" not in out
