"""Model cards: every `convert --to` layout and the GGUF export write one beside the weights; its front matter is
YAML naming the target, it states the drafter's geometry, the commands it prints parse (dflashkit's with the real
parser) and name each kind's llama.cpp spec type, a refusing engine is listed with its reason, `--eval DIR` puts the
τ of that results.json into it (and refuses one that measured another drafter), a README.md that is not the export's
own card is never replaced, and the quickstart's export has one."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from dflashkit import cli
from dflashkit.cli import main
from dflashkit.drafter.checkpoint import load_drafter, save_drafter
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.evaluate.stats import drafter_fingerprint
from dflashkit.export.convert import export_checkpoint
from dflashkit.export.gguf_export import export_gguf
from dflashkit.export.model_card import CARD_NAME
from helpers.checkpoints import small_config, write_checkpoint
from helpers.target_gguf import write_target_gguf

TOKEN_ROW = {"learned_mask_embedding": False, "mask_token_id": 90}
DSPARK = {**TOKEN_ROW, "kind": "dspark", "markov_rank": 8}


@pytest.fixture(scope="module")
def target_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    return write_target_gguf(tmp_path_factory.mktemp("tgguf") / "target.gguf", tiny_llama_dir)


def card(path: Path) -> tuple[dict, str]:
    """(front matter, body) of a card."""
    text = path.read_text()
    m = re.match(r"^---\n(.*?)\n---\n(.*)$", text, re.S)
    assert m, text[:200]
    return yaml.safe_load(m.group(1)), m.group(2)


def commands(body: str, program: str) -> list[list[str]]:
    """The argv of every line starting with `program` in the card's bash blocks (each must parse as shell)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", body, re.S):
        out += [shlex.split(line) for line in block.splitlines() if line.startswith(program + " ")]
    return out


def parses(argv: list[str]) -> None:
    """A dflashkit command line the real parser accepts (a placeholder such as TARGET is a value like any)."""
    assert argv[0] == "dflashkit"
    cli._parse(cli.build_parser(), argv[1:])


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("to", ["zlab", "vllm", "speculators"])
def test_every_directory_layout_gets_a_card_with_geometry_and_serve_commands(tmp_path, tiny_llama_dir, to):
    cfg = small_config(**TOKEN_ROW)
    src = write_checkpoint(tmp_path / "run" / "final", cfg)
    out = tmp_path / "export"
    assert main(["convert", str(src), str(out), "--to", to, "--target", str(tiny_llama_dir)]) == 0
    front, body = card(out / CARD_NAME)
    assert front["base_model"] == str(tiny_llama_dir)
    assert {"dflashkit", "speculative-decoding", "dflash", to} <= set(front["tags"])
    assert front["library_name"]
    assert "| kind | DFlash (`dflash`) |" in body
    assert "| block size | 4 (3 drafts a round) |" in body
    assert "[1, 2, 3, 4, 5]" in body and "token row 90" in body and "LlamaForCausalLM" in body
    (vllm,) = commands(body, "vllm")
    spec = json.loads(flag(vllm, "--speculative-config"))
    assert vllm[:3] == ["vllm", "serve", str(tiny_llama_dir)]
    assert spec == {"method": "dflash", "model": str(out), "num_speculative_tokens": 3}
    (server,) = commands(body, "llama-server")
    assert flag(server, "--spec-type") == "draft-dflash" and flag(server, "--spec-draft-n-max") == "3"
    dflashkit = commands(body, "dflashkit")
    for argv in dflashkit:
        parses(argv)
    convert = [a for a in dflashkit if a[1] == "convert"]
    assert convert and flag(convert[0], "--to") == "gguf" and flag(server, "-md") == convert[0][3]
    checks = [a for a in dflashkit if a[1] == "serve-check"]
    assert {flag(a, "--server") for a in checks} == {"http://127.0.0.1:8000", "http://127.0.0.1:8080"}
    evals = [a for a in dflashkit if a[1] == "eval"]
    assert "Not measured here" in body and evals and flag(evals[0], "--target") == str(tiny_llama_dir)


def test_a_refusing_engine_is_listed_with_its_reason_and_dspark_serves_as_dspark(tmp_path, tiny_llama_dir):
    src = write_checkpoint(tmp_path / "d", small_config(**DSPARK))
    out = tmp_path / "zlab"
    assert main(["convert", str(src), str(out), "--target", str(tiny_llama_dir)]) == 0
    _, body = card(out / CARD_NAME)
    assert re.search(r"\| vLLM \(CPU\) \| refuses \| vLLM runs DSpark drafters only in its GPU model runner", body)
    assert re.search(r"\| z-lab \| refuses \| z-lab's DFlashDraftModel has no Markov or confidence head", body)
    assert "| markov_rank | 8 |" in body
    assert not commands(body, "vllm")  # vLLM's DSpark model is unverified: no command
    (server,) = commands(body, "llama-server")
    assert flag(server, "--spec-type") == "draft-dspark" and flag(server, "--spec-draft-n-max") == "4"


