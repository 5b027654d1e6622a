"""Bad input in files and runs, beyond the data lines: drafter configs of the wrong type, non-UTF-8 files,
training that cannot start or save (disk full, stale temps of dead processes), and CLI argument errors —
each one clear line naming the file or field, never lost work."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dflashkit.cli import build_parser, main
from dflashkit.data.samples import Sample
from dflashkit.drafter.checkpoint import load_drafter, save_drafter
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.defaults import default_drafter_config
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.errors import CheckpointError, ConfigError, DataError, TargetError
from dflashkit.evaluate.stats import load_prompts
from dflashkit.features.manifest import Manifest
from dflashkit.target.model import Target
from dflashkit.train.config import TrainConfig
from dflashkit.train.loop import train
from helpers.bad_input import (
    CHAT_OK,
    DEAD_PID,
    DRAFTER,
    FAKE_TARGET,
    PROMPT_OK,
    _one_line_error,
    _tokens_line,
)

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
    for argv in (
        ["inspect", str(d), "--no-values"],
        ["doctor", *t, "--drafter", str(d), "--prompts", "1", "--max-new-tokens", "2"],
    ):
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
        from dflashkit.evaluate.report import load_results

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
    base = dict(
        out=str(out),
        drafter=dict(DRAFTER),
        max_tokens=32,
        max_steps=2,
        save_every=1,
        progress=False,
        tensorboard=False,
        val_fraction=0.0,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_max_tokens_without_supervised_tokens_is_refused_before_training(samples, target, tmp_path):
    with pytest.raises(
        DataError,
        match=r"max_tokens=8 leaves nothing to train on: .*position 10 \(0-based\).*"
        r"raise max_tokens above 11",
    ):
        train(_cfg(tmp_path / "run", max_tokens=8), dataset=samples, target=target)
    assert not (tmp_path / "run" / "checkpoints").exists()
    unsupervised = [Sample(s.id, s.input_ids, torch.zeros_like(s.loss_mask), s.features) for s in samples]
    with pytest.raises(DataError, match="none of the 4 training samples has two consecutive supervised tokens"):
        train(_cfg(tmp_path / "run2"), dataset=unsupervised, target=target)


def test_disk_full_during_checkpoint_save_keeps_the_previous_one_and_leftovers_go(
    samples, target, tmp_path, monkeypatch
):
    import dflashkit.train.state as ts

    out = tmp_path / "run"
    real_save = torch.save
    calls = []

    def full_disk(obj, f, *a, **kw):  # the second checkpoint's train_state.pt hits a full disk
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
    load_drafter(out / "checkpoints" / "step-000001")  # loadable
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001"]  # no temp dir left
    monkeypatch.setattr(ts.torch, "save", real_save)

    # what a SIGKILL mid-save leaves behind, from processes that are gone; a live process's temp dir stays
    stale = [out / "checkpoints" / f".step-000002.tmp-{DEAD_PID}", out / f".final.tmp-{DEAD_PID}"]
    live = out / "checkpoints" / f".step-000009.tmp-{os.getppid()}"
    for d in [*stale, live]:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    res = train(_cfg(out), dataset=samples, target=target)  # resumes from step 1
    assert res.step == 2 and res.stopped == "completed"
    assert not any(d.exists() for d in stale) and live.exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")) == [
        "step-000001",
        "step-000002",
    ]


def test_stale_temps_of_dead_processes_go_and_an_interrupted_replacement_is_undone(tmp_path):
    from dflashkit.io_utils import remove_stale_temps

    (tmp_path / f".final.old-{DEAD_PID}").mkdir()  # killed between the two renames
    (tmp_path / f".final.old-{DEAD_PID}" / "config.json").write_text("{}")
    (tmp_path / "step").mkdir()
    (tmp_path / f".step.old-{DEAD_PID}").mkdir()  # NAME exists: just a leftover
    (tmp_path / f".latest.tmp-{DEAD_PID}").write_text("x")
    (tmp_path / f".mine.tmp-{os.getpid()}").write_text("x")  # our pid on a leftover: an earlier process
    (tmp_path / f".busy.tmp-{os.getppid()}").write_text("x")  # a live process: kept
    (tmp_path / ".other.tmp").write_text("x")  # not ours to judge: kept
    logs: list[str] = []
    removed = remove_stale_temps(tmp_path, log=logs.append)
    assert sorted(p.name for p in removed) == sorted(
        [f".step.old-{DEAD_PID}", f".latest.tmp-{DEAD_PID}", f".mine.tmp-{os.getpid()}"]
    )
    assert (tmp_path / "final" / "config.json").is_file() and any("restored" in x for x in logs)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["final", "step", f".busy.tmp-{os.getppid()}", ".other.tmp"]
    )


def test_interrupted_writes_in_a_locked_directory_go(tmp_path):
    """A SIGKILL during a shard write leaves atomic_path's temp and the `.tmpXXXXXX` safetensors' save_file
    (Rust's tempfile crate) creates beside it (seen in a killed two-rank capture); both go, nothing else does."""
    from dflashkit.io_utils import remove_interrupted_writes

    for name in [".shard-00003.safetensors.k3j2x1.tmp", ".tmpuanqnK", "shard-00000.safetensors", ".tmp", ".tmpdir"]:
        (tmp_path / name).write_text("x")
    (tmp_path / "manifest.json").write_text("{}")
    removed = remove_interrupted_writes(tmp_path)
    assert sorted(p.name for p in removed) == [".shard-00003.safetensors.k3j2x1.tmp", ".tmpuanqnK"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp", ".tmpdir", "manifest.json", "shard-00000.safetensors"]
    assert remove_interrupted_writes(tmp_path / "absent") == []


def test_write_failure_words():
    from dflashkit.io_utils import write_failure

    assert write_failure("/x", OSError(errno.ENOSPC, "No space left on device")).startswith("the disk is full")
    torch_words = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 576 vs 470")
    assert write_failure("/x", torch_words).startswith("the write failed, most likely a full disk")
    assert write_failure("/x", OSError(errno.EACCES, "Permission denied")).startswith("the write failed (")


def test_failed_final_save_is_one_line(samples, target, tmp_path, monkeypatch):
    import dflashkit.train.state as ts

    def full_disk(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(
        ts,
        "save_drafter",
        lambda d, path, **kw: full_disk() if ".final.tmp" in str(path) else save_drafter(d, path, **kw),
    )
    with pytest.raises(CheckpointError, match=r"cannot write .*final: the disk is full .*step-000002 is intact"):
        train(_cfg(tmp_path / "run"), dataset=samples, target=target)
    assert not list((tmp_path / "run").glob(".final.tmp-*"))


# ---------------------------------------------------------------------------------------------- target, CLI
def test_broken_tokenizer_files_are_an_error_naming_the_directory(tiny_llama_dir, tmp_path):
    d = shutil.copytree(tiny_llama_dir, tmp_path / "t")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {broken')
    with pytest.raises(
        TargetError,
        match=rf"{d}: the tokenizer files \['tokenizer.json'\] exist but cannot be "
        rf"loaded \(.*Error",
    ):
        Target.load(d)


def test_init_drafter_accepts_target_between_out_and_overrides(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["init-drafter", str(out), "--target", str(tiny_llama_dir), "num_hidden_layers=1", "block_size=4"]) == 0
    cfg = DrafterConfig.load(out / "config.json")
    assert (cfg.num_hidden_layers, cfg.block_size) == (1, 4)
    rc = main(["init-drafter", str(out), "--target", str(tiny_llama_dir), "--no-such-option"])
    assert "unrecognized arguments: --no-such-option" in _one_line_error(capsys, rc)


def test_flags_are_never_abbreviated_and_the_error_names_the_command(tmp_path, capsys):
    """argparse's prefix matching would read `convert SRC --out DIR` as `--outtype DIR`, and a typo as whatever flag
    it starts; every command takes its flags whole, and an unknown one is named with the command it was given to."""
    rc = main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "o")])
    line = _one_line_error(capsys, rc)
    assert line.startswith("dflashkit convert: error: unrecognized arguments: --out"), line
    assert "(see dflashkit convert --help)" in line
    rc = main(["eval", "--drafter", "a=b", "--data", "mtbench", "--out", str(tmp_path / "e")])  # --dataset, short
    assert "the following arguments are required: --dataset" in _one_line_error(capsys, rc)
    rc = main(["eval", "--drafters", "x", "--dataset", "mtbench", "--out", str(tmp_path / "e")])
    assert _one_line_error(capsys, rc).startswith("dflashkit eval: error: unrecognized arguments: --drafters x")


@pytest.mark.parametrize("command", ["generate", "eval", "simulate"])
def test_a_missing_drafter_is_named_before_the_target_loads(command, tmp_path, capsys, monkeypatch):
    """A wrong checkpoint path costs seconds, not the minutes a large target takes to load."""
    monkeypatch.setattr(Target, "load", lambda *a, **k: pytest.fail("the target loaded before the drafter was checked"))
    args = {
        "generate": ["generate", "--drafter", str(tmp_path / "nope"), "--prompt", "hi"],
        "eval": ["eval", "--drafter", f"d={tmp_path / 'nope'}", "--dataset", "mtbench", "--out", str(tmp_path / "e")],
        "simulate": [
            *("simulate", "--drafter", f"d={tmp_path / 'nope'}", "--dataset", "mtbench"),
            *("--out", str(tmp_path / "s"), "--cache", str(tmp_path / "c")),
        ],
    }[command]
    rc = main(args)
    assert "nope does not exist" in _one_line_error(capsys, rc)


@pytest.mark.parametrize("command", ["eval", "simulate", "serve-check"])
def test_a_malformed_dataset_is_named_before_the_target_loads(command, tmp_path, capsys, monkeypatch):
    """The prompts file is read before the target loads: its bad line is named in seconds, not after minutes."""
    monkeypatch.setattr(Target, "load", lambda *a, **k: pytest.fail("the target loaded before the dataset was read"))
    data = tmp_path / "p.jsonl"
    data.write_text(CHAT_OK + "\n" + '{"prompt": ' + "\n")
    args = {
        "eval": ["eval", "--methods", "ar", "--dataset", str(data), "--out", str(tmp_path / "e")],
        "simulate": [
            *("simulate", "--drafter", f"d={tmp_path / 'nope'}", "--dataset", str(data)),
            *("--out", str(tmp_path / "s"), "--cache", str(tmp_path / "c")),
        ],
        "serve-check": ["serve-check", str(tmp_path / "nope"), "--dataset", str(data)],
    }[command]
    line = _one_line_error(capsys, main(args))
    assert f"{data}:2: invalid JSON" in line, line


@pytest.mark.parametrize("command", ["prepare", "eval", "simulate"])
def test_every_command_whose_error_hint_says_on_error_has_it(command, tmp_path):
    required = {
        "prepare": ["--data", "x.jsonl", "--out", "o"],
        "eval": ["--dataset", "x.jsonl", "--out", "o"],
        "simulate": ["--dataset", "x.jsonl", "--out", "o", "--cache", "c", "--drafter", "a=b"],
    }[command]
    args = build_parser().parse_args([command, *required, "--on-error", "skip"])
    assert args.on_error == "skip"


def test_cli_prepare_skips_and_counts_a_non_utf8_line(tmp_path, capsys, monkeypatch):
    """`prepare --on-error skip` over a file with a Latin-1 line: skipped, counted in the summary and in
    prepare.json; without it, one line naming file:line and --on-error skip."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dflashkit.target.default import ensure_default_target

    tdir = tmp_path / "t"
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=256,
            tie_word_embeddings=True,
        )
    ).save_pretrained(tdir)
    AutoTokenizer.from_pretrained(ensure_default_target()).save_pretrained(tdir)
    data = tmp_path / "chats.jsonl"
    data.write_bytes(CHAT_OK.encode() + b"\n" + b'{"prompt": "caf\xe9"}\n' + CHAT_OK.replace("hi", "ho").encode())
    base = ["prepare", "--target", str(tdir), "--data", str(data), "--no-regenerate", "--max-length", "64"]
    line = _one_line_error(capsys, main([*base, "--out", str(tmp_path / "a")]))
    assert f"{data}:2: not valid UTF-8" in line and "--on-error skip" in line
    assert main([*base, "--out", str(tmp_path / "b"), "--on-error", "skip"]) == 0
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
