"""How far a drafter reads back: warnings when the context it drafts after is longer than its sliding window or its
longest training context, in `eval`/`simulate` notes and `doctor --context`."""

from __future__ import annotations

from dflashkit.diagnose.doctor import context_findings
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.context_reach import context_warnings, trained_context
from dflashkit.evaluate.stats import context_notes


def _cfg(layer_types=None, window=None, trained=None) -> DrafterConfig:
    extra = {} if trained is None else {"train_context": trained}
    return DrafterConfig(
        hidden_size=64, vocab_size=97, num_target_layers=8, target_layer_ids=[1, 4], num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=32, block_size=4,
        layer_types=layer_types or [], sliding_window=window, extra=extra,
    )  # fmt: skip


def test_no_warning_within_the_window_and_the_training_rows():
    assert context_warnings(_cfg(trained=4096), 4000) == []
    assert context_warnings(_cfg(), 100_000) == []  # nothing recorded: nothing known to warn about
    assert trained_context(_cfg(trained=True)) is None  # a damaged record is not a length


def test_a_longer_context_than_the_training_rows_warns():
    (w,) = context_warnings(_cfg(trained=1024), 6000)
    assert "exceed the longest training context (1024 tokens)" in w and "long-context" in w
    (w,) = context_warnings(_cfg(["sliding_attention", "sliding_attention"], window=512, trained=1024), 6000)
    assert "sliding window of 512" in w  # every layer windowed: the training rows do not limit it
    ws = context_warnings(_cfg(["sliding_attention", "full_attention"], window=512, trained=1024), 6000)
    assert len(ws) == 2


def test_doctor_and_eval_notes_say_the_same():
    cfg = _cfg(trained=1024)
    findings = context_findings(cfg, 6000)
    assert [f.status for f in findings] == ["WARN"] and findings[0].check == "context"
    assert "within the longest training context (1024)" in context_findings(cfg, 900)[0].what
    unknown = context_findings(_cfg(), 900)[0]  # nothing recorded: unknown, not OK
    assert unknown.status == "WARN" and "not recorded" in unknown.what
    drafter = type("D", (), {"config": cfg})()
    assert context_notes({"a": drafter}, 6000) == [f"drafter 'a': {findings[0].what}"]