def test_deepspec_layout_card(tmp_path, tiny_llama_dir):
    src = write_checkpoint(tmp_path / "d", small_config(**DSPARK))
    out = tmp_path / "ds"
    assert main(["convert", str(src), str(out), "--to", "deepspec", "--target", str(tiny_llama_dir)]) == 0
    front, body = card(out / CARD_NAME)
    assert "deepspec" in front["tags"] and "| DeepSpec | loads |" in body
    for argv in commands(body, "dflashkit"):
        parses(argv)


@pytest.mark.parametrize(
    ("extra", "spec_type", "n_max"), [(TOKEN_ROW, "draft-dflash", "3"), (DSPARK, "draft-dspark", "4")]
)
def test_gguf_card(tmp_path, target_gguf, extra, spec_type, n_max):
    src = write_checkpoint(tmp_path / "d", small_config(**extra))
    out = tmp_path / "g" / "drafter.gguf"
    report = export_gguf(src, out, target=target_gguf, outtype="f32")
    assert f"model card: {out.parent / CARD_NAME}" in report.render()
    front, body = card(out.parent / CARD_NAME)
    assert front["library_name"] == "gguf" and front["base_model"] == str(target_gguf)
    (server,) = commands(body, "llama-server")
    assert server[:5] == ["llama-server", "-m", str(target_gguf), "-md", str(out)]
    assert flag(server, "--spec-type") == spec_type and flag(server, "--spec-draft-n-max") == n_max
    (check,) = [a for a in commands(body, "dflashkit") if a[1] == "serve-check"]
    parses(check)
    assert check[2] == str(src) and flag(check, "--served-drafter") == str(out)


def test_gguf_never_replaces_a_readme_that_is_not_its_own_card(tmp_path, target_gguf):
    src = write_checkpoint(tmp_path / "d", small_config(**TOKEN_ROW))
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / CARD_NAME).write_text("my own notes\n")
    export_gguf(src, folder / "a.gguf", target=target_gguf, outtype="f32")
    assert (folder / CARD_NAME).read_text() == "my own notes\n"
    assert "a.gguf" in (folder / "a.README.md").read_text()
    (folder / CARD_NAME).unlink()
    export_gguf(src, folder / "a.gguf", target=target_gguf, outtype="f32", overwrite=True)  # README.md free: a's
    export_gguf(src, folder / "b.gguf", target=target_gguf, outtype="f32")  # README.md is a's card: b's goes beside
    assert "a.gguf" in (folder / CARD_NAME).read_text() and "b.gguf" in (folder / "b.README.md").read_text()
    export_gguf(src, folder / "a.gguf", target=target_gguf, outtype="q8_0", overwrite=True)  # its own card: rewritten
    assert "-md " + str(folder / "a.gguf") in (folder / CARD_NAME).read_text()


def results_json(path: Path, fingerprint: str) -> Path:
    """A results.json as `dflashkit eval` writes it (the fields a card reads), by hand."""
    stats = {"tau_micro": 2.71, "tau_macro": 2.5, "histogram": [1, 2], "tok_s": 41.0, "speedup_vs_ar": 1.62}
    doc = {
        "schema": "dflashkit.eval/1",
        "kind": "evaluate",
        "target": {"source": "/models/tiny", "dtype": "float32", "device": "cpu"},
        "dataset": {"name": "humaneval", "n_prompts": 12},
        "settings": {"max_new_tokens": 64, "sampling": {"temperature": 0.0}},
        "drafters": {"mine": {"fingerprint": fingerprint, "parameters": 1}},
        "results": {"mine": {"chain": stats, "ddtree:8": {**stats, "tau_micro": 3.14}}},
        "machine": {"cpu": "Test CPU 9000", "flags": ["avx2"], "blas": "MKL 2024.2", "torch": "2.13", "threads": 2},
    }
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps(doc))
    return path


