"""Products of one input computed as one (sibling_products.py): siblings found by watching a pass, weights stacked
without a second copy, every member's output equal to its own F.linear within float32 rounding, never a stale or
shared slice; a fusing pass group times the fused product as one more candidate in its real steps."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.cpu_products import products
from dflashkit.cpu_products.products import CANDIDATES, FUSED, Chooser, route_linears
from dflashkit.cpu_products.siblings import FusedSet, sibling_product
from helpers.choices import set_choice

pytestmark = pytest.mark.skipif("onednn" not in CANDIDATES, reason="this torch build has no oneDNN")


class Layer(nn.Module):
    """A decoder layer's shape of products: q/k/v read one input, o another; gate/up one input, down another."""

    def __init__(self, h: int = 32, kv: int = 8, inner: int = 48, bias: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(h, h, bias=bias), nn.Linear(h, kv, bias=bias), nn.Linear(h, kv, bias=bias)
        self.o = nn.Linear(h, h, bias=False)
        self.gate, self.up, self.down = nn.Linear(h, inner), nn.Linear(h, inner), nn.Linear(inner, h)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        a = self.o(q * (k.sum(-1, keepdim=True) + v.mean(-1, keepdim=True)))
        return self.down(F.silu(self.gate(a)) * self.up(a)) + a


def _reference(layer: Layer, x):
    lin = {
        n: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
        for n, m in layer.named_children()
    }
    q, k, v = (F.linear(x, *lin[n]) for n in "qkv")
    a = F.linear(q * (k.sum(-1, keepdim=True) + v.mean(-1, keepdim=True)), *lin["o"])
    return F.linear(F.silu(F.linear(a, *lin["gate"])) * F.linear(a, *lin["up"]), *lin["down"]) + a


def _fused_layers(n=2, **kw):
    torch.manual_seed(0)
    net = nn.Sequential(*(Layer(**kw) for _ in range(n))).requires_grad_(False)
    route_linears(net, fuse=True)
    return net


def test_siblings_are_found_by_watching_a_pass_and_fused_without_a_copy(monkeypatch):
    set_choice(monkeypatch, "products", FUSED)
    net = _fused_layers()
    before = {n: p.clone() for n, p in net.named_parameters()}
    x = torch.randn(3, 32)
    ref = _reference(net[1], _reference(net[0], x))
    siblings = net[0].q._pass_group.siblings
    with torch.no_grad():
        first = net(x)  # watched
        assert not siblings.sets and not siblings.done
        second = net(x)  # the pass opens again: fused before it runs
    assert [[m.out_features for m in s.members] for s in siblings.sets] == [[32, 8, 8], [48, 48]] * 2
    assert [s.members for s in siblings.sets[:2]] == [[net[0].q, net[0].k, net[0].v], [net[0].gate, net[0].up]]
    for layer in net:  # views of one buffer, in member order; o and down (inputs of their own) untouched
        assert layer.k.weight.data_ptr() == layer.q.weight.data_ptr() + 32 * 32 * 4
        assert layer.up.bias.data_ptr() == layer.gate.bias.data_ptr() + 48 * 4
        assert getattr(layer.o.weight, "_dflashkit_sibling", None) is None
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())  # values unchanged
    bound = 1e-5 * (1 + ref.abs())
    assert ((first - ref).abs() <= bound).all() and ((second - ref).abs() <= bound).all()
    assert not second.requires_grad


def test_a_slice_is_never_stale_nor_shared():
    torch.manual_seed(1)
    q, k = nn.Linear(16, 8).requires_grad_(False), nn.Linear(16, 4).requires_grad_(False)
    s = FusedSet([q, k])
    x = torch.randn(2, 16)
    onednn = CANDIDATES["onednn"]
    out_q = sibling_product(onednn, x, q.weight, q.bias)
    out_k = sibling_product(onednn, x, k.weight, k.bias)
    torch.testing.assert_close(out_k, F.linear(x, k.weight, k.bias))
    assert out_q.is_contiguous() and out_k.is_contiguous() and out_q.data_ptr() != out_k.data_ptr()
    again = sibling_product(onednn, x, k.weight, k.bias)  # the same member twice: its own product, not the slice
    assert again.data_ptr() != out_k.data_ptr()
    sibling_product(onednn, x, q.weight, q.bias)
    x.mul_(2)  # the input changed in place after the set's product: k computes its own
    torch.testing.assert_close(sibling_product(onednn, x, k.weight, k.bias), F.linear(x, k.weight, k.bias))
    other, widths = torch.randn(5, 16), []

    def spy(a, w, b):
        widths.append(w.shape[0])
        return onednn(a, w, b)

    with torch.inference_mode():  # no version counter there: a slice is served only as the very next product
        xi = torch.randn(2, 16)
        sibling_product(spy, xi, q.weight, q.bias), sibling_product(spy, xi, k.weight, k.bias)
        assert widths == [12]  # q and k in one product, k's slice served
        sibling_product(spy, xi, q.weight, q.bias), sibling_product(spy, xi, other, None)
        out = sibling_product(spy, xi, k.weight, k.bias)  # another product came between: k computes its own
        assert widths == [12, 12, 5, 4]
        torch.testing.assert_close(out, F.linear(xi, k.weight, k.bias))
    y = torch.randn(2, 16)  # another input: k alone
    torch.testing.assert_close(sibling_product(onednn, y, k.weight, k.bias), F.linear(y, k.weight, k.bias))
    k.weight.data = k.weight.data.clone() * 3  # replaced data (a move to another device does this): each alone
    assert not s.intact()
    torch.testing.assert_close(sibling_product(onednn, x, q.weight, q.bias), F.linear(x, q.weight, q.bias))
    torch.testing.assert_close(sibling_product(onednn, x, k.weight, k.bias), F.linear(x, k.weight, k.bias))


