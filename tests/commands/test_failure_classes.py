"""Every failure class a user can cause, tested as a class across the commands it reaches: the file system, damaged
safetensors and GGUF files, allocation, devices, the distributed environment, the cache location — each one line
with exit code 2 — and a real bug, which keeps its traceback and asks for a report (exit code 1)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.failures import known_failure
from helpers.bad_input import _one_line_error
from helpers.checkpoints import small_config, write_checkpoint

TOKENS_LINE = json.dumps({"id": "s0", "input_ids": [3, 4, 5, 6, 7, 8], "loss_mask": [0, 0, 0, 1, 1, 1]})


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("d") / "drafter", small_config(block_size=4))


@pytest.fixture()
def tokens(tmp_path) -> Path:
    path = tmp_path / "tokens.jsonl"
    path.write_text(TOKENS_LINE + "\n")
    return path


# ---------------------------------------------------------------------------------------------- file system
def _out_commands(tiny: Path, drafter: Path, tokens: Path, out: Path) -> dict[str, list[str]]:
    """Every command that writes an output directory, pointed at `out`."""
    t = ["--target", str(tiny)]
    return {
        "train": ["train", "-", f"out={out}", f"tokens={tokens}", "online=true", f"target={tiny}", "max_steps=1"],
        "capture": ["capture", *t, "--tokens", str(tokens), "--out", str(out), "--layer-ids", "1,2"],
        "prepare": ["prepare", *t, "--data", str(tokens), "--out", str(out)],
        "eval": ["eval", *t, "--dataset", "mtbench", "--drafter", str(drafter), "--out", str(out)],
        "init-drafter": ["init-drafter", str(out), *t],
        "convert": ["convert", str(drafter), str(out)],
    }


@pytest.mark.parametrize("command", ["train", "capture", "prepare", "eval", "init-drafter", "convert"])
def test_an_output_path_that_is_a_file_is_one_line(command, tiny_llama_dir, drafter_dir, tokens, tmp_path, capsys):
    out = tmp_path / "taken"
    out.write_text("a file, not a directory\n")
    rc = main(_out_commands(tiny_llama_dir, drafter_dir, tokens, out)[command])
    line = _one_line_error(capsys, rc)
    assert str(out) in line and ("file" in line or "directory" in line), line
    assert out.read_text() == "a file, not a directory\n"


@pytest.mark.parametrize(
    "args",
    [
        ["capture", "--tokens", "{dir}", "--out", "{out}"],  # a directory where a file belongs
        ["prepare", "--data", "{dir}", "--out", "{out}"],
        ["eval", "--dataset", "{dir}", "--drafter", "{dir}", "--out", "{out}"],
        ["convert", "{file}", "{out}"],  # a file where a checkpoint directory belongs
        ["train", "-", "features={file}", "out={out}"],
        ["logs", "{missing}"],
        ["report", "{dir}"],
    ],
)
def test_paths_of_the_wrong_kind_or_missing_are_one_line(args, tmp_path, capsys):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x\n")
    names = {
        "dir": tmp_path / "dir",
        "file": tmp_path / "file",
        "missing": tmp_path / "missing",
        "out": tmp_path / "out",
    }
    rc = main([a.format(**names) for a in args])
    line = _one_line_error(capsys, rc)
    assert str(tmp_path) in line, line
    assert not (tmp_path / "out").exists()


def test_os_errors_become_one_line_naming_the_path():
    assert known_failure(IsADirectoryError(21, "Is a directory", "/x/y")) == "/x/y: is a directory (expected a file)"
    assert known_failure(PermissionError(13, "Permission denied", "/root/z")) == "/root/z: permission denied"
    assert known_failure(OSError(28, "No space left on device", "/d/f")).startswith("/d/f: no space left")
    assert known_failure(OSError(99, "weird")) is None  # an OS error outside the known classes stays a bug


# ---------------------------------------------------------------------------------------------- damaged files
@pytest.mark.parametrize("damage", ["empty", "truncated", "not safetensors"])
@pytest.mark.parametrize("command", ["inspect", "eval", "generate", "convert", "info"])
def test_damaged_safetensors_are_one_line_naming_the_file(
    damage, command, drafter_dir, tiny_llama_dir, tmp_path, capsys
):
    d = shutil.copytree(drafter_dir, tmp_path / "d")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"empty": b"", "truncated": data[: len(data) // 2], "not safetensors": b"hello" * 10}[damage])
    t = ["--target", str(tiny_llama_dir)]
    args = {
        "inspect": ["inspect", str(d)],
        "eval": ["eval", *t, "--dataset", "mtbench", "--drafter", str(d), "--out", str(tmp_path / "e")],
        "generate": ["generate", *t, "--drafter", str(d), "--prompt", "hi"],
        "convert": ["convert", str(d), str(tmp_path / "c")],
        "info": ["info", *t, "--drafter", str(d)],
    }[command]
    rc = main(args)
    if command == "inspect":  # inspect reports it as a FAIL finding (exit 1), never a traceback
        err = capsys.readouterr()
        assert rc == 1 and "Traceback" not in err.err and "model.safetensors" in err.out
        return
    assert "model.safetensors" in _one_line_error(capsys, rc)


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_damaged_gguf_targets_are_one_line(damage, tmp_path, capsys):
    from dflashkit.target.default import gguf_path

    gguf = tmp_path / "model.gguf"
    head = gguf_path().read_bytes()[:4096]
    gguf.write_bytes({"empty": b"", "truncated": head, "garbage": b"GGUF" + b"\xff" * 64}[damage])
    line = _one_line_error(capsys, main(["info", "--target", str(gguf)]))
    assert str(gguf) in line and ("GGUF" in line or "empty" in line), line


# ---------------------------------------------------------------------------------------------- allocation
def test_sizes_beyond_the_machine_are_refused_before_allocating(tiny_llama_dir, tmp_path, capsys):
    line = _one_line_error(
        capsys,
        main(["init-drafter", str(tmp_path / "d"), "--target", str(tiny_llama_dir), "intermediate_size=2000000000"]),
    )
    assert "GB for its weights" in line and "this machine can allocate" in line
    assert "intermediate_size = 2000000000: " in line and "intermediate_size is the size that costs the most" in line
    line = _one_line_error(  # a size past what any count may be is refused by its type, before any arithmetic
        capsys,
        main(["init-drafter", str(tmp_path / "d"), "--target", str(tiny_llama_dir), "intermediate_size=100000000000"]),
    )
    assert "intermediate_size = 100000000000: expected an integer ≥ 1 and < 2^31" in line
    big = shutil.copytree(tiny_llama_dir, tmp_path / "big")
    cfg = json.loads((big / "config.json").read_text())
    cfg["vocab_size"] = 2 * 10**9
    (big / "config.json").write_text(json.dumps(cfg))
    line = _one_line_error(capsys, main(["info", "--target", str(big)]))
    assert "config.json" in line and "GB for its weights" in line
    cfg["hidden_size"] = -64
    (big / "config.json").write_text(json.dumps(cfg))
    assert "hidden_size = -64: expected an integer ≥ 1" in _one_line_error(capsys, main(["info", "--target", str(big)]))
    assert (tmp_path / "d").exists() is False


def test_allocation_failures_from_torch_are_one_line():
    err = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: you tried "
        "to allocate 2304000000000 bytes"
    )
    assert known_failure(err).startswith("out of memory (")
    assert known_failure(MemoryError()).startswith("out of memory (")
    assert known_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20 GiB")).startswith("out of")


# ---------------------------------------------------------------------------------------------- devices
@pytest.mark.parametrize("device", ["nonsense", "cuda:99", "tpu"] + ([] if torch.cuda.is_available() else ["cuda"]))
@pytest.mark.parametrize("command", ["info", "generate", "eval", "capture", "prepare", "doctor", "diff"])
def test_a_device_this_machine_lacks_is_one_line(device, command, drafter_dir, tmp_path, capsys):
    args = {
        "info": ["info"],
        "generate": ["generate", "--prompt", "hi", "--method", "ar"],
        "eval": ["eval", "--dataset", "mtbench", "--out", str(tmp_path / "e"), "--methods", "ar"],
        "capture": ["capture", "--tokens", "t.jsonl", "--out", str(tmp_path / "c")],
        "prepare": ["prepare", "--data", "mtbench", "--out", str(tmp_path / "p")],
        "doctor": ["doctor", "--drafter", str(drafter_dir)],
        "diff": ["diff", str(drafter_dir), str(drafter_dir)],
    }[command]
    line = _one_line_error(capsys, main([*args, "--device", device]))
    assert f"--device {device!r}" in line and "expected a device" in line, line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("field", ["drafter_device", "target_device"])
def test_training_devices_are_checked_with_the_config(field, tmp_path, capsys):
    line = _one_line_error(capsys, main(["train", "-", "features=f", f"out={tmp_path / 'r'}", f"{field}=cuda:99"]))
    assert f'{field} = "cuda:99": expected a device' in line
    assert known_failure(AssertionError("Torch not compiled with CUDA enabled")).startswith("device not available")


# ---------------------------------------------------------------------------------------------- distributed
@pytest.mark.parametrize(
    "env,says",
    [
        ({"WORLD_SIZE": "2"}, "RANK, MASTER_ADDR, MASTER_PORT not set"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "MASTER_ADDR, MASTER_PORT not set"),
        ({"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "RANK = 3"),
        ({"RANK": "zero", "WORLD_SIZE": "2"}, "RANK = 'zero': expected an integer"),
    ],
)
def test_a_half_set_torchrun_environment_is_one_line(env, says, tokens, tiny_llama_dir, tmp_path, capsys, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "-",
            f"tokens={tokens}",
            "online=true",
            f"target={tiny_llama_dir}",
            f"out={out}",
            "max_steps=1",
            "--no-progress",
        ]
    )
    line = _one_line_error(capsys, rc)
    assert "torchrun environment" in line and says in line, line


def test_a_cache_variable_pointing_at_a_file_is_one_line(tmp_path, capsys, monkeypatch):
    f = tmp_path / "cachefile"
    f.write_text("x")
    monkeypatch.setenv("DFLASHKIT_CACHE", str(f))
    line = _one_line_error(capsys, main(["info"]))
    assert f"DFLASHKIT_CACHE={f}" in line and "is a file" in line


# ---------------------------------------------------------------------------------------------- a bug
def test_a_real_bug_keeps_its_traceback_and_asks_for_a_report(monkeypatch, capsys):
    import dflashkit.diagnose.info as info

    def broken(*a, **kw):
        return {}["no such key"]

    monkeypatch.setattr(info, "gather_info", broken)
    rc = main(["info"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "Traceback" in err and "KeyError" in err
    assert "internal error (KeyError): this is a bug in dflashkit" in err.splitlines()[-1]
