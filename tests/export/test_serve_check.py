"""serve-check without an engine: dflashkit's side of the count (the engines' convention, against a slow count from
`generate`'s own rounds), the comparison (first differing prompt, token or draft position, and the likely causes),
finding the vLLM environment, and a clear one-line error when it is missing. The engine runs are opt-in
(tests/export/test_vllm_engine.py, `pytest -m vllm`)."""

from __future__ import annotations

import pytest
import torch

from dflashkit.cli import main
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.drafter.heads import HEADS
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.export import serve_check as sc
from dflashkit.export.serve_check import EngineComparison, PromptCounts, ServeCheckReport, compare, dflashkit_counts
from helpers.checkpoints import small_config, write_checkpoint


def _drafter(seed=0, block_size=4):
    torch.manual_seed(seed)
    d = DFlashDrafter(small_config(block_size=block_size))
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0.0, 0.5)  # large random weights: drafts vary, some are accepted on the tiny target
    return d.eval()


@pytest.mark.parametrize("max_new", [1, 5, 17, 24])
def test_dflashkit_side_counts_rounds_that_start_before_the_end_untruncated(target, max_new):
    d = _drafter()
    prompt = [5, 9, 2, 41, 7, 7, 3, 11]
    got = dflashkit_counts(target, d, prompt, max_new)
    full = generate(target, prompt, drafter=d, settings=DecodeSettings(method="chain", max_new_tokens=max_new))
    assert got.tokens == full.tokens  # the output is the same whatever the count convention
    # slow reference: replay the long run's rounds; a round starting at committed length c < max_new counts whole
    longer = generate(target, prompt, drafter=d, settings=DecodeSettings(method="chain", max_new_tokens=max_new + 4))
    committed, drafts, per_pos = 1, 0, [0, 0, 0]
    for length in longer.acceptance_lengths:
        if committed >= max_new:
            break
        drafts += 1
        for j in range(length - 1):
            per_pos[j] += 1
        committed += length
    assert (got.drafts, got.accepted_per_pos, got.accepted) == (drafts, per_pos, sum(per_pos))


def test_the_counting_convention_on_known_rounds(monkeypatch):
    """max_new_tokens 10, block 4, rounds of the longer decode committing 4, 1, 2, 4, 3: the rounds starting at
    committed lengths 1, 5, 6, 8 (< 10) count whole — the last one's 3 accepted drafts too — the fifth not."""
    from dflashkit.decode import generate as gen_module
    from dflashkit.decode.generate import GenerationResult

    def fake(target, prompt, *, drafter, settings):
        assert settings.method == "chain" and settings.max_new_tokens == 10 + 4  # a block past the end
        return GenerationResult(len(prompt), list(range(100, 100 + 14)), [4, 1, 2, 4, 3])

    monkeypatch.setattr(gen_module, "generate", fake)
    got = dflashkit_counts(None, _drafter(), [1, 2], 10)
    assert got.tokens == list(range(100, 110)) and got.drafts == 4
    assert got.accepted_per_pos == [3, 2, 2] and got.accepted == 7


def test_compare_names_the_first_difference_and_its_likely_causes():
    a = [PromptCounts([1, 2, 3], 2, 1, [1, 0, 0]), PromptCounts([4, 5, 6, 7], 3, 1, [1, 0, 0])]
    assert (
        compare(a, [PromptCounts(list(c.tokens), c.drafts, c.accepted, list(c.accepted_per_pos)) for c in a], 4) == []
    )
    tokens = compare(a, [a[0], PromptCounts([4, 5, 9, 7], 3, 1, [1, 0, 0])], 4)
    assert tokens[0].startswith("prompt 1: token 2 differs (dflashkit 6, engine 9)") and "chat template" in tokens[1]
    accept = compare(a, [PromptCounts([1, 2, 3], 2, 2, [1, 1, 0]), a[1]], 4)
    assert "prompt 0: same tokens, different acceptance first at draft position 1" in accept[0]
    assert "mask_embedding.pt" in accept[1] and "d2t" in accept[1] and "target_layer_ids" in accept[1]
    rounds = compare(a, [PromptCounts([1, 2, 3], 3, 1, [1]), a[1]], 4)  # an engine that reports fewer positions
    assert "in the number of rounds" in rounds[0]
    shorter = compare(a, [PromptCounts([1, 2], 2, 1, [1, 0, 0]), a[1]], 4)
    assert shorter[0].startswith("prompt 0: token 2 differs (dflashkit 3, engine None)")
    # a drafter with a sliding window: at a prompt longer than the window, the window comes first among the causes
    windowed = compare(a, [PromptCounts([1, 2, 3], 2, 2, [1, 1, 0]), a[1]], 4, window=1024, prompt_tokens=[4000, 9])
    assert windowed[1].startswith("likely: the drafter's sliding-window layers (window 1024) at a prompt of 4000")
    assert windowed[2].startswith("else: the engine runs another drafter")
    within = compare(a, [PromptCounts([1, 2, 3], 2, 2, [1, 1, 0]), a[1]], 4, window=1024, prompt_tokens=[800, 9])
    assert within == accept  # a prompt inside the window: the window cannot be the reason


