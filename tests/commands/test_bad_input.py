"""Bad input in data gives one clear line — a DFlashError naming the file and line and what was expected — never a
traceback from deep inside torch: JSONL lines (skip + count under --on-error skip, the line cap), tokens.jsonl
records, and captured shards (size and checksum checks, capture redoing a damaged shard). Config files, training
and CLI arguments: tests/commands/test_bad_input_files.py."""

from __future__ import annotations

import hashlib
import json
import tracemalloc

import pytest

from dflashkit.cli import main
from dflashkit.data.conversations import read_jsonl_conversations
from dflashkit.data.jsonl import DEFAULT_MAX_LINE_BYTES, MAX_LINE_ENV, read_lines
from dflashkit.data.samples import read_tokens
from dflashkit.errors import ConfigError, DataError
from dflashkit.evaluate.stats import load_prompts
from dflashkit.features.capture import CaptureSettings, capture
from dflashkit.features.captured import CapturedFeatures
from dflashkit.features.manifest import Manifest
from dflashkit.features.online import OnlineFeatures
from helpers.bad_input import (
    CHAT_OK,
    FAKE_TARGET,
    LAYERS,
    PROMPT_OK,
    _one_line_error,
    _recapture,
    _tokens_line,
)

# ---------------------------------------------------------------------------------------------- JSONL lines
READERS = {  # name → (a good first line, read(path, on_error) → (kept items, problems))
    "conversations": (CHAT_OK, lambda p, on_error: read_jsonl_conversations(p, on_error=on_error)),
    "tokens": (_tokens_line(0), lambda p, on_error: read_tokens(p, on_error=on_error)),
    "prompt_ids": (
        PROMPT_OK,
        lambda p, on_error: (lambda r: (r[0], list(r[1].values())))(load_prompts(FAKE_TARGET, p, on_error=on_error)),
    ),
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
        monkeypatch.setenv(MAX_LINE_ENV, "0.002")  # a 2 KiB cap keeps the over-cap line small
    good, read = READERS[reader]
    raw, says = BAD_LINES[bad]
    path = tmp_path / "d.jsonl"
    path.write_bytes(
        good.encode() + b"\n" + raw + b"\n\n" + good.replace("p1", "p2").replace("s0", "s9").encode() + b"\n"
    )
    with pytest.raises(DataError) as e:
        read(path, "stop")
    msg = str(e.value)
    assert f"{path}:2: " in msg and says in msg and "\n" not in msg
    kept, problems = read(path, "skip")  # skipped and counted, the rest kept
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
    monkeypatch.setenv(MAX_LINE_ENV, "32")  # raising the cap accepts the line
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
    "huge id": ({"input_ids": [2**70], "loss_mask": [1]}, "field 'input_ids'"),
}


@pytest.mark.parametrize("case", sorted(TOKEN_RECORDS))
def test_malformed_tokens_records(case, tmp_path):
    rec, says = TOKEN_RECORDS[case]
    path = tmp_path / "tokens.jsonl"
    path.write_text(_tokens_line(0) + "\n" + json.dumps(rec) + "\n")
    with pytest.raises(DataError) as e:
        read_tokens(path)
    assert f"{path}:2: " in str(e.value) and says in str(e.value)


def test_a_duplicated_sample_id_names_both_lines_and_skip_keeps_the_first(tmp_path):
    path = tmp_path / "tokens.jsonl"
    again = json.loads(_tokens_line(1))
    again["id"] = "s0"  # another sequence under an id line 1 already holds (e.g. two files concatenated)
    path.write_text(_tokens_line(0) + "\n" + _tokens_line(2) + "\n" + json.dumps(again) + "\n")
    with pytest.raises(DataError) as e:
        read_tokens(path)
    assert str(e.value).startswith(f"{path}:3: field 'id': duplicate id 's0' (line 1 has it too")
    samples, problems = read_tokens(path, on_error="skip")
    assert [s.id for s in samples] == ["s0", "s2"] and samples[0].input_ids.tolist() == json.loads(_tokens_line(0))[
        "input_ids"
    ]
    assert len(problems) == 1 and problems[0].startswith(f"{path}:3: field 'id': duplicate id 's0'")
    nameless = tmp_path / "nameless.jsonl"  # records without ids get "file:line" ids, unique by construction
    lines = [json.loads(_tokens_line(i)) for i in range(3)]
    nameless.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "id"}) + "\n" for r in lines))
    assert [s.id for s in read_tokens(nameless)[0]] == ["nameless.jsonl:1", "nameless.jsonl:2", "nameless.jsonl:3"]


