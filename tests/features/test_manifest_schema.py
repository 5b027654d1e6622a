"""A damaged or hand-edited manifest.json is refused by name before any shard is read or written: wrong types, a
shard file outside the capture directory (which `capture` would otherwise overwrite), shards that do not tile the
samples. Manifests as `capture` writes them — partial, complete, older ones without the later options — load."""

from __future__ import annotations

import json

import pytest
import torch

from dflashkit.data.samples import Sample
from dflashkit.errors import DataError
from dflashkit.features.capture import CaptureSettings, capture
from dflashkit.features.captured import CapturedFeatures
from dflashkit.features.manifest import MANIFEST_NAME, Manifest
from dflashkit.features.manifest_schema import manifest_problem
from dflashkit.target.model import Target


@pytest.fixture(scope="module")
def captured(tiny_llama_dir, tmp_path_factory):
    """A finished capture of 4 samples in 3 shards, and the samples."""
    target = Target.load(tiny_llama_dir)
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(id=f"s{j}", input_ids=torch.randint(3, 97, (n,), generator=g), loss_mask=torch.ones(n, dtype=torch.bool))
        for j, n in enumerate([6, 5, 9, 4])
    ]
    out = tmp_path_factory.mktemp("capture")
    capture(
        target,
        samples,
        out,
        progress=False,
        log=None,
        settings=CaptureSettings(layer_ids=[1, 3], dtype="fp32", shard_max_tokens=12),
    )
    return target, samples, out


def _manifest(out) -> dict:
    return json.loads((out / MANIFEST_NAME).read_text())


def test_manifests_as_capture_writes_them_pass(captured):
    _, _, out = captured
    raw = _manifest(out)
    assert len(raw["shards"]) == 3 and manifest_problem(raw) is None
    for shard in raw["shards"]:  # a capture that has not started: no shard done, no checksums yet
        shard.update(done=False, bytes=0)
        shard.pop("sha256")
    for option in ("store_topk", "store_target_lse", "data"):  # written before those options existed
        raw.pop(option)
    assert manifest_problem(raw) is None


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda m: m.update(layer_ids="x"), 'layer_ids = "x": expected a list'),
        (lambda m: m["shards"][1].update(count="2"), 'shards[1].count = "2": expected an integer'),
        (lambda m: m["shards"][1].update(done="yes"), 'shards[1].done = "yes": expected true or false'),
        (lambda m: m.update(dtype="q8"), "dtype = \"q8\": expected 'bf16', 'fp16' or 'fp32'"),
        (lambda m: m["target"].update(hidden_size="64"), 'target.hidden_size = "64": expected an integer'),
        (lambda m: m.update(shards={"a": 1}), 'shards = {"a": 1}: expected a list'),
        (lambda m: m["shards"][1].update(first=1), "shards[1].first = 1: expected 2 (where shard 0 ends)"),
        (lambda m: m["samples"][0].update(shard=2), "samples[0].shard = 2: expected the shard that holds sample 0"),
        (lambda m: m["samples"].pop(), "the shards hold 4 samples but 'samples' lists 3"),
    ],
)
def test_a_damaged_manifest_is_named_by_field(captured, tmp_path, change, message):
    _, _, out = captured
    raw = _manifest(out)
    change(raw)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(DataError) as e:
        Manifest.load(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / MANIFEST_NAME}: malformed manifest (") and message in str(e.value)


@pytest.mark.parametrize("name", ["../tokens.jsonl", "/abs/victim.safetensors", "sub/shard.safetensors", "..x"])
def test_a_shard_outside_the_capture_directory_is_never_written(captured, tmp_path, name):
    """A manifest naming a shard file outside its directory: `capture` refuses it instead of "redoing" that shard
    over someone else's file (here the input next to the capture dir)."""
    target, samples, out = captured
    run = tmp_path / "run"
    run.mkdir()
    for f in out.iterdir():
        (run / f.name).write_bytes(f.read_bytes())
    victim = tmp_path / "tokens.jsonl"
    victim.write_text("the user's data\n")
    raw = _manifest(run)
    raw["shards"][1].update(file=name.replace("/abs", str(tmp_path)), done=False)
    (run / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(DataError, match=r"shards\[1\]\.file = .*expected a file name in the capture directory"):
        capture(
            target,
            samples,
            run,
            progress=False,
            log=None,
            settings=CaptureSettings(layer_ids=[1, 3], dtype="fp32", shard_max_tokens=12),
        )
    with pytest.raises(DataError, match=r"expected a file name in the capture directory"):
        CapturedFeatures(run)
    assert victim.read_text() == "the user's data\n"
    assert not (tmp_path / "victim.safetensors").exists()
