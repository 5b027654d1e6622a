"""Bad input gives one clear line — a DFlashError naming the file, line or field and what was expected — never a
traceback from deep inside torch, and never lost work. Also the recoveries: skip + count under --on-error skip,
capture redoing a damaged shard, stale temp leftovers of dead processes removed on the next start."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflashkit.checkpoint import load_drafter, save_drafter
from dflashkit.cli import build_parser, main
from dflashkit.config import DrafterConfig
from dflashkit.data import read_jsonl_conversations
from dflashkit.errors import CheckpointError, ConfigError, DataError, TargetError
from dflashkit.eval_stats import load_prompts
from dflashkit.features import CapturedFeatures, Manifest, OnlineFeatures, capture
from dflashkit.info import default_drafter_config
from dflashkit.jsonl import DEFAULT_MAX_LINE_BYTES, MAX_LINE_ENV, read_lines
from dflashkit.model import DFlashDrafter
from dflashkit.samples import Sample, read_tokens
from dflashkit.target import Target
from dflashkit.train import train
from dflashkit.train_config import TrainConfig

DRAFTER = {"num_hidden_layers": 1, "block_size": 4}
LAYERS = [1, 4, 6]
DEAD_PID = 99_999_999          # above any pid_max: never a running process


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path) -> Target:
    return Target.load(tiny_llama_dir)


def _one_line_error(capsys, rc: int, expect_rc: int = 2) -> str:
    """The CLI exited with `expect_rc` and printed exactly one error line, no traceback; returns it."""
    err = capsys.readouterr().err
    assert rc == expect_rc, err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip() and "%|" not in x]   # minus progress bars
    assert len(lines) == 1, lines
    return lines[0]


def _tokens_line(i: int, n: int = 14, prompt: int = 10, vocab: int = 97) -> str:
    ids = [(7 * i + 3 * k) % (vocab - 3) + 3 for k in range(n)]
    return json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt)})


# ---------------------------------------------------------------------------------------------- JSONL lines
CHAT_OK = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
PROMPT_OK = json.dumps({"id": "p1", "prompt_ids": [3, 4, 5]})
FAKE_TARGET = SimpleNamespace(vocab_size=97, tokenizer=None, source="fake",
                              text_config=SimpleNamespace(max_position_embeddings=512))

READERS = {  # name → (a good first line, read(path, on_error) → (kept items, problems))
    "conversations": (CHAT_OK, lambda p, on_error: read_jsonl_conversations(p, on_error=on_error)),
    "tokens": (_tokens_line(0), lambda p, on_error: read_tokens(p, on_error=on_error)),
    "prompt_ids": (PROMPT_OK, lambda p, on_error: (lambda r: (r[0], list(r[1].values())))(
        load_prompts(FAKE_TARGET, p, on_error=on_error))),
}
BAD_LINES = {  # name → (raw bytes of line 2, what the message must say)
    "not-utf8": (b'{"prompt": "caf\xe9 \xff"}', "not valid UTF-8 (byte 0xe9"),
    "over-cap": (b'{"prompt": "' + b"x" * 3000 + b'"}', "line-size cap"),
    "too-deep": (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    "not-json": (b'{"prompt": ', "invalid JSON"),
}


@pytest.mark.parametrize("bad", sorted(BAD_LINES))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_bad_jsonl_line_names_file_and_line_and_skip_counts_it(reader, bad, tmp_path, monkeypatch):
    if bad == "over-cap":
        monkeypatch.setenv(MAX_LINE_ENV, "0.002")                 # a 2 KiB cap keeps the over-cap line small
    good, read = READERS[reader]
    raw, says = BAD_LINES[bad]
    path = tmp_path / "d.jsonl"
    path.write_bytes(good.encode() + b"\n" + raw + b"\n\n" + good.replace("p1", "p2").replace("s0", "s9").encode()
                     + b"\n")
    with pytest.raises(DataError) as e:
        read(path, "stop")
    msg = str(e.value)
    assert f"{path}:2: " in msg and says in msg and "\n" not in msg
    kept, problems = read(path, "skip")                           # skipped and counted, the rest kept
    assert len(kept) == 2
    assert len(problems) == 1 and problems[0].startswith(f"{path}:2: ") and says in problems[0]


def test_over_cap_line_is_skipped_without_holding_it(tmp_path, monkeypatch):
    """A 20 MB line with the default cap: memory stays near the cap, not gigabytes; the next line still reads."""
    monkeypatch.delenv(MAX_LINE_ENV, raising=False)
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(CHAT_OK.encode() + b"\n")
        f.write(b'{"prompt": "' + b"y" * (20 << 20) + b'"}\n')
        f.write(CHAT_OK.encode() + b"\n")
    tracemalloc.start()
    try:
        convs, problems = read_jsonl_conversations(path, on_error="skip")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(convs) == 2 and len(problems) == 1 and f"{path}:2: " in problems[0]
    assert "20 MiB is over the 8 MiB line-size cap" in problems[0] and MAX_LINE_ENV in problems[0]
    assert peak < DEFAULT_MAX_LINE_BYTES + (4 << 20)
    monkeypatch.setenv(MAX_LINE_ENV, "32")                        # raising the cap accepts the line
    assert len(read_jsonl_conversations(path)[0]) == 3


@pytest.mark.parametrize("value", ["lots", "-1", "0"])
def test_bad_line_cap_setting_is_named(value, tmp_path, monkeypatch):
    monkeypatch.setenv(MAX_LINE_ENV, value)
    (tmp_path / "a.jsonl").write_text(CHAT_OK + "\n")
    with pytest.raises(ConfigError, match=rf"\${MAX_LINE_ENV}='{value}': expected a positive number of megabytes"):
        list(read_lines(tmp_path / "a.jsonl"))


def test_line_numbers_count_blank_lines_and_a_bom_is_ignored(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + CHAT_OK.encode() + b"\r\n\n  \n" + CHAT_OK.encode())
    assert [(x.number, x.json()["messages"][1]["content"]) for x in read_lines(path)] == [(1, "yo"), (4, "yo")]


TOKEN_RECORDS = {  # a bad tokens.jsonl record → what the message names
    "float ids": ({"input_ids": [1, 2.5], "loss_mask": [0, 1]}, "field 'input_ids': expected a flat list of integers"),
    "nested ids": ({"input_ids": [[1, 2]], "loss_mask": [0]}, "field 'input_ids'"),
    "string ids": ({"input_ids": "1 2", "loss_mask": [0, 1]}, "field 'input_ids': expected a list of integers"),
    "mask value 2": ({"input_ids": [1, 2], "loss_mask": [0, 2]}, "loss_mask holds values other than 0 and 1"),
    "lengths differ": ({"input_ids": [1, 2], "loss_mask": [0]}, "input_ids has 2 entries but loss_mask has 1"),
    "no mask": ({"input_ids": [1, 2]}, "KeyError: 'loss_mask'"),
    "not an object": ([1, 2], "expected a JSON object"),
    "huge id": ({"input_ids": [2 ** 70], "loss_mask": [1]}, "field 'input_ids'"),
}


@pytest.mark.parametrize("case", sorted(TOKEN_RECORDS))
def test_malformed_tokens_records(case, tmp_path):
    rec, says = TOKEN_RECORDS[case]
    path = tmp_path / "tokens.jsonl"
    path.write_text(_tokens_line(0) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(DataError) as e:
        read_tokens(path)
    assert f"{path}:2: " in str(e.value) and says in str(e.value)


# ---------------------------------------------------------------------------------------------- token ids
@pytest.mark.parametrize("bad_id", [97, 500, -1])
def test_token_ids_outside_the_vocabulary_name_file_and_line(bad_id, target, tmp_path):
    path = tmp_path / "tokens.jsonl"
    bad = json.loads(_tokens_line(1))
    bad["input_ids"][5] = bad_id
    path.write_text(_tokens_line(0) + "\n\n" + json.dumps(bad) + "\n")
    samples, _ = read_tokens(path)
    with pytest.raises(DataError, match=rf"{path}:3: sample 's1': input_ids\[5\] = {bad_id} is not a token id of "
                                        rf"the target .*0 ≤ id < 97"):
        capture(target, samples, tmp_path / "feats", layer_ids=LAYERS, log=None, progress=False)
    assert not (tmp_path / "feats").exists()
    with pytest.raises(DataError, match=rf"{path}:3: sample 's1'"):
        OnlineFeatures(target, samples, layer_ids=LAYERS)


def test_cli_capture_refuses_bad_tokens_in_one_line(tiny_llama_dir, tmp_path, capsys):
    path = tmp_path / "tokens.jsonl"
    base = ["capture", "--target", str(tiny_llama_dir), "--tokens", str(path), "--out", str(tmp_path / "f"),
            "--layer-ids", "1,4,6", "--quiet"]
    path.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3, 500], "loss_mask": [0, 1, 1, 1]}) + "\n")
    line = _one_line_error(capsys, main(base))
    assert f"{path}:1: sample 'a': input_ids[3] = 500" in line
    path.write_bytes(b'{"id": "a", "input_ids": [1], "loss_mask": [1], "note": "\xff"}\n')
    line = _one_line_error(capsys, main(base))
    assert f"{path}:1: not valid UTF-8" in line


# ---------------------------------------------------------------------------------------------- shards
@pytest.fixture()
def captured(target, tmp_path) -> tuple[Path, list[Sample], dict[str, bytes]]:
    path = tmp_path / "tokens.jsonl"
    path.write_text("".join(_tokens_line(i, n=14 + i) + "\n" for i in range(3)))
    samples, _ = read_tokens(path)
    out = tmp_path / "feats"
    capture(target, samples, out, layer_ids=LAYERS, dtype="fp32", shard_max_tokens=16, log=None, progress=False)
    return out, samples, {p.name: p.read_bytes() for p in out.glob("shard-*")}


def _recapture(target, samples, out, **kw) -> list[str]:
    logs: list[str] = []
    capture(target, samples, out, layer_ids=LAYERS, dtype="fp32", log=logs.append, progress=False, **kw)
    return logs


def test_manifest_records_size_and_sha256(captured):
    out, _, files = captured
    m = Manifest.load(out)
    assert len(m.shards) == 3
    for sh in m.shards:
        assert sh["bytes"] == len(files[sh["file"]]) and sh["sha256"] == hashlib.sha256(files[sh["file"]]).hexdigest()


def test_truncated_shard_refused_by_training_and_redone_by_capture(captured, target):
    out, samples, files = captured
    shard = out / "shard-00001.safetensors"
    shard.write_bytes(files[shard.name][: len(files[shard.name]) // 2])
    with pytest.raises(DataError, match=r"shard file shard-00001.safetensors is [\d,]+ bytes where the manifest "
                                        r"recorded [\d,]+ \(truncated\).*rerun `dflashkit capture`"):
        CapturedFeatures(out, expect_layer_ids=LAYERS)
    logs = _recapture(target, samples, out)
    assert any("shard-00001.safetensors is listed as done but is" in x and "capturing it again" in x for x in logs)
    assert shard.read_bytes() == files[shard.name]                     # redone, byte-identical
    assert CapturedFeatures(out)[1].features.shape == (15, 3 * 64)
    assert any("nothing to do" in x for x in _recapture(target, samples, out))


def test_same_size_damage_caught_by_checksum_and_header(captured, target):
    out, samples, files = captured
    shard = out / "shard-00002.safetensors"
    data = bytearray(files[shard.name])
    data[-8:] = b"\x7f" * 8                                           # flipped feature bytes: same size, same header
    shard.write_bytes(bytes(data))
    assert any("nothing to do" in x for x in _recapture(target, samples, out, verify="size"))  # size only: kept
    logs = _recapture(target, samples, out)                           # full: the checksum catches it
    assert any("shard-00002.safetensors is listed as done but has sha256" in x for x in logs)
    assert shard.read_bytes() == files[shard.name]
    head = out / "shard-00000.safetensors"                            # garbage header, size unchanged
    head.write_bytes(b"\xff" * 8 + files[head.name][8:])
    ds = CapturedFeatures(out)
    with pytest.raises(DataError, match=r"shard file shard-00000.safetensors is damaged .*rerun `dflashkit capture`"):
        ds[0]
    assert any("shard-00000.safetensors is listed as done but is not a readable safetensors file" in x
               for x in _recapture(target, samples, out, verify="size"))


def test_old_manifest_without_checksums_falls_back_to_sizes(captured, target):
    out, samples, files = captured
    m = json.loads((out / "manifest.json").read_text())
    for sh in m["shards"]:
        del sh["sha256"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert any("nothing to do" in x for x in _recapture(target, samples, out))
    (out / "shard-00001.safetensors").write_bytes(files["shard-00001.safetensors"][:100])
    assert any("shard-00001.safetensors is listed as done but" in x for x in _recapture(target, samples, out))
    assert Manifest.load(out).shards[1]["sha256"]                     # recorded for the redone shard


def test_cli_train_on_a_truncated_shard_is_one_line(captured, tiny_llama_dir, tmp_path, capsys):
    out, _, files = captured
    (out / "shard-00000.safetensors").write_bytes(files["shard-00000.safetensors"][:-1])
    rc = main(["train", "-", f"target={tiny_llama_dir}", f"features={out}", f"out={tmp_path / 'run'}",
               "drafter.num_hidden_layers=1", "drafter.block_size=4", "drafter.target_layer_ids=[1,4,6]",
               "max_steps=1", "--no-progress"])
    line = _one_line_error(capsys, rc)
    assert "shard-00000.safetensors" in line and "truncated" in line and "rerun `dflashkit capture`" in line


# ---------------------------------------------------------------------------------------------- drafter config
CONFIG_CASES = [  # (where, field, bad value, expected type named in the message)
    ("", "num_hidden_layers", "two", "an integer"),
    ("", "hidden_size", "sixty-four", "an integer"),
    ("", "num_attention_heads", 4.5, "an integer"),
    ("", "rms_norm_eps", "small", "a number"),
    ("", "attention_bias", "false", "true or false"),
    ("", "layer_types", "full_attention", "a list of strings"),
    ("", "vocab_size", None, "an integer"),
    ("dflash_config", "target_layer_ids", [1, "4"], "a list of integers"),
    ("dflash_config", "block_size", "4", "an integer"),
    ("dflash_config", "mask_embedding", 1, "true or false"),
]


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory) -> Path:
    torch.manual_seed(0)
    return save_drafter(DFlashDrafter(default_drafter_config(target, **DRAFTER)), tmp_path_factory.mktemp("dr") / "d")


def _broken_copy(src: Path, dst: Path, where: str, name: str, value) -> Path:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (raw[where] if where else raw)[name] = value
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("where,name,value,kind", CONFIG_CASES, ids=[f"{c[0] or 'top'}.{c[1]}" for c in CONFIG_CASES])
def test_config_field_of_wrong_type_names_file_field_and_type(where, name, value, kind, drafter_dir, tmp_path):
    d = _broken_copy(drafter_dir, tmp_path / "bad", where, name, value)
    field = f"{where}.{name}" if where else name
    with pytest.raises(ConfigError) as e:
        DrafterConfig.load(d / "config.json")
    msg = str(e.value)
    assert msg.startswith(f"{d / 'config.json'}: field '{field}' must be {kind}"), msg
    assert f"got {json.dumps(value)}" in msg
    with pytest.raises(CheckpointError, match=f"field '{field}'"):
        load_drafter(d)


def test_cli_commands_on_a_config_with_string_numbers(drafter_dir, tiny_llama_dir, tmp_path, capsys):
    d = _broken_copy(drafter_dir, tmp_path / "bad", "", "num_hidden_layers", "two")
    says = f"{d / 'config.json'}: field 'num_hidden_layers' must be an integer, got \"two\" (a string)"
    t = ["--target", str(tiny_llama_dir)]
    assert says in _one_line_error(capsys, main(["generate", *t, "--drafter", str(d), "--prompt-ids", "3,4"]))
    assert says in _one_line_error(capsys, main(["convert", str(d), str(tmp_path / "out")]))
    assert says in _one_line_error(capsys, main(["info", *t, "--drafter", str(d)]))
    for argv in (["inspect", str(d), "--no-values"], ["doctor", *t, "--drafter", str(d), "--prompts", "1",
                                                       "--max-new-tokens", "2"]):
        rc = main(argv)
        out, err = capsys.readouterr()
        assert rc == 1 and "Traceback" not in err and f"FAIL config: {says}" in out
    d2 = _broken_copy(drafter_dir, tmp_path / "bad2", "", "hidden_size", "sixty-four")
    rc = main(["inspect", str(d2), "--no-values"])
    out, err = capsys.readouterr()
    assert rc == 1 and "Traceback" not in err and "field 'hidden_size' must be an integer" in out


@pytest.mark.parametrize("what", ["drafter config", "training yaml", "manifest", "results"])
def test_non_utf8_files_are_named(what, drafter_dir, captured, tmp_path):
    if what == "drafter config":
        path = shutil.copytree(drafter_dir, tmp_path / "d") / "config.json"
        path.write_bytes(path.read_bytes().replace(b'"silu"', b'"sil\xff"'))
        load, err = (lambda: DrafterConfig.load(path)), ConfigError
    elif what == "training yaml":
        path = tmp_path / "t.yaml"
        path.write_bytes(b"lr: 1e-3  # caf\xe9\n")
        load, err = (lambda: TrainConfig.load(path)), ConfigError
    elif what == "manifest":
        path = captured[0] / "manifest.json"
        path.write_bytes(path.read_bytes().replace(b'"s0"', b'"s\xff"'))
        load, err = (lambda: Manifest.load(captured[0])), DataError
    else:
        from dflashkit.report import load_results
        path = tmp_path / "results.json"
        path.write_bytes(b'{"results": {"\xff": 1}}')
        load, err = (lambda: load_results(path)), DataError
    with pytest.raises(err, match=rf"{path}: not (valid UTF-8|a results.json .*UnicodeDecodeError)"):
        load()


# ---------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def samples(target) -> list[Sample]:
    """4 sequences of 18 tokens, the first 10 unsupervised (a 'prompt'), with the tiny target's features."""
    out = []
    for i in range(4):
        s = json.loads(_tokens_line(i, n=18))
        ids, mask = torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"], dtype=torch.bool)
        res = target.forward(ids[None], layer_ids=default_drafter_config(target, **DRAFTER).target_layer_ids)
        out.append(Sample(s["id"], ids, mask, res.features[0], res.logits[0].argmax(-1)))
    return out


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(out=str(out), drafter=dict(DRAFTER), max_tokens=32, max_steps=2, save_every=1, progress=False,
                tensorboard=False, val_fraction=0.0)
    base.update(kw)
    return TrainConfig(**base)