# ---------------------------------------------------------------------------------------------- token ids
@pytest.mark.parametrize("bad_id", [97, 500, -1])
def test_token_ids_outside_the_vocabulary_name_file_and_line(bad_id, target, tmp_path):
    path = tmp_path / "tokens.jsonl"
    bad = json.loads(_tokens_line(1))
    bad["input_ids"][5] = bad_id
    path.write_text(_tokens_line(0) + "\n\n" + json.dumps(bad) + "\n")
    samples, _ = read_tokens(path)
    with pytest.raises(
        DataError,
        match=rf"{path}:3: sample 's1': input_ids\[5\] = {bad_id} is not a token id of "
        rf"the target .*0 ≤ id < 97",
    ):
        capture(
            target, samples, tmp_path / "feats", log=None, progress=False, settings=CaptureSettings(layer_ids=LAYERS)
        )
    assert not (tmp_path / "feats").exists()
    with pytest.raises(DataError, match=rf"{path}:3: sample 's1'"):
        OnlineFeatures(target, samples, layer_ids=LAYERS)


def test_cli_capture_refuses_bad_tokens_in_one_line(tiny_llama_dir, tmp_path, capsys):
    path = tmp_path / "tokens.jsonl"
    base = [
        "capture",
        "--target",
        str(tiny_llama_dir),
        "--tokens",
        str(path),
        "--out",
        str(tmp_path / "f"),
        "--layer-ids",
        "1,4,6",
        "--quiet",
    ]
    path.write_text(json.dumps({"id": "a", "input_ids": [1, 2, 3, 500], "loss_mask": [0, 1, 1, 1]}) + "\n")
    line = _one_line_error(capsys, main(base))
    assert f"{path}:1: sample 'a': input_ids[3] = 500" in line
    path.write_bytes(b'{"id": "a", "input_ids": [1], "loss_mask": [1], "note": "\xff"}\n')
    line = _one_line_error(capsys, main(base))
    assert f"{path}:1: not valid UTF-8" in line


# ---------------------------------------------------------------------------------------------- shards
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
    with pytest.raises(
        DataError,
        match=r"shard file shard-00001.safetensors is [\d,]+ bytes where the manifest "
        r"recorded [\d,]+ \(truncated\).*rerun `dflashkit capture`",
    ):
        CapturedFeatures(out, expect_layer_ids=LAYERS)
    logs = _recapture(target, samples, out)
    assert any("shard-00001.safetensors is listed as done but is" in x and "capturing it again" in x for x in logs)
    assert shard.read_bytes() == files[shard.name]  # redone, byte-identical
    assert CapturedFeatures(out)[1].features.shape == (15, 3 * 64)
    assert any("nothing to do" in x for x in _recapture(target, samples, out))


def test_same_size_damage_caught_by_checksum_and_header(captured, target):
    out, samples, files = captured
    shard = out / "shard-00002.safetensors"
    data = bytearray(files[shard.name])
    data[-8:] = b"\x7f" * 8  # flipped feature bytes: same size, same header
    shard.write_bytes(bytes(data))
    assert any("nothing to do" in x for x in _recapture(target, samples, out, verify="size"))  # size only: kept
    logs = _recapture(target, samples, out)  # full: the checksum catches it
    assert any("shard-00002.safetensors is listed as done but has sha256" in x for x in logs)
    assert shard.read_bytes() == files[shard.name]
    head = out / "shard-00000.safetensors"  # garbage header, size unchanged
    head.write_bytes(b"\xff" * 8 + files[head.name][8:])
    ds = CapturedFeatures(out)
    with pytest.raises(DataError, match=r"shard-00000.safetensors is not a readable safetensors file .*rerun `dflas"):
        ds[0]
    assert any(
        "shard-00000.safetensors is listed as done but is not a readable safetensors file" in x
        for x in _recapture(target, samples, out, verify="size")
    )


def test_old_manifest_without_checksums_falls_back_to_sizes(captured, target):
    out, samples, files = captured
    m = json.loads((out / "manifest.json").read_text())
    for sh in m["shards"]:
        del sh["sha256"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert any("nothing to do" in x for x in _recapture(target, samples, out))
    (out / "shard-00001.safetensors").write_bytes(files["shard-00001.safetensors"][:100])
    assert any("shard-00001.safetensors is listed as done but" in x for x in _recapture(target, samples, out))
    assert Manifest.load(out).shards[1]["sha256"]  # recorded for the redone shard


def test_cli_train_on_a_truncated_shard_is_one_line(captured, tiny_llama_dir, tmp_path, capsys):
    out, _, files = captured
    (out / "shard-00000.safetensors").write_bytes(files["shard-00000.safetensors"][:-1])
    rc = main(
        [
            "train",
            "-",
            f"target={tiny_llama_dir}",
            f"features={out}",
            f"out={tmp_path / 'run'}",
            "drafter.num_hidden_layers=1",
            "drafter.block_size=4",
            "drafter.target_layer_ids=[1,4,6]",
            "max_steps=1",
            "--no-progress",
        ]
    )
    line = _one_line_error(capsys, rc)
    assert "shard-00000.safetensors" in line and "truncated" in line and "rerun `dflashkit capture`" in line
