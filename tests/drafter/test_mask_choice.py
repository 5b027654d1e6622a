"""The mask row for targets without a spare row: SmolLM2's never-used special token, and the data check."""

from __future__ import annotations

from typing import ClassVar

import pytest

from dflashkit.drafter.mask_choice import special_candidates, unused_special_token

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from dflashkit.target.default import ensure_default_target

    return AutoTokenizer.from_pretrained(ensure_default_target(verbose=False))


def test_smollm2_mask_row_is_empty_output(smollm2_tokenizer):
    tok = smollm2_tokenizer
    cands = special_candidates(tok)
    assert {0, 1, 2}.isdisjoint(cands)  # <|endoftext|>, <|im_start|>, <|im_end|>: in use
    idx, why = unused_special_token(tok)
    assert (idx, tok.convert_ids_to_tokens(idx)) == (16, "<empty_output>") and "special token" in why
    # chat formatting of ordinary text never produces it
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi <filename> x"}], tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert 16 not in ids


def test_data_that_uses_the_token_moves_the_choice(smollm2_tokenizer):
    idx, why = unused_special_token(smollm2_tokenizer, token_lists=[[5, 16, 200], [15]])
    assert idx == 14 and "nowhere in the training data" in why


def test_no_special_tokens_means_none():
    class Plain:
        added_tokens_decoder: ClassVar[dict] = {}

    assert unused_special_token(Plain()) is None
