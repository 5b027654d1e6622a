"""An output directory has one writer: a second `train`, `capture`, `prepare` or `eval` on a directory held by a
live run is refused naming the holder; a lock left by a dead run is taken over with a note; locks nest within one
process and go away when released."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflashkit.cli import main
from dflashkit.errors import ConfigError
from dflashkit.output_dir import LOCK_NAME, one_writer
from helpers.bad_input import DEAD_PID, _one_line_error
from helpers.checkpoints import small_config, write_checkpoint

HOLD = """
import sys, time
from dflashkit.output_dir import one_writer
with one_writer(sys.argv[1], "dflashkit train (test holder)"):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture()
def holder(tmp_path):
    """A live process holding `tmp_path / 'out'`."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield out, proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _commands(out: Path, tiny: Path, tmp_path: Path) -> dict[str, list[str]]:
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(json.dumps({"id": "s", "input_ids": [3, 4, 5, 6, 7], "loss_mask": [0, 0, 1, 1, 1]}) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "prompt_ids": [3, 4, 5]}) + "\n")
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    drafter = write_checkpoint(tmp_path / "drafter", small_config(block_size=4))
    t = ["--target", str(tiny)]
    return {
        "train": [
            "train",
            "-",
            f"out={out}",
            f"tokens={tokens}",
            "online=true",
            f"target={tiny}",
            "max_steps=1",
            "--no-progress",
        ],
        "capture": ["capture", *t, "--tokens", str(tokens), "--out", str(out), "--layer-ids", "1,2", "--quiet"],
        # prepare needs a tokenizer with a chat template: the embedded SmolLM2
        "prepare": ["prepare", "--target", "default", "--data", str(chat), "--out", str(out), "--no-regenerate"],
        "eval": [
            "eval",
            *t,
            "--dataset",
            str(prompts),
            "--drafter",
            f"d={drafter}",
            "--methods",
            "ar",
            "--max-new-tokens",
            "2",
            "--out",
            str(out),
            "--quiet",
        ],
    }


@pytest.mark.parametrize("command", ["train", "capture", "prepare", "eval"])
def test_a_second_run_on_a_held_directory_is_refused(command, holder, tiny_llama_dir, tmp_path, capsys):
    out, proc = holder
    line = _one_line_error(capsys, main(_commands(out, tiny_llama_dir, tmp_path)[command]))
    assert f"{out} is in use by dflashkit train (test holder) (pid {proc.pid} on {socket.gethostname()}" in line
    assert "one run writes an output directory at a time" in line
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # the holder's lock, nothing of the refused run


def test_the_directory_is_free_again_once_the_holder_dies(holder, tiny_llama_dir, tmp_path, capsys):
    out, proc = holder
    proc.kill()
    proc.wait(timeout=30)
    rc = main(_commands(out, tiny_llama_dir, tmp_path)["capture"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert f"taking over the lock of dflashkit train (test holder) (pid {proc.pid}" in err
    assert not (out / LOCK_NAME).exists()


def test_a_stale_lock_file_of_a_dead_pid_is_taken_over_with_a_note(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    stale = {"pid": DEAD_PID, "host": socket.gethostname(), "command": "dflashkit eval", "started": time.time() - 99}
    (out / LOCK_NAME).write_text(json.dumps(stale))
    notes = []
    with one_writer(out, "dflashkit eval", log=notes.append):
        mine = json.loads((out / LOCK_NAME).read_text())
        assert mine["pid"] == os.getpid() and mine["command"] == "dflashkit eval"
    assert len(notes) == 1 and f"pid {DEAD_PID}" in notes[0] and "no longer running" in notes[0]
    assert not (out / LOCK_NAME).exists()


def test_locks_nest_in_one_process_and_refuse_a_file(tmp_path):
    out = tmp_path / "out"
    with one_writer(out, "dflashkit quickstart"), one_writer(out, "dflashkit train"):
        assert (out / LOCK_NAME).exists()
    assert not (out / LOCK_NAME).exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="is a file; expected a directory"), one_writer(tmp_path / "f", "x"):
        pass