def test_report_renders_both_sides_and_json():
    ours = [PromptCounts([1, 2], 4, 3, [2, 1, 0])]
    rep = ServeCheckReport("d", "t", 1, 2, 4, [EngineComparison("vllm", "0.32.0", ours, ours, [])])
    text = rep.render()
    assert (
        "dflashkit   identical" in text and "vllm 0.32.0 identical" in text and "agrees with dflashkit exactly" in text
    )
    assert "[2, 1, 0]" in text and "1.750" in text  # τ = (accepted + drafts) / drafts
    d = rep.as_dict()
    assert d["agrees"] and d["engines"][0]["summary"]["vllm"]["tau"] == 1.75


def test_vllm_environment_is_found_or_named(tmp_path, monkeypatch):
    fake = tmp_path / "python"
    fake.write_text("")
    monkeypatch.setenv(sc.VLLM_PYTHON_ENV, str(fake))
    assert sc.vllm_python() == fake
    monkeypatch.setenv(sc.VLLM_PYTHON_ENV, str(tmp_path / "missing"))
    assert sc.vllm_python() is None
    with pytest.raises(sc.EngineUnavailable, match="setup_vllm"):
        sc.run_vllm("t", "d", [[1, 2]], max_new_tokens=4, num_speculative_tokens=3)


def test_cli_without_the_engine_is_one_line(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setenv(sc.VLLM_PYTHON_ENV, str(tmp_path / "missing"))
    ckpt = write_checkpoint(tmp_path / "d", small_config())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt_ids": [5, 9, 2, 41]}\n')
    code = main(["serve-check", str(ckpt), "--target", str(tiny_llama_dir), "--dataset", str(prompts), "--quiet"])
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, (captured.out, err)
    assert "no vLLM environment" in err and "Traceback" not in err


def test_llamacpp_rounds_are_counted_on_both_sides_with_ties_named(monkeypatch):
    """Two llama.cpp rounds (block 4): drafts [7, 8, 9] with 2 accepted then last 5; drafts [1, 2, 3], none accepted,
    last 4. dflashkit's drafter drafts [7, 8, 6] (a clear difference at slot 2: not accepted anyway) and [2, 2, 3]
    where slot 0 is a near tie (margin 0.01 < TIE): counted as a tie, so both sides accept nothing there."""
    from dflashkit.export import llamacpp, llamacpp_check
    from dflashkit.export.llamacpp import Round, SpecRun

    run = SpecRun(text="", rounds=[Round([7, 8, 9], 2, 5), Round([1, 2, 3], 0, 4)])
    monkeypatch.setattr(llamacpp, "run_speculative", lambda *a, **k: run)
    monkeypatch.setattr(llamacpp_check, "prompt_text", lambda tok, ids: "text")
    refs = [([7, 8, 6], [1.0, 1.0, 1.0]), ([2, 2, 3], [0.01, 1.0, 1.0])]
    monkeypatch.setattr(llamacpp_check, "reference_drafts", lambda *a: refs)

    class Cfg:
        block_size = 4

    class Drafter:
        config = Cfg()
        head = HEADS["dflash"]

        def first_draft_slot(self) -> int:
            return 1

    class Target:
        tokenizer = None

    theirs, ours, ties = llamacpp_check.llamacpp_side(Target(), Drafter(), "d.gguf", "t.gguf", [1, 2], 6)
    assert theirs == {"tokens": [7, 8, 5, 4], "drafts": 2, "accepted_per_pos": [1, 1, 0]}
    assert ours == {"drafts": 2, "accepted_per_pos": [1, 1, 0]} and ties == 1
    refs[1] = ([1, 2, 3], [1.0, 1.0, 1.0])  # dflashkit drafts llama.cpp's [1, 2, 3]: still none accepted (truth 4)
    assert llamacpp_check.llamacpp_side(Target(), Drafter(), "d", "t", [1, 2], 6)[2] == 0


def test_llamacpp_prompt_must_survive_decode_and_encode():
    from dflashkit.errors import DFlashError
    from dflashkit.export.llamacpp_check import prompt_text

    class Tok:
        def decode(self, ids, skip_special_tokens):
            return " ".join(map(str, ids))

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [int(t) for t in text.split()][:2]}  # loses tokens: another prompt

    assert prompt_text(Tok(), [1, 2]) == "1 2"
    with pytest.raises(DFlashError, match="re-encode"):
        prompt_text(Tok(), [1, 2, 3])


def test_a_target_side_near_tie_is_named_not_counted(target, monkeypatch):
    """Outputs that part where the target's own top-2 logits are within TIE are float rounding (llama.cpp's F32
    kernels vs PyTorch), not the drafter; a clear difference is not a tie."""
    import dflashkit.export.llamacpp_check as lc

    prompt = [5, 9, 2, 41]
    greedy = generate(target, prompt, settings=DecodeSettings(method="ar", max_new_tokens=3)).tokens
    with torch.no_grad():
        logits = target.forward(torch.tensor([prompt]), logits=True).logits[0, -1]
    second = int(logits.topk(2).indices[1])
    margin = float(logits.topk(2).values[0] - logits.topk(2).values[1])
    theirs = [second, *greedy[1:]]
    monkeypatch.setattr(lc, "TIE", margin + 1e-3)
    assert sc.target_tie(target, prompt, greedy, theirs) == (0, pytest.approx(margin, abs=1e-5))
    monkeypatch.setattr(lc, "TIE", margin / 2)
    assert sc.target_tie(target, prompt, greedy, theirs) is None  # a clear difference
    assert sc.target_tie(target, prompt, greedy, list(greedy)) is None  # no difference
