"""Target wrapper: hook-captured features equal output_hidden_states[i + 1]; verifier logits equal the model's."""

from __future__ import annotations

import pytest
import torch

from dflashkit.cpu_products import stock_products
from dflashkit.errors import TargetError
from dflashkit.target.model import Target, find_text_model
from helpers.choices import set_choice


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5"])
def test_features_equal_output_hidden_states(tiny_target_dirs, kind):
    target = Target.load(tiny_target_dirs[kind])
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with stock_products():  # a one-off pass's products (Target.forward without a cache), not a settled width
        ref = target.model(input_ids=ids, output_hidden_states=True)
    h = target.hidden_size
    for layer in range(target.num_layers - 1):  # every layer id, one at a time
        out = target.forward(ids, layer_ids=[layer])
        torch.testing.assert_close(out.features, ref.hidden_states[layer + 1], rtol=0, atol=0)
    # HF's last hidden state is after the final norm; the captured last-layer feature is before it
    last = target.forward(ids, layer_ids=[target.num_layers - 1])
    torch.testing.assert_close(target.final_norm(last.features), ref.hidden_states[-1], rtol=1e-6, atol=1e-6)
    ids_k = [5, 0, 3, 6]  # any order, not sorted
    out = target.forward(ids, layer_ids=ids_k)
    assert out.features.shape == (2, 11, len(ids_k) * h)
    for j, layer in enumerate(ids_k):  # concatenation order follows layer_ids
        torch.testing.assert_close(out.features[..., j * h : (j + 1) * h], ref.hidden_states[layer + 1], rtol=0, atol=0)
    # verifier logits come from the *final* layer's pre-norm state through norm + LM head
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target.verifier_logits(out.final_hidden), ref.logits, rtol=1e-5, atol=1e-5)
    # output_hidden_states[-1] is already normed: the pre-norm state differs from it
    assert not torch.allclose(out.final_hidden, ref.hidden_states[-1])


@pytest.mark.parametrize("way", ["few_rows", "onednn"])
def test_forced_products_hold_in_passes_without_a_cache(tiny_target_dirs, monkeypatch, way):
    """products=<way> in DFLASHKIT_CHOICES forces every routed product, a pass without a cache (capture, checks)
    included: its features are exactly the model's own hidden states under the same forced way (under auto such a
    pass takes stock products, so a short sample is never timed as a decoding width)."""
    from dflashkit.cpu_products import products

    if way not in products.CANDIDATES:
        pytest.skip(f"this torch build has no {way}")
    calls = [0]
    inner = products.CANDIDATES[way]

    def counted(x, w, b):
        calls[0] += 1
        return inner(x, w, b)

    monkeypatch.setitem(products.CANDIDATES, way, counted)
    set_choice(monkeypatch, "products", way)
    target = Target.load(tiny_target_dirs["llama"])
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    ref = target.model(input_ids=ids, output_hidden_states=True)
    before = calls[0]
    layers = list(range(target.num_layers - 1))
    out = target.forward(ids, layer_ids=layers, logits=True)
    assert calls[0] > before  # the forced way ran in the pass without a cache
    h = target.hidden_size
    for j, layer in enumerate(layers):
        assert torch.equal(out.features[..., j * h : (j + 1) * h], ref.hidden_states[layer + 1])
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)  # as the stock test: another head path


def test_vl_wrapper_layout(tiny_target_dirs):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    vl = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_target_dirs["qwen3_5_vl"]).eval()
    target = Target(vl)
    assert find_text_model(vl) is vl.model.language_model
    assert target.is_hybrid and target.num_layers == 8
    ids = torch.randint(3, 97, (1, 9))
    ref = vl(input_ids=ids, output_hidden_states=True)
    out = target.forward(ids, layer_ids=[1, 6])
    # not bit-exact as for Llama: two runs of the hybrid's linear-attention layers may split their work across
    # threads differently on a busy machine (5e-7 seen); a wrong layer would differ by O(1)
    torch.testing.assert_close(out.features[..., :64], ref.hidden_states[2], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    # and loading the checkpoint directory gives the same text model
    loaded = Target.load(tiny_target_dirs["qwen3_5_vl"])
    torch.testing.assert_close(loaded.forward(ids).logits, ref.logits, rtol=1e-5, atol=1e-5)


def test_features_move_to_drafter_device_and_dtype(tiny_llama_dir):
    target = Target.load(tiny_llama_dir)
    out = target.forward(torch.tensor([[5, 6, 7]]), layer_ids=[1], feature_device="cpu", feature_dtype=torch.float16)
    assert out.features.dtype == torch.float16 and out.features.device.type == "cpu"


def test_bad_target_inputs(tmp_path, tiny_llama_dir):
    with pytest.raises(TargetError, match="does not exist"):
        Target.load(tmp_path / "nope")
    with pytest.raises(TargetError, match=r"no config.json"):
        Target.load(tmp_path)
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(TargetError, match=r"not a .gguf"):
        Target.load(tmp_path / "weights.bin")
    target = Target.load(tiny_llama_dir)
    with pytest.raises(TargetError, match=r"out of range.*8 decoder layers"):
        target.forward(torch.tensor([[3]]), layer_ids=[8])
    with pytest.raises(TargetError, match="duplicates"):
        target.forward(torch.tensor([[3]]), layer_ids=[1, 1])