def test_max_tokens_without_supervised_tokens_is_refused_before_training(samples, target, tmp_path):
    with pytest.raises(DataError, match=r"max_tokens=8 leaves nothing to train on: .*position 10 \(0-based\).*"
                                        r"raise max_tokens above 11"):
        train(_cfg(tmp_path / "run", max_tokens=8), dataset=samples, target=target)
    assert not (tmp_path / "run" / "checkpoints").exists()
    unsupervised = [Sample(s.id, s.input_ids, torch.zeros_like(s.loss_mask), s.features) for s in samples]
    with pytest.raises(DataError, match="none of the 4 training samples has two consecutive supervised tokens"):
        train(_cfg(tmp_path / "run2"), dataset=unsupervised, target=target)


def test_disk_full_during_checkpoint_save_keeps_the_previous_one_and_leftovers_go(samples, target, tmp_path,
                                                                                   monkeypatch):
    import dflashkit.train_state as ts

    out = tmp_path / "run"
    real_save = torch.save
    calls = []

    def full_disk(obj, f, *a, **kw):                  # the second checkpoint's train_state.pt hits a full disk
        calls.append(f)
        if len(calls) >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(ts.torch, "save", full_disk)
    with pytest.raises(CheckpointError) as e:
        train(_cfg(out), dataset=samples, target=target)
    msg = str(e.value)
    assert f"cannot write {out / 'checkpoints' / 'step-000002'}: the disk is full" in msg
    assert f"the previous checkpoint {out / 'checkpoints' / 'step-000001'} is intact" in msg
    assert (out / "latest").read_text().strip() == "checkpoints/step-000001"
    load_drafter(out / "checkpoints" / "step-000001")                 # loadable
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]   # no temp dir left
    monkeypatch.setattr(ts.torch, "save", real_save)

    # what a SIGKILL mid-save leaves behind, from processes that are gone; a live process's temp dir stays
    stale = [out / "checkpoints" / f".step-000002.tmp-{DEAD_PID}", out / f".final.tmp-{DEAD_PID}"]
    live = out / "checkpoints" / f".step-000009.tmp-{os.getppid()}"
    for d in stale + [live]:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    res = train(_cfg(out), dataset=samples, target=target)             # resumes from step 1
    assert res.step == 2 and res.stopped == "completed"
    assert not any(d.exists() for d in stale) and live.exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")) == [
        "step-000001", "step-000002"]


