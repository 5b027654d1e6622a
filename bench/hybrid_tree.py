"""DDTree on a hybrid (Gated DeltaNet + attention) target: what exact tree verification costs against the spine
verifier, and the τ it gains. Side by side in one run (design §4: timings are ratios).

    .venv/bin/python bench/hybrid_tree.py                               # tiny random Qwen3.5 layer mix, CPU
    .venv/bin/python bench/hybrid_tree.py --budgets 1,4,8,16,32 --prompts 6 --max-new-tokens 64 --threads 1
    .venv/bin/python bench/hybrid_tree.py --target DIR --drafter DIR    # a real hybrid target and drafter

On the same prompts and drafter, greedy, every method once per prompt (order rotated from prompt to prompt, one
warm-up run each first):
  spine       chain verification of the drafter's top-1 block (`method="chain"`): the exact verifier without a
              tree, so no tree gain. Its commit restores the recurrent states and re-runs the accepted tokens.
  levels:B    DDTree-B, one target pass; Gated DeltaNet recurrence stepped depth by depth (batch = a depth's
              nodes, each from its parent's state); every node's state kept for the commit
  scan:B      DDTree-B, one target pass; Gated DeltaNet recurrence as one call over all root-to-leaf paths
              (batch = paths); the accepted path replayed from the committed state at commit (the default)
  paths:B     DDTree-B, the whole target on root-to-leaf paths as batch rows, then a commit pass
Per method: verify ms per round (tree build + verify + commit stages: everything verification costs), its ratio
to the spine's, τ (macro), and verify ms per committed token relative to the spine (< 1: the tree pays for
itself in verification alone). Without --drafter the drafter is a noisy oracle: at each slot it proposes the
target's own greedy token with probability --oracle-p, else a random one with the true token ranked second.
Every output is checked against AR decoding. For the trees measured here (mean nodes N, root-to-leaf paths R,
depth D + 1), it also prints the recurrent state a Qwen3.6-27B-size target would move per round: "scan" copies
the committed state R times per layer (+ 1 replay), "levels" moves 2N states per layer and keeps N until commit.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from dflashkit.decode import generate as decode_mod
from dflashkit.decode.generate import DecodeSettings, generate
from dflashkit.drafter.config import DrafterConfig
from dflashkit.drafter.model import DFlashDrafter
from dflashkit.target.model import LINEAR_ATTENTION, Target

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import positive_ints

# Qwen3.6-27B / Qwen3.5-27B text geometry (config.json): 64 layers, 3 of every 4 Gated DeltaNet.
GEOMETRY_27B = {
    "gdn_layers": 48,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "state_bytes": 4,
}


def tiny_hybrid(hidden: int, layers: int, vocab: int, seed: int = 0) -> Target:
    """A random Qwen3.5 text model (3 Gated DeltaNet layers per attention layer), weights scaled for real margins."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    torch.manual_seed(seed)
    heads = max(2, hidden // 32)
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        layer_types=[LINEAR_ATTENTION if i % 4 != 3 else "full_attention" for i in range(layers)],
        linear_num_value_heads=heads,
        linear_num_key_heads=max(1, heads // 2),
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.25 if "embed" in name or "lm_head" in name else 0.6 / hidden**0.5)
    return Target(model, source=f"random Qwen3.5 hybrid (hidden {hidden}, {layers} layers, vocab {vocab})")


class NoisyOracle(DFlashDrafter):
    """A drafter network whose logits are a noisy oracle of `reference` (prompt + the target's greedy tokens): at
    each slot the true token with probability p, else a random wrong one with the true token second. The noise
    depends on (position, slot) only, so every method sees the same proposals."""

    def __init__(self, cfg: DrafterConfig, p: float, seed: int = 0) -> None:
        super().__init__(cfg)
        self.p, self.seed = p, seed
        self.reference: list[int] = []

    def forward(self, *args: Any, block_positions: torch.Tensor, **kw: Any) -> torch.Tensor:
        self._positions = block_positions[0].tolist()
        return super().forward(*args, block_positions=block_positions, **kw)

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        vocab, rows = lm_head_weight.shape[0], []
        for k in range(hidden.shape[0]):
            pos = self._positions[k + 1]
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + pos * 97 + k)
            row = torch.randn(vocab, generator=g)
            true = self.reference[pos] if pos < len(self.reference) else int(torch.randint(vocab, (1,), generator=g))
            wrong = (true + 1 + int(torch.randint(vocab - 1, (1,), generator=g))) % vocab
            good = torch.rand(1, generator=g).item() < self.p
            row[true if good else wrong], row[wrong if good else true] = 20.0, 15.0
            rows.append(row)
        return torch.stack(rows).to(hidden.device)