def test_what_is_never_fused(monkeypatch):
    set_choice(monkeypatch, "products", FUSED)
    trained = nn.Sequential(Layer())  # weights that require grad (a drafter in training): never views
    route_linears(trained, fuse=True)
    drafter = nn.Sequential(Layer()).requires_grad_(False)
    route_linears(drafter)  # fuse=False (the drafter: saved with safetensors, which refuses shared storage)
    mixed = Layer().requires_grad_(False)
    mixed.k = nn.Linear(32, 8, bias=True).requires_grad_(False)  # biased or not within q/k/v: left alone
    mixed.q = nn.Linear(32, 32, bias=False).requires_grad_(False)
    mixed.v = nn.Linear(32, 8, bias=True).requires_grad_(False)
    route_linears(mixed, fuse=True)
    x = torch.randn(2, 32)
    with torch.no_grad():
        for _ in range(2):
            trained(x), drafter(x), mixed(x)
    assert trained[0].q._pass_group.siblings.sets == [] and drafter[0].q._pass_group.siblings is None
    assert [[m.out_features for m in s.members] for s in mixed.q._pass_group.siblings.sets] == [[48, 48]]


def test_a_fusing_group_times_the_fused_product_in_its_steps(monkeypatch, tmp_path):
    """The fused product is one more candidate, timed in whole steps like the others; with every product call
    costing the same here, a step of fewer calls wins. A group that may fuse but found no siblings records it as
    unusable (so its stored choice is complete and never re-timed); a stored choice timed before the candidate
    joined is timed again."""
    net = _fused_layers(n=1)
    now, calls = [0.0], []

    def clocked(name, fn):
        def run(x, w, b=None):
            now[0] += 1.0
            calls.append(name)
            return fn(x, w, b)

        return run

    fake = Chooser(timer=lambda n, fn: fn() or 1.0, store=tmp_path / "c.json", repeats=3, clock=lambda: now[0])
    monkeypatch.setattr(products, "chooser", lambda: fake)
    set_choice(monkeypatch, "products", "auto")
    x = torch.randn(2, 32)
    ref = _reference(net[0], x)
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        for name in CANDIDATES:
            mp.setitem(CANDIDATES, name, clocked(name, CANDIDATES[name]))
        mp.setattr(products.F, "linear", clocked("stock", F.linear))
        mp.setattr(products, "_onednn", clocked(FUSED, products._onednn))
        for _ in range(2 + 3 * (len(CANDIDATES) + 1)):
            torch.testing.assert_close(net(x), ref, rtol=1e-5, atol=1e-5)
    key = f"2x{net[0].q._pass_group.signature}:float32"
    assert key.endswith("-fuse:float32")
    entry = fake.choices[key]
    assert entry["choice"] == FUSED and entry["timed"] == "steps"
    assert entry[f"{FUSED}_ms"] == 4000.0 and entry["stock_ms"] == 7000.0  # 4 products a step instead of 7
    reloaded = Chooser(store=tmp_path / "c.json")
    reloaded._load()
    assert reloaded.choices[key]["choice"] == FUSED
    stale = {k: v for k, v in entry.items() if not k.startswith(FUSED)}
    (tmp_path / "c.json").write_text(json.dumps({"choices": {key: stale}}))
    older = Chooser(store=tmp_path / "c.json")
    older._load()
    assert key not in older.choices  # timed before the fused candidate joined: timed again

    lonely = nn.Sequential(nn.Linear(8, 24), nn.SiLU(), nn.Linear(24, 8)).requires_grad_(False)
    route_linears(lonely, fuse=True)  # may fuse, but no two products read one input
    fake2 = Chooser(timer=lambda n, fn: 1.0, store=None, repeats=1, clock=iter(range(1000)).__next__)
    monkeypatch.setattr(products, "chooser", lambda: fake2)
    with torch.no_grad():
        for _ in range(2 + len(CANDIDATES)):
            lonely(torch.randn(2, 8))
    got = fake2.choices[f"2x{lonely[0]._pass_group.signature}:float32"]
    assert got[f"{FUSED}_ms"] is None and got["choice"] in CANDIDATES


def test_a_target_decodes_the_same_with_its_products_fused(tiny_llama_dir, monkeypatch):
    """The tiny Llama target: its q/k/v and gate/up found and fused in every layer, and greedy decoding through the
    fused products equals HF `generate` with stock products token for token."""
    from dflashkit.target.model import Target

    set_choice(monkeypatch, "products", FUSED)
    set_choice(monkeypatch, "store", "off")
    target = Target.load(tiny_llama_dir)
    ids = torch.randint(3, target.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with products.stock_products():
            ref = target.model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
        got = target.model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    siblings = target.layers[0].self_attn.q_proj._pass_group.siblings
    assert len(siblings.sets) == 2 * len(target.layers)
    assert torch.equal(got, ref)