def test_stale_temps_of_dead_processes_go_and_an_interrupted_replacement_is_undone(tmp_path):
    from dflashkit.io_utils import remove_stale_temps

    (tmp_path / f".final.old-{DEAD_PID}").mkdir()                     # killed between the two renames
    (tmp_path / f".final.old-{DEAD_PID}" / "config.json").write_text("{}")
    (tmp_path / "step").mkdir()
    (tmp_path / f".step.old-{DEAD_PID}").mkdir()                      # NAME exists: just a leftover
    (tmp_path / f".latest.tmp-{DEAD_PID}").write_text("x")
    (tmp_path / f".mine.tmp-{os.getpid()}").write_text("x")          # our pid on a leftover: an earlier process
    (tmp_path / f".busy.tmp-{os.getppid()}").write_text("x")         # a live process: kept
    (tmp_path / ".other.tmp").write_text("x")                         # not ours to judge: kept
    logs: list[str] = []
    removed = remove_stale_temps(tmp_path, log=logs.append)
    assert sorted(p.name for p in removed) == sorted([f".step.old-{DEAD_PID}", f".latest.tmp-{DEAD_PID}",
                                                      f".mine.tmp-{os.getpid()}"])
    assert (tmp_path / "final" / "config.json").is_file() and any("restored" in x for x in logs)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["final", "step", f".busy.tmp-{os.getppid()}",
                                                                 ".other.tmp"])