def test_eval_dir_puts_the_measured_tau_into_the_card_and_another_drafters_is_refused(tmp_path, tiny_llama_dir):
    src = write_checkpoint(tmp_path / "d", small_config(**TOKEN_ROW))
    ev = results_json(tmp_path / "ev", drafter_fingerprint(load_drafter(src)))  # what `eval --drafter d` records
    out = tmp_path / "out"
    argv = ["convert", str(src), str(out), "--to", "vllm", "--target", str(tiny_llama_dir), "--eval", str(ev)]
    assert main(argv) == 0
    _, body = card(out / CARD_NAME)
    assert "### humaneval: 12 prompts, 64 new tokens, temperature 0.0" in body
    assert "| ddtree:8 | 3.14 | 2.50 | 41.0 | 1.62× |" in body and "| chain | 2.71 |" in body
    assert "Test CPU 9000 (avx2), MKL 2024.2, torch 2.13, 2 threads" in body and "Not measured" not in body
    other = results_json(tmp_path / "other", "0123456789abcdef")
    assert main([*argv[:2], str(tmp_path / "out2"), *argv[3:-1], str(other)]) == 2
    assert not (tmp_path / "out2").exists()  # refused before anything is written


def test_training_record_is_what_the_run_recorded(tmp_path, tiny_llama_dir):
    run = tmp_path / "run"
    cfg = small_config(**TOKEN_ROW)
    cfg.extra = {**cfg.extra, "data": {"thinking": "off", "turns": 1}, "train_context": 300}
    save_drafter(DFlashDrafter(cfg), run / "final", metadata={"step": "120"})
    step = run / "checkpoints" / "step-000120"
    step.mkdir(parents=True)
    (step / "train_config.yaml").write_text(yaml.safe_dump({"target": str(tiny_llama_dir), "loss": "kl", "lr": 3e-4}))
    (run / "latest").write_text("checkpoints/step-000120\n")
    out = tmp_path / "out"
    assert main(["convert", str(run / "final"), str(out)]) == 0  # no --target: the run names it
    front, body = card(out / CARD_NAME)
    assert front["base_model"] == str(tiny_llama_dir)
    assert "optimiser steps: 120" in body and "longest training context: 300 tokens" in body
    assert 'thinking "off"' in body and 'loss: `"kl"`' in body and "lr: `0.0003`" in body
    for argv in commands(body, "dflashkit"):
        parses(argv)
        if argv[1] in ("eval", "serve-check"):
            assert flag(argv, "--thinking") == "off"


def test_the_quickstart_export_has_a_card_and_gets_its_evaluations_tau(tmp_path, target):
    from dflashkit.quickstart.run import card_with_tau

    src = write_checkpoint(tmp_path / "final", small_config(**TOKEN_ROW))
    drafter = tmp_path / "drafter"
    notes = export_checkpoint(target, src, drafter)
    assert notes[-1] == f"model card: {drafter / CARD_NAME}"
    front, body = card(drafter / CARD_NAME)
    assert front["library_name"] == "vllm" and front["base_model"] == target.source and "Not measured" in body
    ev = results_json(tmp_path / "eval" / "humaneval", "not checked: the quickstart evaluated this directory")
    doc = json.loads((ev / "results.json").read_text())
    doc["results"] = {"quickstart": doc["results"].pop("mine")}
    (ev / "results.json").write_text(json.dumps(doc))
    card_with_tau(
        target, drafter, {"export": {"from": str(src)}, "eval": {"humaneval": {"results": str(ev / "results.json")}}}
    )
    front, body = card(drafter / CARD_NAME)
    assert front["library_name"] == "vllm" and "| ddtree:8 | 3.14 |" in body and "Not measured" not in body


def test_a_real_eval_of_two_drafters_gives_the_card_the_exported_ones_tau(tmp_path, tiny_llama_dir):
    """`eval` output as written (machine included): the card takes the drafter whose fingerprint is the export's."""
    mine = write_checkpoint(tmp_path / "mine", small_config(**TOKEN_ROW), seed=1)
    other = write_checkpoint(tmp_path / "other", small_config(**TOKEN_ROW), seed=2)
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"p{i}", "prompt_ids": [3 + i, 14, 15, 9, 2, 6]}) + "\n" for i in range(2))
    )
    ev = tmp_path / "ev"
    argv = ["eval", "--target", str(tiny_llama_dir), "--drafter", f"other={other}", "--drafter", f"mine={mine}"]
    argv += ["--dataset", str(data), "--methods", "chain", "--max-new-tokens", "8", "--ignore-eos", "--quiet"]
    assert main([*argv, "--no-warmup", "--compile", "off", "--out", str(ev)]) == 0
    doc = json.loads((ev / "results.json").read_text())
    assert doc["machine"]["cpu"] and doc["machine"]["threads"] >= 1
    out = tmp_path / "zlab"
    assert main(["convert", str(mine), str(out), "--target", str(tiny_llama_dir), "--eval", str(ev)]) == 0
    _, body = card(out / CARD_NAME)
    tau = doc["results"]["mine"]["chain"]["tau_micro"]
    assert f"| chain | {tau:.2f} |" in body and "(drafter `mine`)" in body
    assert f"{doc['machine']['cpu']}" in body and "2 prompts, 8 new tokens" in body
