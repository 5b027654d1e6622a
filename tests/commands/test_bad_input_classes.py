"""Classes of bad input, each closed where the value enters, fed many bad values: every one ends in one line naming the
file, field or URL and what was expected — never a traceback, a hang, or a silent wrong result.

  1. drafter configs read from disk (ours, z-lab's, speculators') with geometry a drafter cannot have; draft maps
  2. fields that follow the target, given by the user
  3. text that is not valid Unicode (JSONL escapes, --prompt bytes)
  4. damaged state on resume (the checkpoint's train_config.yaml)
  5. fields of another kind, objectives that train nothing, draft vocabularies not built from data
  6. exports whose --target is not the drafter's
  7. capture shards damaged inside (size and header intact)
  8. servers that hang, trickle or close early
  9. diagnostics that must agree with the pipeline (doctor --features, inspect dtypes, logs --acc-slot)
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.data.server_client import ServerError, ServerPool, ServerTimeouts
from dflashkit.drafter.checkpoint import load_drafter
from dflashkit.errors import CheckpointError
from helpers.bad_input import LAYERS, _one_line_error, _tokens_line
from helpers.checkpoints import small_config, speculators_checkpoint, write_checkpoint

GEOMETRY_FIELDS = (
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "block_size",
    "vocab_size",
    "max_position_embeddings",
)
BAD_GEOMETRY = (0, -1, -4096)


def _edited(src: Path, dst: Path, change) -> Path:
    """A copy of checkpoint `src` whose config.json `change(raw)` edits."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    raw = json.loads((src / "config.json").read_text())
    change(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.fixture()
def drafter_dir(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "ok", small_config())


# ---------------------------------------------------------------------------------------------- 1. geometry
@pytest.mark.parametrize("field", GEOMETRY_FIELDS)
def test_impossible_geometry_in_a_config_on_disk_is_one_line_everywhere(field, drafter_dir, tmp_path, capsys):
    for value in BAD_GEOMETRY:
        bad = _edited(drafter_dir, tmp_path / f"{field}{value}", lambda raw, v=value: raw.update({field: v}))
        for argv in (["info", "--drafter", str(bad)], ["convert", str(bad), str(tmp_path / f"o{value}")]):
            line = _one_line_error(capsys, main(argv))
            assert f"{bad}/config.json" in line and field in line, line
        rc = main(["inspect", str(bad)])  # inspect describes what it can and reports the field as a FAIL
        out = capsys.readouterr().out
        assert rc == 1 and f"field '{field}' = {value}" in out and "Traceback" not in out


def test_a_speculators_config_with_impossible_geometry_is_one_line(tmp_path, capsys):
    for value in BAD_GEOMETRY:
        path = tmp_path / f"spec{value}"
        speculators_checkpoint(path)
        raw = json.loads((path / "config.json").read_text())
        raw["transformer_layer_config"]["num_attention_heads"] = value
        (path / "config.json").write_text(json.dumps(raw))
        line = _one_line_error(capsys, main(["convert", str(path), str(tmp_path / f"o{value}")]))
        assert "num_attention_heads" in line and str(value) in line


@pytest.mark.parametrize("ids", [[0, 1, 97], [-1, 2, 3], [5, 5, 6], [0, 0, 0]])
def test_a_draft_map_outside_the_vocabulary_or_repeating_ids_is_refused_at_load(ids, tmp_path):
    cfg = small_config(draft_vocab_size=3)
    path = write_checkpoint(tmp_path / "m", cfg, edit=lambda sd: sd["draft_to_target"].copy_(torch.tensor(ids)))
    with pytest.raises(CheckpointError, match="tensor 'draft_to_target'"):
        load_drafter(path)


# ---------------------------------------------------------------------------------------------- 2. target-coupled
@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_target_layers"])
def test_a_field_that_follows_the_target_cannot_be_set(field, tiny_llama_dir, tmp_path, capsys):
    t = ["--target", str(tiny_llama_dir)]
    line = _one_line_error(capsys, main(["init-drafter", str(tmp_path / "d"), *t, f"{field}=64"]))
    assert f"{field} follows the target" in line
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(_tokens_line(0) + "\n")
    argv = ["train", "-", f"target={tiny_llama_dir}", f"tokens={tokens}", "online=true", f"out={tmp_path / 'r'}"]
    line = _one_line_error(capsys, main([*argv, f"drafter.{field}=64"]))
    assert f"drafter.{field} follows the target" in line
    assert not (tmp_path / "d").exists() and not (tmp_path / "r" / "final").exists()


# ---------------------------------------------------------------------------------------------- 3. text
SURROGATES = ["\\ud800", "a\\udfffb", "\\ud83d", "x\\udc80"]  # lone halves, as JSON escapes


@pytest.mark.parametrize("escape", SURROGATES)
def test_a_lone_surrogate_in_a_dataset_is_one_line_naming_file_line_and_field(escape, tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    ok = {"messages": [{"role": "user", "content": "fine"}, {"role": "assistant", "content": "yes"}]}
    data.write_text(json.dumps(ok) + "\n" + '{"messages": [{"role": "user", "content": "hi ' + escape + '"}]}\n')
    t = ["--target", str(tiny_llama_dir)]
    line = _one_line_error(capsys, main(["prepare", *t, "--data", str(data), "--out", str(tmp_path / "p")]))
    assert f"{data}:2: field 'messages[0].content': not valid Unicode" in line
    d = write_checkpoint(tmp_path / "d", small_config())
    argv = ["eval", *t, "--drafter", str(d), "--dataset", str(data), "--out", str(tmp_path / "e"), "--methods", "ar"]
    line = _one_line_error(capsys, main(argv))
    assert f"{data}:2" in line and "not valid Unicode" in line


@pytest.mark.parametrize("raw", [b"hi \xff there", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80"])
def test_invalid_utf8_bytes_in_prompt_are_one_line(raw, tiny_llama_dir, tmp_path, capsys):
    prompt = raw.decode("utf-8", "surrogateescape")  # what Python makes of argv bytes that are not UTF-8
    d = write_checkpoint(tmp_path / "d", small_config())
    line = _one_line_error(
        capsys, main(["generate", "--target", str(tiny_llama_dir), "--drafter", str(d), "--prompt", prompt])
    )
    assert "--prompt not valid UTF-8 (byte 0x" in line


def test_a_surrogate_pair_escape_is_valid_text(tmp_path):
    from dflashkit.data.jsonl import read_lines

    path = tmp_path / "ok.jsonl"
    path.write_text('{"content": "smile \\ud83d\\ude00"}\n')
    assert next(read_lines(path)).json() == {"content": "smile 😀"}


# ---------------------------------------------------------------------------------------------- 4. damaged state
@pytest.mark.parametrize(
    "damage",
    [b"lr: [unclosed\n", b"- a list\n- not a mapping\n", b"\xff\xfe binary", b"a: 1\na: 2\n", b"key: value: x\n"],
)
def test_a_damaged_train_config_on_resume_names_the_file(damage, tiny_llama_dir, tmp_path, capsys):
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text("".join(_tokens_line(i, n=20) + "\n" for i in range(4)))
    out = tmp_path / "run"
    argv = ["train", "-", f"target={tiny_llama_dir}", f"tokens={tokens}", "online=true", f"out={out}"]
    argv += ["max_steps=2", "save_every=1", "drafter.num_hidden_layers=1", "drafter.block_size=4", "progress=false"]
    argv += ["max_tokens=48", "tensorboard=false"]
    assert main(argv) == 0
    capsys.readouterr()
    saved = sorted((out / "checkpoints").glob("step-*/train_config.yaml"))[-1]
    saved.write_bytes(damage)
    line = _one_line_error(capsys, main([*argv[:-4], "max_steps=3", *argv[-3:]]))
    assert str(saved) in line


# ---------------------------------------------------------------------------------------------- 5. kinds
@pytest.mark.parametrize("field", ["markov_rank=64", "confidence_head=false"])
def test_a_field_of_another_kind_is_refused_by_name(field, tiny_llama_dir, tmp_path, capsys):
    line = _one_line_error(capsys, main(["init-drafter", str(tmp_path / "d"), "--target", str(tiny_llama_dir), field]))
    name = field.split("=")[0]
    assert f"{name} belongs to kind=dspark drafters; this one is kind=dflash" in line
    assert main(["init-drafter", str(tmp_path / "s"), "--target", str(tiny_llama_dir), "kind=dspark", field]) == 0


def _train_argv(tiny_llama_dir: Path, tmp_path: Path) -> list[str]:
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text("".join(_tokens_line(i, n=20) + "\n" for i in range(4)))
    return [
        "train", "-", f"target={tiny_llama_dir}", f"tokens={tokens}", "online=true", f"out={tmp_path / 'r'}",
        "max_steps=1", "drafter.num_hidden_layers=1", "drafter.block_size=4", "progress=false", "max_tokens=48",
        "tensorboard=false",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "weight,kind",
    [
        ("dspark_ce_weight=0.5", "dspark"),
        ("dspark_l1_weight=0", "dspark"),
        ("dspark_confidence_weight=2", "dspark"),
        ("selector_weight=0.5", "dflash2"),
        ("lambda_base_start=0.5", "domino"),
        ("consistency_weight=0.5", "xpress"),
    ],
)
def test_another_heads_training_option_on_a_dflash_run_is_refused(weight, kind, tiny_llama_dir, tmp_path, capsys):
    line = _one_line_error(capsys, main([*_train_argv(tiny_llama_dir, tmp_path), weight]))
    name = weight.split("=")[0]
    assert f"{name} belongs to the objective of kind={kind} drafters; this drafter is kind=dflash" in line
    assert not (tmp_path / "r" / "final").exists()


def test_a_dspark_objective_of_zero_weights_is_refused(tiny_llama_dir, tmp_path, capsys):
    zeros = ["dspark_ce_weight=0", "dspark_l1_weight=0", "dspark_confidence_weight=0"]
    argv = [*_train_argv(tiny_llama_dir, tmp_path), "drafter.kind=dspark", *zeros]
    assert "the objective trains nothing" in _one_line_error(capsys, main(argv))


def test_a_draft_vocabulary_is_built_from_data_or_refused(tiny_llama_dir, tmp_path, capsys):
    t = ["--target", str(tiny_llama_dir)]
    for kind in ("dflash", "dspark"):
        argv = ["init-drafter", str(tmp_path / kind), *t, f"kind={kind}", "draft_vocab_size=16"]
        assert "a draft vocabulary is built from data" in _one_line_error(capsys, main(argv))
    line = _one_line_error(capsys, main([*_train_argv(tiny_llama_dir, tmp_path), "drafter.draft_vocab_size=16"]))
    assert "a draft vocabulary is built from data" in line and "--draft-vocab-from" in line
    tokens = tmp_path / "tokens.jsonl"  # written by _train_argv
    argv = ["init-drafter", str(tmp_path / "v"), *t, "draft_vocab_size=16", "--draft-vocab-from", str(tokens)]
    argv += ["num_hidden_layers=1"]
    assert main(argv) == 0
    d2t = load_drafter(tmp_path / "v").draft_to_target
    assert len(set(d2t.tolist())) == 16 and d2t.tolist() == sorted(d2t.tolist())


# ---------------------------------------------------------------------------------------------- 6. exports
@pytest.mark.parametrize("to", ["zlab", "vllm", "speculators"])
def test_an_export_for_another_target_is_refused_before_writing(to, tiny_llama_dir, wide_head_target, tmp_path, capsys):
    d = write_checkpoint(tmp_path / "d", small_config())
    out = tmp_path / f"out-{to}"
    line = _one_line_error(capsys, main(["convert", str(d), str(out), "--to", to, "--target", str(wide_head_target)]))
    assert "≠ the target's" in line and str(d) in line
    assert not out.exists() or not any(out.iterdir())
    assert main(["convert", str(d), str(tmp_path / f"fits-{to}"), "--to", to, "--target", str(tiny_llama_dir)]) == 0


# ---------------------------------------------------------------------------------------------- 7. shards
@pytest.mark.parametrize("where", [0.3, 0.6, 0.9])
def test_a_shard_damaged_inside_is_refused_by_training(where, captured, tiny_llama_dir, tmp_path, capsys):
    out, _, _ = captured
    shard = sorted(out.glob("shard-*"))[0]
    data = bytearray(shard.read_bytes())
    at = int(len(data) * where)
    data[at : at + 4096] = bytes(min(4096, len(data) - at))  # zeros: size unchanged, header intact
    shard.write_bytes(bytes(data))
    argv = ["train", "-", f"target={tiny_llama_dir}", f"features={out}", f"out={tmp_path / 'r'}", "max_steps=2"]
    argv += ["drafter.num_hidden_layers=1", "drafter.block_size=4", f"drafter.target_layer_ids={LAYERS}"]
    argv += ["progress=false", "tensorboard=false", "max_tokens=48"]
    line = _one_line_error(capsys, main(argv))
    assert shard.name in line and "sha256" in line and "rerun `dflashkit capture`" in line
    assert not (tmp_path / "r" / "final").exists()


# ---------------------------------------------------------------------------------------------- 8. servers
class _BadServer:
    """A loopback TCP server that misbehaves: "hang" (accepts, never answers), "trickle" (200 headers, then a byte
    a second), "close" (closes right after reading the request), "half" (headers promise 100 bytes, sends 5)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        conns = []
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()
        for c in conns:
            c.close()

    def _answer(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            if self.mode == "close":
                conn.close()
            elif self.mode == "half":
                conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"a"')
                conn.close()
            elif self.mode == "trickle":
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
                for _ in range(100):
                    if self.stop.wait(0.5):
                        return
                    conn.sendall(b" ")
            else:
                self.stop.wait(30)
        except OSError:
            pass

    def __enter__(self) -> _BadServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


@pytest.mark.parametrize("mode", ["hang", "trickle", "close", "half"])
def test_a_misbehaving_server_ends_in_one_error_naming_it_within_the_timeouts(mode):
    timeouts = ServerTimeouts(connect_s=1.0, first_byte_s=1.0, total_s=2.0, probe_s=1.0)
    with _BadServer(mode) as srv, _BadServer("hang") as other:
        pool = ServerPool([srv.url, other.url], retries=2, backoff_s=0.01, sleep=lambda s: None, timeouts=timeouts)
        t0 = time.monotonic()
        with pytest.raises(ServerError) as e:
            pool.complete([1, 2, 3], max_tokens=4, temperature=0.0, top_p=1.0, seed=0, stop_ids=[2])
        elapsed = time.monotonic() - t0
    message = str(e.value)
    assert srv.url in message and other.url in message and "\n" not in message
    assert elapsed < 3 * timeouts.total_s + 5, elapsed  # three attempts, each cut at its timeouts


def test_server_timeouts_are_settable_and_checked(tmp_path, capsys):
    base = ["prepare", "--data", "sharegpt", "--out", str(tmp_path / "p"), "--server", "http://127.0.0.1:9"]
    for bad in ("10,20", "0,1,2", "a,b,c", "1,2,-3", "1,inf,3"):
        line = _one_line_error(capsys, main([*base, "--server-timeouts", bad]))
        assert "expected three positive numbers of seconds" in line
    line = _one_line_error(capsys, main(["prepare", "--data", "sharegpt", "--out", "x", "--server-timeouts", "1,2,3"]))
    assert "no --server given" in line


# ---------------------------------------------------------------------------------------------- 9. diagnostics
def test_doctor_accepts_a_capture_holding_more_layers_than_the_drafter_reads(captured, target, tmp_path):
    from dflashkit.diagnose.doctor import manifest_findings

    out, _, _ = captured  # layers [1, 4, 6]
    reads_two = small_config(target_layer_ids=[4, 1])
    (finding,) = [f for f in manifest_findings(reads_two, target, out) if f.check == "features"]
    assert finding.status == "OK" and "it reads [4, 1] of them" in finding.line()
    (missing,) = [f for f in manifest_findings(small_config(), target, out) if f.check == "features"]
    assert missing.status == "FAIL" and "layers [2, 3, 5] were not captured" in missing.line()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8])
def test_inspect_flags_an_integer_weight(dtype, tmp_path, capsys):
    path = write_checkpoint(
        tmp_path / "i", small_config(), edit=lambda sd: sd.update({"fc.weight": sd["fc.weight"].to(dtype)})
    )
    assert main(["inspect", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL dtypes: tensors of the wrong kind: ['fc.weight (" in out


@pytest.mark.parametrize("slot", [4, 5, 99])
def test_logs_refuses_a_slot_the_run_does_not_have(slot, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    recs = [{"split": "train", "step": s, "loss": 1.0 / s, "accuracy": [None, 0.1 * s, 0.05 * s, 0.01]} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    line = _one_line_error(capsys, main(["logs", str(run), "--acc-slot", str(slot)]))
    assert f"--acc-slot {slot}: run" in line and "logs the accuracy of 4 slots (0…3)" in line
    assert main(["logs", str(run), "--acc-slot", "2"]) == 0