def test_write_failure_words():
    from dflashkit.io_utils import write_failure

    assert write_failure("/x", OSError(errno.ENOSPC, "No space left on device")).startswith("the disk is full")
    torch_words = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 576 vs 470")
    assert write_failure("/x", torch_words).startswith("the write failed, most likely a full disk")
    assert write_failure("/x", OSError(errno.EACCES, "Permission denied")).startswith("the write failed (")


def test_failed_final_save_is_one_line(samples, target, tmp_path, monkeypatch):
    import dflashkit.train_state as ts

    def full_disk(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ts, "save_drafter", lambda d, path, **kw: full_disk() if ".final.tmp" in str(path)
                        else save_drafter(d, path, **kw))
    with pytest.raises(CheckpointError, match=r"cannot write .*final: the disk is full .*step-000002 is intact"):
        train(_cfg(tmp_path / "run"), dataset=samples, target=target)
    assert not list((tmp_path / "run").glob(".final.tmp-*"))


# ---------------------------------------------------------------------------------------------- target, CLI
def test_broken_tokenizer_files_are_an_error_naming_the_directory(tiny_llama_dir, tmp_path):
    d = shutil.copytree(tiny_llama_dir, tmp_path / "t")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {broken')
    with pytest.raises(TargetError, match=rf"{d}: the tokenizer files \['tokenizer.json'\] exist but cannot be "
                                          rf"loaded \(.*Error"):
        Target.load(d)


def test_init_drafter_accepts_target_between_out_and_overrides(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["init-drafter", str(out), "--target", str(tiny_llama_dir), "num_hidden_layers=1",
                 "block_size=4"]) == 0
    cfg = DrafterConfig.load(out / "config.json")
    assert (cfg.num_hidden_layers, cfg.block_size) == (1, 4)
    with pytest.raises(SystemExit):
        main(["init-drafter", str(out), "--target", str(tiny_llama_dir), "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["prepare", "eval", "simulate"])
def test_every_command_whose_error_hint_says_on_error_has_it(command, tmp_path):
    required = {"prepare": ["--data", "x.jsonl", "--out", "o"],
                "eval": ["--dataset", "x.jsonl", "--out", "o"],
                "simulate": ["--dataset", "x.jsonl", "--out", "o", "--cache", "c", "--drafter", "a=b"]}[command]
    args = build_parser().parse_args([command, *required, "--on-error", "skip"])
    assert args.on_error == "skip"


def test_cli_prepare_skips_and_counts_a_non_utf8_line(tmp_path, capsys, monkeypatch):
    """`prepare --on-error skip` over a file with a Latin-1 line: skipped, counted in the summary and in
    prepare.json; without it, one line naming file:line and --on-error skip."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dflashkit.default_target import ensure_default_target
    tdir = tmp_path / "t"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                                 tie_word_embeddings=True)).save_pretrained(tdir)
    AutoTokenizer.from_pretrained(ensure_default_target()).save_pretrained(tdir)
    data = tmp_path / "chats.jsonl"
    data.write_bytes(CHAT_OK.encode() + b"\n" + b'{"prompt": "caf\xe9"}\n' + CHAT_OK.replace("hi", "ho").encode())
    base = ["prepare", "--target", str(tdir), "--data", str(data), "--no-regenerate", "--max-length", "64"]
    line = _one_line_error(capsys, main(base + ["--out", str(tmp_path / "a")]))
    assert f"{data}:2: not valid UTF-8" in line and "--on-error skip" in line
    assert main(base + ["--out", str(tmp_path / "b"), "--on-error", "skip"]) == 0
    assert "from 2 conversations (1 malformed" in capsys.readouterr().out
    report = json.loads((tmp_path / "b" / "prepare.json").read_text())
    assert report["samples_written"] == 2 and len(report["malformed"]) == 1
    assert report["malformed"][0].startswith(f"{data}:2: not valid UTF-8")


def test_eval_on_error_skip_records_the_skipped_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(PROMPT_OK.encode() + b"\n" + b"\xff\xfe\n" + PROMPT_OK.replace("p1", "p2").encode() + b"\n")
    with pytest.raises(DataError, match=rf"{path}:2: not valid UTF-8 .*--on-error skip"):
        load_prompts(FAKE_TARGET, path)
    prompts, skipped = load_prompts(FAKE_TARGET, path, on_error="skip")
    assert [p.id for p in prompts] == ["p1", "p2"]
    assert len(skipped) == 1 and next(iter(skipped.values())).startswith(f"{path}:2: not valid UTF-8")
