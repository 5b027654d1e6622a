"""bench/regen_throughput.py on a tiny target: every batch size answers every prompt, left padding leaves greedy
output unchanged, and the last line is the JSON summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.bench_scripts import load_bench


def write_prompts(path: Path, lengths: list[int]) -> Path:
    g = torch.Generator().manual_seed(5)
    with open(path, "w", encoding="utf-8") as f:
        for i, n in enumerate(lengths):
            ids = torch.randint(3, 97, (n,), generator=g).tolist()  # no special ids (0 pad, 1 bos, 2 eos)
            f.write(json.dumps({"id": f"p{i}", "prompt_ids": ids}) + "\n")
    return path


def test_regen_throughput_tiny(tiny_llama_dir, tmp_path, capsys):
    bench = load_bench("regen_throughput")
    prompts = write_prompts(tmp_path / "prompts.jsonl", [5, 9, 7, 30, 6])  # the 30-token one is skipped
    assert (
        bench.main(
            [
                "--target",
                str(tiny_llama_dir),
                "--dataset",
                str(prompts),
                "--prompts",
                "4",
                "--max-prompt-tokens",
                "12",
                "--max-new-tokens",
                "6",
                "--batch-sizes",
                "1,3",
                "--repeats",
                "2",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(lines[-1])
    assert doc["batch_sizes"] == [1, 3] and doc["n_prompts"] == 4 and doc["repeats"] == 2
    assert all(t > 0 for t in doc["tok_s"]) and all(r > 0 for r in doc["responses_per_min"])
    assert doc["same_as_first"] == [1.0, 1.0]  # batching (left padding) keeps greedy output
    assert doc["best_batch_size"] in (1, 3)
    assert doc["runs"] == ["auto@1", "auto@3"] and doc["best_products"] == "auto"
    assert any(line.split()[:2] == ["auto", "3"] for line in lines[:-1])  # one table row per run


def test_products_side_by_side(tiny_llama_dir, tmp_path, capsys):
    bench = load_bench("regen_throughput")
    prompts = write_prompts(tmp_path / "prompts.jsonl", [5, 9, 7])
    args = ["--target", str(tiny_llama_dir), "--dataset", str(prompts), "--prompts", "3", "--max-new-tokens", "4"]
    assert bench.main([*args, "--batch-sizes", "2", "--products", "stock,few_rows", "--threads", "1"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["runs"] == ["stock@2", "few_rows@2"] and len(doc["tok_s"]) == 2
    assert doc["same_as_first"][0] == 1.0 and doc["machine"]
    with pytest.raises(SystemExit, match="--products"):
        bench.main([*args, "--products", "fast"])


def test_kv_caches_side_by_side(tiny_llama_dir, tmp_path, capsys):
    """dflashkit's growing cache next to transformers' DynamicCache (as HF generate runs): the same responses."""
    bench = load_bench("regen_throughput")
    prompts = write_prompts(tmp_path / "prompts.jsonl", [5, 9, 7])
    args = ["--target", str(tiny_llama_dir), "--dataset", str(prompts), "--prompts", "3", "--max-new-tokens", "5"]
    assert bench.main([*args, "--batch-sizes", "2", "--kv-caches", "growing,dynamic", "--threads", "1"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["runs"] == ["auto@2", "auto+dynamic-kv@2"] and doc["same_as_first"] == [1.0, 1.0]
    with pytest.raises(SystemExit, match="--kv-caches"):
        bench.main([*args, "--kv-caches", "static"])


def test_responses_come_back_in_input_order(tiny_llama_dir):
    from dflashkit.data.regenerate import generate_batch
    from dflashkit.target.model import Target

    bench = load_bench("regen_throughput")
    target = Target.load(tiny_llama_dir)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15]]
    _, out = bench.run_batches(target, prompts, 2, 4)
    assert out == [generate_batch(target, [q], max_new_tokens=4)[0][0] for q in prompts]


def test_bad_batch_sizes_are_refused():
    with pytest.raises(SystemExit, match="--batch-sizes"):
        load_bench("regen_throughput").main(["--batch-sizes", "0,4"])


@pytest.mark.llamacpp
def test_server_runs_next_to_the_engine_ceiling(capsys):
    """Opt-in (`pytest -m llamacpp`): the embedded SmolLM2 through llama-server at 1 and 2 slots, in one stream and in
    chunks, and llama.cpp's own batched decoding of the same F32 GGUF at the same slot counts."""
    from dflashkit.export import llamacpp

    if not llamacpp.built():
        pytest.skip("llama.cpp not built (scripts/build_llamacpp.sh)")
    bench = load_bench("regen_throughput")
    args = ["--prompts", "2", "--max-new-tokens", "8", "--batch-sizes", "2", "--server-slots", "1,2"]
    assert bench.main([*args, "--server-chunk", "1", "--engine-ceiling"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    doc = json.loads(out[-1])
    assert doc["runs"] == ["auto@2", "server-f32@1", "server-f32@2", "server-f32:c1@1", "server-f32:c1@2"]
    assert len(doc["tok_s"]) == 5 and all(t > 0 for t in doc["tok_s"])
    assert set(doc["engine_ceiling_tok_s"]["f32"]) == {"1", "2"} and all(
        r > 0 for r in doc["engine_ceiling_tok_s"]["f32"].values()
    )
    assert any(line.split()[:2] == ["f32", "2"] for line in out[:-1])  # the ceiling's table row