def state_mib_per_node(target: Target) -> float:
    """MiB of recurrent state (all Gated DeltaNet layers, fp32) one tree node holds until commit."""
    cfg = target.text_config
    n = sum(1 for t in target.layer_types if t == LINEAR_ATTENTION)
    return n * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4 / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--target", default=None, help="hybrid model directory (default: a tiny random Qwen3.5 mix)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: a noisy oracle)")
    p.add_argument("--hidden", type=int, default=128, help="tiny target: hidden size")
    p.add_argument("--layers", type=int, default=8, help="tiny target: decoder layers")
    p.add_argument("--vocab", type=int, default=512, help="tiny target: vocabulary")
    p.add_argument("--oracle-p", type=float, default=0.6)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budgets", default="1,4,8,16,32")
    p.add_argument("--modes", default="levels,scan,paths")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    budgets = positive_ints(args.budgets, "--budgets", "1,4,16")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or not set(modes) <= {"levels", "scan", "paths"}:
        raise SystemExit(f"error: --modes {args.modes!r}: expected a comma-separated subset of levels,scan,paths")
    torch.set_num_threads(args.threads)
    target = (
        Target.load(args.target, device=args.device)
        if args.target
        else tiny_hybrid(args.hidden, args.layers, args.vocab)
    )
    if not target.is_hybrid:
        raise SystemExit(f"error: {target.source} has no Gated DeltaNet layers: this bench is for hybrid targets")
    if args.drafter:
        from dflashkit.drafter.checkpoint import load_drafter

        drafter = load_drafter(args.drafter, device=args.device).eval()
    else:
        L = target.num_layers
        cfg = DrafterConfig(
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
            num_target_layers=L,
            target_layer_ids=sorted({1, L // 2, L - 2}),
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=64,
            block_size=args.block_size,
            mask_token_id=3,
        )
        drafter = NoisyOracle(cfg, args.oracle_p).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(4, target.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)
    ]
    runs = [("spine", "chain", "auto", 0)] + [(f"{m}:{b}", "tree", m, b) for m in modes for b in budgets]

    def run(name: str, prompt: list[int], n: int):
        _, method, mode, budget = next(r for r in runs if r[0] == name)
        return generate(
            target,
            prompt,
            drafter=drafter,
            settings=DecodeSettings(
                method=method, max_new_tokens=n, block_size=args.block_size, tree_budget=budget or 1, hybrid_tree=mode
            ),
        )

    names = [r[0] for r in runs]
    stats: dict[str, dict[str, list[float]]] = {n: {"verify_s": [], "rounds": [], "tau": []} for n in names}
    shapes: dict[int, list[tuple[int, int, int]]] = {b: [] for b in budgets}  # (N, R, D + 1) of every tree
    real_build = decode_mod.build_tree

    def spy_build(*a: Any, **kw: Any):
        tree = real_build(*a, **kw)
        leaves = tree.size - len(set(tree.parents.tolist()) - {-1})
        shapes[kw["budget"]].append((tree.size, leaves, int(tree.depths.max()) + 1))
        return tree

    equal = True
    for i, prompt in enumerate(prompts):
        ref = generate(target, prompt, settings=DecodeSettings(method="ar", max_new_tokens=args.max_new_tokens)).tokens
        NoisyOracle.reference = prompt + ref
        if i == 0:
            for name in names:  # warm-up
                run(name, prompt, min(16, args.max_new_tokens))
        for name in names[i % len(names) :] + names[: i % len(names)]:
            decode_mod.build_tree = spy_build if name.startswith(modes[0] + ":") else real_build
            try:
                res = run(name, prompt, args.max_new_tokens)
            finally:
                decode_mod.build_tree = real_build
            equal &= res.tokens == ref
            t = res.timings
            stats[name]["verify_s"].append(t["tree_build"] + t["verify"] + t["commit"])
            stats[name]["rounds"].append(res.rounds)
            stats[name]["tau"].append(res.tau)
    summary = {}
    for name in names:
        s = stats[name]
        summary[name] = {
            "verify_ms": 1e3 * sum(s["verify_s"]) / max(1, sum(s["rounds"])),
            "tau": statistics.mean(s["tau"]),
        }
    spine = summary["spine"]
    for name in names:
        r = summary[name]
        r["verify_ratio"] = r["verify_ms"] / spine["verify_ms"]
        r["per_token_ratio"] = (r["verify_ms"] / r["tau"]) / (spine["verify_ms"] / spine["tau"])
    mean_shape = {b: [statistics.mean(x[j] for x in shapes[b]) for j in range(3)] for b in budgets if shapes[b]}
    per_node = state_mib_per_node(target)
    g27 = GEOMETRY_27B
    layer_27b = (
        g27["linear_num_value_heads"]
        * g27["linear_key_head_dim"]
        * g27["linear_value_head_dim"]
        * g27["state_bytes"]
        / 2**20
    )  # MiB per layer per row
    gpu = {}
    for b, (n, r, d) in mean_shape.items():  # GiB of recurrent state moved per round on a 27B-size target
        gpu[b] = {
            "N": round(n, 1),
            "R": round(r, 1),
            "D+1": round(d, 1),
            "scan_gib": round((r + 1) * g27["gdn_layers"] * layer_27b / 1024, 2),
            "levels_gib": round(2 * n * g27["gdn_layers"] * layer_27b / 1024, 2),
            "levels_resident_gib": round(n * g27["gdn_layers"] * layer_27b / 1024, 2),
        }

    print(
        f"target {target.source} ({target.architecture}), block size {args.block_size}, "
        f"{args.prompts} prompts × {args.max_new_tokens} tokens, {torch.get_num_threads()} threads, drafter "
        f"{args.drafter or f'noisy oracle p={args.oracle_p}'}; one node's recurrent state: {per_node:.3f} MiB"
    )
    print(
        f"{'method':<11} {'verify ms/round':>16} {'× spine':>8} {'τ':>6} {'τ / τ spine':>12} {'ms/token × spine':>17}"
    )
    for name in names:
        r = summary[name]
        print(
            f"{name:<11} {r['verify_ms']:>16.2f} {r['verify_ratio']:>8.2f} {r['tau']:>6.2f} "
            f"{r['tau'] / spine['tau']:>12.2f} {r['per_token_ratio']:>17.2f}"
        )
    print(f"greedy output equal to AR on every prompt and method: {equal}")
    print(
        f"27B-size target ({g27['gdn_layers']} Gated DeltaNet layers, state {g27['linear_num_value_heads']} × "
        f"{g27['linear_key_head_dim']} × {g27['linear_value_head_dim']} fp32 = {layer_27b:.0f} MiB per layer and "
        f"row), recurrent state moved per round, for the trees measured here (mean N nodes, R paths, D + 1 depth):"
    )
    print(f"{'budget':>6} {'N':>6} {'R':>6} {'D+1':>5} {'scan GiB':>9} {'levels GiB':>11} {'levels kept GiB':>16}")
    for b, e in gpu.items():
        print(
            f"{b:>6} {e['N']:>6} {e['R']:>6} {e['D+1']:>5} {e['scan_gib']:>9.2f} {e['levels_gib']:>11.2f} "
            f"{e['levels_resident_gib']:>16.2f}"
        )

    def col(mode: str, key: str) -> list[float]:
        return [round(summary[f"{mode}:{b}"][key], 4) for b in budgets]

    print(
        json.dumps(
            {
                "target": target.source,
                "block_size": args.block_size,
                "budgets": budgets,
                "n_prompts": args.prompts,
                "max_new_tokens": args.max_new_tokens,
                "threads": torch.get_num_threads(),
                "greedy_equal": equal,
                "spine": {k: round(v, 4) for k, v in spine.items()},
                **{
                    mode: {
                        "verify_ms": col(mode, "verify_ms"),
                        "verify_ratio": col(mode, "verify_ratio"),
                        "tau": col(mode, "tau"),
                        "per_token_ratio": col(mode, "per_token_ratio"),
                    }
                    for mode in modes
                },
                "state_mib_per_node": round(per_node, 4),
                "gpu_27b_state_per_round": gpu,
            }
        )
    )
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
