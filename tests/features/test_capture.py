"""Feature capture: stored features equal output_hidden_states[i + 1], target tokens equal the final-layer argmax,
shards round-trip, a killed capture resumes to identical files, the online source matches, bad input is named."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from dflashkit.cpu_products import stock_products
from dflashkit.data.samples import Sample
from dflashkit.errors import DataError
from dflashkit.features.capture import CaptureSettings, capture
from dflashkit.features.captured import CapturedFeatures
from dflashkit.features.manifest import MANIFEST_NAME, Manifest, plan_shards
from dflashkit.features.online import OnlineFeatures
from dflashkit.target.model import Target

LAYERS = [1, 4, 6]


def make_samples(lengths: list[int], seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for j, n in enumerate(lengths):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 3 :] = True  # a "prompt" then a supervised "response"
        out.append(Sample(id=f"s{j}", input_ids=torch.randint(3, 97, (n,), generator=g), loss_mask=mask))
    return out


@pytest.fixture(scope="module")
def llama(tiny_target_dirs) -> Target:
    return Target.load(tiny_target_dirs["llama"])


@pytest.fixture(scope="module")
def qwen3(tiny_target_dirs) -> Target:
    return Target.load(tiny_target_dirs["qwen3"])


def quiet(target, samples, out, **kw):
    """capture() without output; `kw` holds CaptureSettings fields (layer_ids: LAYERS unless given) and arguments."""
    kw.setdefault("layer_ids", LAYERS)
    names = {f.name for f in fields(CaptureSettings)}
    settings = CaptureSettings(**{k: v for k, v in kw.items() if k in names})
    rest = {k: v for k, v in kw.items() if k not in names}
    return capture(target, samples, out, settings=settings, progress=False, log=None, **rest)


def dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_features_equal_hidden_states_and_tokens_equal_final_argmax(llama, tmp_path, dtype):
    samples = make_samples([7, 12, 5])
    quiet(llama, samples, tmp_path, dtype=dtype)
    ds = CapturedFeatures(tmp_path, expect_target=llama, expect_layer_ids=LAYERS)
    tol = dict(rtol=0, atol=0) if dtype == "fp32" else dict(rtol=1e-2, atol=1e-2)  # bf16: 8 mantissa bits
    for s, got in zip(samples, ds, strict=True):
        with stock_products():  # capture's own products (a one-off pass): not a width an earlier decode settled
            ref = llama.model(input_ids=s.input_ids[None], output_hidden_states=True)
        want = torch.cat([ref.hidden_states[i + 1][0] for i in LAYERS], dim=-1)  # (T, K·H)
        assert got.features.dtype == torch.float32 and got.features.shape == want.shape
        torch.testing.assert_close(got.features, want, **tol)
        if dtype == "bf16":
            torch.testing.assert_close(got.features, want.to(torch.bfloat16).float(), rtol=0, atol=0)
        assert torch.equal(got.target_tokens, ref.logits[0].argmax(-1))


def test_hybrid_target_capture(tiny_hybrid_dir, tmp_path):
    target = Target.load(tiny_hybrid_dir)
    samples = make_samples([9, 6])
    quiet(target, samples, tmp_path, dtype="fp32", layer_ids=[0, 3, 7])
    for s, got in zip(samples, CapturedFeatures(tmp_path), strict=True):
        ref = target.model(input_ids=s.input_ids[None], output_hidden_states=True)
        want = torch.cat([ref.hidden_states[i + 1][0] for i in (0, 3)], dim=-1)
        torch.testing.assert_close(got.features[:, :128], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.target_tokens, ref.logits[0].argmax(-1))


def test_round_trip_through_several_shards(llama, tmp_path):
    lengths = [5, 9, 4, 11, 6, 3, 8]
    samples = make_samples(lengths)
    m = quiet(llama, samples, tmp_path, dtype="fp16", shard_max_tokens=15, store_target_tokens=False)
    assert [(s["first"], s["count"]) for s in m.shards] == [(0, 2), (2, 2), (4, 2), (6, 1)]
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [f"shard-0000{i}.safetensors" for i in range(4)]
    on_disk = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert on_disk["totals"] == {
        "samples": 7,
        "tokens": sum(lengths),
        "supervised": m.total_supervised,
        "done_samples": 7,
        "bytes": m.bytes,
        "complete": True,
    }
    assert on_disk["target"]["hidden_size"] == 64 and on_disk["layer_ids"] == LAYERS
    ds = CapturedFeatures(tmp_path, max_open_shards=1)  # forces handle eviction
    assert len(ds) == 7 and ds.lengths == lengths and ds.layer_ids == LAYERS
    for i in [6, 0, 3, 1, -1]:
        got, want = ds[i], samples[i]
        assert got.id == want.id and torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.loss_mask, want.loss_mask) and got.target_tokens is None
        assert got.features.shape == (len(want), 3 * 64)
    assert [e["supervised"] for e in m.samples] == [s.num_supervised for s in samples]
    with pytest.raises(IndexError):
        ds[7]
    import pickle  # DataLoader workers get a pickled copy: open handles must not travel

    assert torch.equal(pickle.loads(pickle.dumps(ds))[4].features, ds[4].features)


def test_plan_shards_keeps_whole_samples():
    assert [(s["first"], s["count"]) for s in plan_shards([50, 3, 3], 10)] == [(0, 1), (1, 2)]
    assert [s["tokens"] for s in plan_shards([4, 4, 4], 100)] == [12]


def test_resume_after_kill_is_identical(llama, tmp_path):
    samples = make_samples([5, 9, 4, 11, 6, 3, 8], seed=3)
    ref_dir, dir_ = tmp_path / "ref", tmp_path / "run"
    quiet(llama, samples, ref_dir, dtype="bf16", shard_max_tokens=15)

    class Killed(Exception):
        pass

    def kill(j, m):
        raise Killed

    with pytest.raises(Killed):
        quiet(llama, samples, dir_, dtype="bf16", shard_max_tokens=15, on_shard=kill)
    assert not Manifest.load(dir_).complete and (dir_ / "shard-00000.safetensors").is_file()
    assert not (dir_ / "shard-00001.safetensors").exists()
    (dir_ / ".shard-00001.safetensors.abc.tmp").write_bytes(b"half")  # what a SIGKILL mid-write leaves:
    (dir_ / ".tmpuanqnK").write_bytes(b"half")  # ... ours, and safetensors' own (Rust's tempfile) next to it
    with pytest.raises(DataError, match=r"incomplete: 5 of 7 samples \(3 of 4 shards\).*dflashkit capture"):
        CapturedFeatures(dir_)
    first_mtime = (dir_ / "shard-00000.safetensors").stat().st_mtime_ns
    done = []
    m = quiet(llama, samples, dir_, dtype="bf16", on_shard=lambda j, m: done.append(j))  # plan kept
    assert done == [1, 2, 3] and m.complete and m.run_stats["tokens"] == 4 + 11 + 6 + 3 + 8
    assert (dir_ / "shard-00000.safetensors").stat().st_mtime_ns == first_mtime
    assert dir_bytes(dir_) == dir_bytes(ref_dir)
    # a complete capture: rerun does nothing
    before = dir_bytes(dir_)
    m = quiet(llama, samples, dir_, dtype="bf16", on_shard=lambda j, m: done.append(j))
    assert done == [1, 2, 3] and m.run_stats["tokens"] == 0 and dir_bytes(dir_) == before


def test_resume_with_other_settings_or_data_is_refused(llama, tmp_path):
    samples = make_samples([5, 9, 4])
    quiet(llama, samples, tmp_path, dtype="fp32", shard_max_tokens=10)
    with pytest.raises(DataError, match=r"already holds a capture with dtype 'fp32' but this run has 'bf16'"):
        quiet(llama, samples, tmp_path, dtype="bf16")
    with pytest.raises(DataError, match=r"layer_ids \[1, 4, 6\] but this run has \[1, 4\]"):
        quiet(llama, samples, tmp_path, dtype="fp32", layer_ids=[1, 4])
    with pytest.raises(DataError, match="samples_sha256"):
        quiet(llama, make_samples([5, 9, 4], seed=9), tmp_path, dtype="fp32")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_target_lse_is_the_log_sum_exp_of_the_final_layer_as_stored(llama, tmp_path, dtype):
    """`store_target_lse`: per position, log Σ exp of the verifier logits of the final layer's output rounded to the
    storage dtype (what training forms its draft-vocabulary logits from); the online source gives the same; the
    manifest records it, packing carries it, a resume with the other setting is refused."""
    from dflashkit.train.packing import collate_rows, pack_row

    samples = make_samples([7, 12, 5])
    last = llama.num_layers - 1
    quiet(llama, samples, tmp_path, dtype=dtype, layer_ids=[1, last], store_target_lse=True)
    ds = CapturedFeatures(tmp_path)
    assert ds.manifest.store_target_lse and not Manifest.load(tmp_path).store_topk
    online = OnlineFeatures(llama, samples, layer_ids=[1, last], store_target_lse=True)
    for s, got, on in zip(samples, ds, online, strict=True):
        stored_final = got.features[:, llama.hidden_size :]  # (T, H) as stored
        want = torch.logsumexp(llama.verifier_logits(stored_final[None])[0].double(), dim=-1)  # (T,)
        assert got.target_lse.dtype == torch.float32 and got.target_lse.shape == (len(s),)
        torch.testing.assert_close(got.target_lse.double(), want, rtol=1e-6, atol=1e-5)
        unrounded = torch.logsumexp(llama.model(input_ids=s.input_ids[None]).logits[0].double(), dim=-1)
        torch.testing.assert_close(on.target_lse.double(), unrounded, rtol=1e-6, atol=1e-5)
    row = pack_row([ds[0], ds[2]], max_tokens=12)
    assert torch.equal(row.target_lse, torch.cat([ds[0].target_lse, ds[2].target_lse]))
    cut = pack_row([ds[1]], max_tokens=10)  # cut to the row's room
    assert torch.equal(cut.target_lse, ds[1].target_lse[:10])
    batch = collate_rows([row, cut])
    assert batch.target_lse.shape == (2, 12) and torch.equal(batch.target_lse[1, 10:], torch.zeros(2))
    plain = pack_row([ds[0], Sample("x", ds[2].input_ids, ds[2].loss_mask, ds[2].features)], max_tokens=12)
    assert plain.target_lse is None and collate_rows([row, plain]).target_lse is None  # all or nothing
    assert CapturedFeatures(tmp_path, expect_layer_ids=[1]).__getitem__(0).target_lse is not None
    with pytest.raises(DataError, match=r"store_target_lse True but this run has False"):
        quiet(llama, samples, tmp_path, dtype=dtype, layer_ids=[1, last])


def test_online_equals_captured_fp32(llama, tmp_path):
    samples = make_samples([6, 10, 4])
    quiet(llama, samples, tmp_path, dtype="fp32", shard_max_tokens=8)
    stored, online = CapturedFeatures(tmp_path), OnlineFeatures(llama, samples, layer_ids=LAYERS)
    assert len(online) == len(stored) == 3 and online.lengths == stored.lengths
    for a, b in zip(stored, online, strict=True):
        assert a.id == b.id and b.features.device.type == "cpu"
        assert torch.equal(a.features, b.features) and torch.equal(a.target_tokens, b.target_tokens)


def test_batched_equal_lengths_match_per_sample(llama, tmp_path):
    samples = make_samples([6, 6, 6, 9, 6])
    quiet(llama, samples, tmp_path / "a", dtype="fp32")
    quiet(llama, samples, tmp_path / "b", dtype="fp32", batch_tokens=18)
    for a, b in zip(CapturedFeatures(tmp_path / "a"), CapturedFeatures(tmp_path / "b"), strict=True):
        torch.testing.assert_close(a.features, b.features, rtol=1e-5, atol=1e-5)
        assert a.id == b.id and torch.equal(a.input_ids, b.input_ids)


def test_a_subset_of_the_captured_layers_reads_those_columns_in_the_drafters_order(llama, tmp_path):
    samples = make_samples([6, 9])
    quiet(llama, samples, tmp_path, dtype="fp32")
    full = CapturedFeatures(tmp_path)
    sub = CapturedFeatures(tmp_path, expect_target=llama, expect_layer_ids=[LAYERS[2], LAYERS[0]])
    assert sub.layer_ids == [LAYERS[2], LAYERS[0]]
    H = llama.hidden_size
    for s, a, b in zip(samples, full, sub, strict=True):
        with stock_products():  # capture's own products, whatever widths earlier decodes settled
            ref = llama.model(input_ids=s.input_ids[None], output_hidden_states=True)
        want = torch.cat([ref.hidden_states[LAYERS[2] + 1][0], ref.hidden_states[LAYERS[0] + 1][0]], dim=-1)
        torch.testing.assert_close(b.features, want, rtol=0, atol=0)  # (T, 2·H), bit-exact in fp32
        assert torch.equal(b.features[:, :H], a.features[:, 2 * H : 3 * H]) and torch.equal(b.input_ids, a.input_ids)


def test_bad_input_errors(llama, qwen3, tiny_llama_dir, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        CapturedFeatures(tmp_path / "nope")
    with pytest.raises(DataError, match=f"has no {MANIFEST_NAME}.*dflashkit capture"):
        CapturedFeatures(tmp_path)
    d = tmp_path / "cap"
    quiet(llama, make_samples([5, 9, 4]), d, dtype="fp32", shard_max_tokens=10)
    with pytest.raises(
        DataError,
        match=r"made with target_layer_ids \[1, 4, 6\] but the drafter needs \[1, 4, 7\] "
        r"\(layers \[7\] were not captured\)",
    ):
        CapturedFeatures(d, expect_layer_ids=[1, 4, 7])
    with pytest.raises(
        DataError,
        match=r"with fingerprint '[0-9a-f]+' but the expected target .*qwen3.* has "
        r"fingerprint '[0-9a-f]+'",
    ):
        CapturedFeatures(d, expect_target=qwen3)
    with pytest.raises(DataError, match="fingerprint"):
        CapturedFeatures(d, expect_target="0123456789abcdef")
    CapturedFeatures(d, expect_target=llama, expect_layer_ids=LAYERS)  # the right ones pass
    CapturedFeatures(d, expect_target=Target.load(tiny_llama_dir, dtype="bf16"))  # same weights, other dtype
    (d / "shard-00001.safetensors").unlink()
    with pytest.raises(DataError, match=r"shard file shard-00001.safetensors is missing"):
        CapturedFeatures(d)
    (d / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(DataError, match=r"manifest.json: not valid JSON"):
        CapturedFeatures(d)


def test_disk_space_checked_before_work(llama, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10**6, 10**6, 1000))
    with pytest.raises(DataError, match=r"not enough disk space.*needs"):
        quiet(llama, make_samples([5]), tmp_path, dtype="fp32")
    assert not list(tmp_path.glob("shard-*"))


def test_cli_capture_end_to_end(tiny_llama_dir, llama, tmp_path, capsys):
    from dflashkit.cli import main
    from dflashkit.drafter.defaults import default_drafter_config

    samples = make_samples([7, 5, 9, 6])
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(
        "".join(
            json.dumps({"id": s.id, "input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.int().tolist()}) + "\n"
            for s in samples
        )
    )
    out = tmp_path / "feats"
    base = ["capture", "--target", str(tiny_llama_dir), "--tokens", str(tokens), "--quiet"]
    opts = ["--out", str(out), "--layer-ids", "1,4,6", "--dtype", "fp32", "--shard-tokens", "12", "--limit", "3"]
    assert main([*base, *opts]) == 0
    text = capsys.readouterr().out
    assert "capture: 3 samples, 21 tokens × 3 layers × 64 hidden" in text
    assert "captured 3 samples, 21 tokens" in text and "tok/s" in text and "2 shard(s)" in text
    ds = CapturedFeatures(out, expect_target=llama, expect_layer_ids=LAYERS)
    assert len(ds) == 3 and Manifest.load(out).tokens_file == str(tokens.resolve())
    torch.testing.assert_close(
        ds[2].features, OnlineFeatures(llama, samples, layer_ids=LAYERS)[2].features, rtol=0, atol=0
    )
    assert main([*base, "--out", str(out), "--layer-ids", "1,4,6", "--dtype", "fp32", "--limit", "3"]) == 0
    assert "nothing to do" in capsys.readouterr().out
    # --precision: bf16 autocast for this capture (the suite's environment says fp32), recorded and printed
    assert main([*base, "--out", str(tmp_path / "b"), "--layer-ids", "1,4,6", "--precision", "bf16"]) == 0
    assert "computed in bf16" in capsys.readouterr().out and Manifest.load(tmp_path / "b").precision == "bf16"
    # default layer ids come from the default drafter config; --drafter-config reads a config's
    assert main([*base, "--out", str(tmp_path / "d")]) == 0
    assert CapturedFeatures(tmp_path / "d").layer_ids == default_drafter_config(llama).target_layer_ids
    cfg_path = tmp_path / "drafter.json"
    default_drafter_config(llama, target_layer_ids=[0, 2]).save(cfg_path)
    assert main([*base, "--out", str(tmp_path / "c"), "--drafter-config", str(cfg_path)]) == 0
    assert CapturedFeatures(tmp_path / "c").layer_ids == [0, 2]
    assert not Manifest.load(tmp_path / "c").store_target_lse
    # --target-lse auto: on for a DSpark drafter with a draft vocabulary (its training reads it), else off
    dspark = tmp_path / "dspark.json"
    default_drafter_config(llama, kind="dspark", markov_rank=4, draft_vocab_size=32).save(dspark)
    assert main([*base, "--out", str(tmp_path / "e"), "--drafter-config", str(dspark), "--limit", "1"]) == 0
    assert Manifest.load(tmp_path / "e").store_target_lse and "target log-sum-exp" in capsys.readouterr().out
    opts = ["--drafter-config", str(dspark), "--limit", "1", "--target-lse", "off"]
    assert main([*base, "--out", str(tmp_path / "f"), *opts]) == 0
    assert not Manifest.load(tmp_path / "f").store_target_lse
    assert main([*base, "--out", str(tmp_path / "g"), "--layer-ids", "1", "--limit", "1", "--target-lse", "on"]) == 0
    assert CapturedFeatures(tmp_path / "g")[0].target_lse.shape == (7,)
    assert main([*base, "--out", str(out), "--layer-ids", "1,4", "--limit", "3"]) == 2  # user error, no traceback
    assert "already holds a capture" in capsys.readouterr().err
