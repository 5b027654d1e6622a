"""Mutation check: seeds known faults, one at a time, into a throw-away copy of the package and shows that the tests
meant to guard each one fail.

    .venv/bin/python tests/mutation_check.py                       # every fault (a few minutes on 2 cores)
    .venv/bin/python tests/mutation_check.py --list                # the fault table, nothing run
    .venv/bin/python tests/mutation_check.py --only tree-heap-order,loss-tv-factor
    .venv/bin/python tests/mutation_check.py --repo /path/to/checkout

The copy holds the repository's tracked files at HEAD (`git archive HEAD`, so uncommitted edits are not tested) in a
temporary directory removed at exit; `--workers` copies (default: the cores, at most 4) try faults side by side, one
fault a copy at a time (a fault's run is mostly pytest's single-threaded start-up). pytest runs there with the copy
first on PYTHONPATH, so the copy's `dflashkit` is the one imported (checked before anything runs). First the union of
every selected fault's tests runs on the unmutated copy and must pass; then, per fault, its `old` snippet is replaced by
`new`, its tests run (`-x`: the first failure suffices) and the file is restored. A fault is caught when pytest reports
a failure (or the run outlives its timeout, as a hang would fail CI); it is missed when its tests pass. Exit status: 0
when every fault is caught, 1 when one is missed or the baseline fails, 2 when the fault table is stale (an `old`
snippet no longer occurs exactly once in the function named, or a named test no longer exists) — a table that silently
stopped matching the code proves nothing.

Add a fault: append a `Fault` to FAULTS — a one-line change a careless engineer could make, the function that holds
it, the narrowest existing tests that must catch it (`tests/…/test_x.py::test_name`, every parametrisation runs) and
why they do. This file is not collected by pytest (its name does not match `test_*.py`); tests/test_mutation_check.py
checks the table.
"""

from __future__ import annotations

import argparse
import ast
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Fault:
    """One seeded fault: in `file`, the snippet `old` (which must occur exactly once, inside `within`) becomes `new`."""

    id: str
    file: str  # repository-relative path
    within: str  # the innermost function or class that holds `old` ("<module>": none), so a snippet that moved is seen
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids (file or file::function) that must fail under the fault
    why: str  # what the fault breaks, in one line


FAULTS: tuple[Fault, ...] = (
    # ------------------------------------------------------------------------------------------------ losses
    Fault(
        "loss-decay-sign",
        "dflashkit/train/losses.py",
        "decay_weights",
        "w = torch.exp(-(k - 1) / g)",
        "w = torch.exp((k - 1) / g)",
        ("tests/train/test_losses.py::test_decay_weights_values",),
        "position weights grow with the slot instead of decaying",
    ),
    Fault(
        "loss-kl-direction",
        "dflashkit/train/losses.py",
        "_kl",
        "torch.where(p > 0, p * (logp - logq), 0.0).sum(-1)",
        "torch.where(q > 0, q * (logq - logp), 0.0).sum(-1)",
        ("tests/train/test_losses.py::test_chunked_loss_and_grads_equal_unchunked",),
        "KL(q ‖ p) instead of KL(p_target ‖ q_draft)",
    ),
    Fault(
        "loss-topk-renormalise",
        "dflashkit/train/losses.py",
        "sparse_topk_target",
        "probs = torch.where(total > 0, e / total.clamp_min(torch.finfo(lp.dtype).tiny), 0.0)",
        "probs = torch.where(total > 0, lp.exp(), 0.0)",
        ("tests/train/test_topk_loss.py::test_sparse_topk_loss_equals_python_loop",),
        "the stored top-k probabilities are used as they are, not renormalised over the kept entries",
    ),
    Fault(
        "loss-tv-factor",
        "dflashkit/train/losses.py",
        "_tv",
        "return 1.0 - overlap, -d_overlap",
        "return 2.0 * (1.0 - overlap), -d_overlap",
        ("tests/train/test_acceptance_losses.py::test_tv_is_half_the_l1_distance_and_zero_at_the_target",),
        "TV loses its ½: ‖p − q‖₁ instead of 1 − α",
    ),
    Fault(
        "loss-lk-tv-term",
        "dflashkit/train/losses.py",
        "_lk",
        "tv = 1.0 - overlap",
        "tv = 2.0 * (1.0 - overlap)",
        ("tests/train/test_acceptance_losses.py::test_acceptance_losses_and_gradients_equal_a_float64_reference",),
        "the LK losses' TV term loses its ½ (its gradient, written apart, keeps it)",
    ),
    Fault(
        "loss-ignore-index",
        "dflashkit/train/losses.py",
        "block_loss",
        "valid = (flat_lab != -100).view(n, bs)",
        "valid = (flat_lab != -1).view(n, bs)",
        ("tests/train/test_losses.py::test_chunked_loss_and_grads_equal_unchunked",),
        "the wrong ignore sentinel: slots labelled −100 count as supervised",
    ),
    Fault(
        "loss-dpace-alpha",
        "dflashkit/train/losses.py",
        "dpace_weights",
        "q_tilde = torch.where(valid, (1 - alpha) * q + alpha, 1.0)",
        "q_tilde = torch.where(valid, alpha * q + (1 - alpha), 1.0)",
        ("tests/train/test_dpace.py::test_weights_equal_the_closed_form_loop",),
        "D-PACE's α weighs the drafter's confidence instead of flooring it (same at α = ½ only)",
    ),
    Fault(
        "loss-dpace-tail",
        "dflashkit/train/losses.py",
        "dpace_weights",
        "tail = torch.flip(torch.cumsum(torch.flip(m * c, [-1]), dim=-1), [-1])",
        "tail = torch.cumsum(m * c, dim=-1)",
        ("tests/train/test_dpace.py::test_weights_equal_the_closed_form_loop",),
        "D-PACE sums the slots before j instead of those from j on",
    ),
    # ------------------------------------------------------------------------------- labels and target shifts
    Fault(
        "blocks-label-shift",
        "dflashkit/train/blocks.py",
        "build_blocks",
        "idx = ac[:, :, None] + k  # (B, Nb, bs)",
        "idx = ac[:, :, None] + k + 1  # (B, Nb, bs)",
        ("tests/train/test_blocks.py::test_labels_and_positions",),
        "slot k is labelled with the token at anchor + k + 1 (the shift applied twice)",
    ),
    Fault(
        "topk-target-shift",
        "dflashkit/train/slot_targets.py",
        "topk_targets",
        "s_ids[:, 1:] = torch.where(same, ids[:, :-1], -1)",
        "s_ids[:, :-1] = torch.where(same, ids[:, 1:], -1)",
        ("tests/train/test_topk_loss.py::test_slot_k_reads_the_topk_at_a_plus_k_minus_1_of_its_own_document",),
        "slot k reads the stored top-k of index a + k + 1 instead of a + k − 1",
    ),
    Fault(
        "kl-target-shift",
        "dflashkit/train/slot_targets.py",
        "kl_target_logits",
        "+ torch.arange(bs, device=run.device) - 1).clamp(0, t - 1)",
        "+ torch.arange(bs, device=run.device)).clamp(0, t - 1)",
        (
            "tests/train/test_topk_loss.py::test_slot_k_reads_the_targets_logits_at_a_plus_k_minus_1_of_its_own_document",
        ),
        "kind=kl: slot k is taught the target's distribution at a + k (the next token's) instead of a + k − 1",
    ),
    # ------------------------------------------------------------------------------------------------- masks
    Fault(
        "mask-anchor-visible",
        "dflashkit/train/blocks.py",
        "_visible",
        "& (k_pos < q_anchor)",
        "& (k_pos <= q_anchor)",
        ("tests/train/test_blocks.py::test_dense_and_flex_match_reference",),
        "a block sees the context key at its own anchor position (training leaks what inference cannot see)",
    ),
    Fault(
        "mask-causal-direction",
        "dflashkit/train/blocks.py",
        "_visible",
        "own = own & (k_slot <= q_slot)",
        "own = own & (k_slot >= q_slot)",
        ("tests/train/test_blocks.py::test_dense_and_flex_match_reference",),
        "causal layers see the later slots of their block instead of the earlier ones",
    ),
    Fault(
        "mask-other-document",
        "dflashkit/train/blocks.py",
        "_visible",
        "(q_doc >= 0) & (k_doc == q_doc) &",
        "(q_doc >= 0) &",
        ("tests/train/test_blocks.py::test_dense_and_flex_match_reference",),
        "packed rows: a block sees the context of the other documents in its row",
    ),
    Fault(
        "mask-inference-self",
        "dflashkit/drafter/model.py",
        "positional_mask",
        "visible &= diff >= 0",
        "visible &= diff > 0",
        ("tests/train/test_blocks.py::test_training_mask_forward_equals_per_block_inference",),
        "at inference a causal slot no longer sees itself (training's mask still lets it)",
    ),
    Fault(
        "block-anchor-slot",
        "dflashkit/drafter/model.py",
        "block_embeddings",
        "out[:, :, 0] = first",
        "out[:, :, -1] = first",
        ("tests/drafter/test_model.py",),
        "the clean anchor token is embedded in the block's last slot instead of slot 0",
    ),
    # ---------------------------------------------------------------------------------------------- decoding
    Fault(
        "decode-keep-off-by-one",
        "dflashkit/decode/generate.py",
        "_verify_chain",
        "keep = accepted + 1",
        "keep = accepted",
        ("tests/decode/test_generate.py::test_greedy_is_lossless",),
        "the target cache keeps the accepted drafts but not the bonus token they follow",
    ),
    Fault(
        "decode-accepted-prefix",
        "dflashkit/decode/generate.py",
        "_greedy_accept_lazy",
        "accepted = int((drafts.to(rest.device) == posterior[:-1]).long().cumprod(0).sum())",
        "accepted = int((drafts.to(rest.device) == posterior[:-1]).long().sum())",
        ("tests/decode/test_generate.py::test_greedy_is_lossless",),
        "greedy chain counts every matching draft, not the longest matching prefix",
    ),
    Fault(
        "decode-bonus-token",
        "dflashkit/decode/generate.py",
        "_greedy_accept_lazy",
        "return accepted, int(posterior[accepted])",
        "return accepted, int(posterior[-1])",
        ("tests/decode/test_generate.py::test_greedy_is_lossless",),
        "the bonus token is the target's token after the whole block, not after the accepted prefix",
    ),
    Fault(
        "sampling-accepted-prefix",
        "dflashkit/sampling.py",
        "accept_argmax_drafts",
        "accepted = int(matches.cumprod(0).sum())",
        "accepted = int(matches.sum())",
        ("tests/test_sampling.py::test_argmax_drafts_keep_the_longest_matching_prefix",),
        "T > 0 with argmax drafts: every match counts, not the longest matching prefix",
    ),
    Fault(
        "tree-heap-order",
        "dflashkit/decode/tree.py",
        "push",
        "heapq.heappush(heap, (-(log_probs[parent] + vals[rank]), counter, d, rank, parent))",
        "heapq.heappush(heap, (log_probs[parent] + vals[rank], counter, d, rank, parent))",
        ("tests/decode/test_tree.py::test_build_tree_matches_brute_force_top_prefixes",),
        "DDTree pops the least probable prefix first",
    ),
    Fault(
        "tree-child-parent",
        "dflashkit/decode/tree.py",
        "build_tree",
        "push(d + 1, 0, node)",
        "push(d + 1, 0, parent)",
        ("tests/decode/test_tree.py::test_build_tree_matches_brute_force_top_prefixes",),
        "DDTree hangs a node's first child on the node's parent",
    ),
    Fault(
        "tree-follow-unverified",
        "dflashkit/decode/tree.py",
        "follow_tree",
        "nxt = next((c for c in table[cur] if node_tokens[c] == want), None)",
        "nxt = next((c for c in table[cur]), None)",
        ("tests/decode/test_tree.py::test_follow_tree_hand_built",),
        "tree verification walks to the first child whatever the target's token",
    ),
    Fault(
        "tree-mask-transposed",
        "dflashkit/decode/tree.py",
        "tree_attention_bias",
        "allowed[:, start:] = tree_attention_mask(parents)",
        "allowed[:, start:] = tree_attention_mask(parents).t()",
        ("tests/decode/test_tree.py::test_tree_attention_bias_sees_the_cache_and_ancestors_only",),
        "tree nodes attend to their descendants instead of their ancestors",
    ),
    # ------------------------------------------------------------------------------------------------ export
    Fault(
        "gguf-tensor-name",
        "dflashkit/export/gguf_export.py",
        "<module>",
        '"self_attn.k_proj.weight": "attn_k.weight",',
        '"self_attn.k_proj.weight": "attn_key.weight",',
        ("tests/export/test_gguf_export.py::test_real_row_drafter_matches_the_loader",),
        "a tensor name llama.cpp's dflash loader does not know",
    ),
    Fault(
        "gguf-transposed-weight",
        "dflashkit/export/gguf_export.py",
        "_weight_array",
        "arr = t.detach().to(torch.float32).cpu().numpy()",
        "arr = t.detach().to(torch.float32).cpu().numpy().T",
        ("tests/export/test_gguf_export.py::test_real_row_drafter_matches_the_loader",),
        "weights written transposed (torch (out, in) already is GGUF's ne {in, out})",
    ),
    Fault(
        "gguf-target-layers",
        "dflashkit/export/gguf_export.py",
        "gguf_target_layers",
        "return [int(i) + 1 for i in cfg.target_layer_ids]",
        "return [int(i) for i in cfg.target_layer_ids]",
        ("tests/export/test_gguf_export.py::test_real_row_drafter_matches_the_loader",),
        "dflash.target_layers names layer outputs, llama.cpp reads layer inputs (id + 1)",
    ),
    Fault(
        "vllm-d2t-offsets",
        "dflashkit/export/serving.py",
        "serving_tensors",
        'out["d2t"] = absolute - torch.arange(absolute.shape[0], dtype=torch.long)',
        'out["d2t"] = absolute',
        ("tests/export/test_serving.py::test_reduced_vocabulary_exports_what_vllm_loads_and_round_trips_exactly",),
        "vLLM's d2t holds offsets (target = draft + d2t), not absolute target ids",
    ),
    Fault(
        "vllm-config-key",
        "dflashkit/export/serving.py",
        "serving_config",
        'config["draft_vocab_size"] = cfg.draft_vocab_size',
        'config["dflash_config"]["draft_vocab_size"] = cfg.draft_vocab_size',
        ("tests/export/test_serving.py::test_reduced_vocabulary_exports_what_vllm_loads_and_round_trips_exactly",),
        "vLLM reads draft_vocab_size only at the top level of config.json",
    ),
    Fault(
        "speculators-layer-ids",
        "dflashkit/export/speculators_format.py",
        "config_to_speculators",
        "SPECULATORS_LAYER_IDS: [i + 1 for i in cfg.target_layer_ids],",
        "SPECULATORS_LAYER_IDS: list(cfg.target_layer_ids),",
        ("tests/export/test_convert.py::test_zlab_speculators_zlab_round_trip_is_exact",),
        "speculators' aux_hidden_state_layer_ids are hidden_states indices (z-lab id + 1)",
    ),
    # -------------------------------------------------------------------------------------------- validation
    Fault(
        "validation-block-size",
        "dflashkit/validation.py",
        "<module>",
        "int, Field(ge=2, le=1024)",
        "int, Field(ge=1, le=1024)",
        ("tests/test_validation.py::test_types_accept_their_domain_and_nothing_else",),
        "a block size of 1 (an anchor and no draft slot) is accepted",
    ),
    Fault(
        "validation-port",
        "dflashkit/validation.py",
        "<module>",
        "Port = Annotated[int, Field(ge=1, le=65535)",
        "Port = Annotated[int, Field(ge=0, le=65535)",
        ("tests/test_validation.py::test_types_accept_their_domain_and_nothing_else",),
        "port 0 is accepted",
    ),
    Fault(
        "validation-url-port",
        "dflashkit/validation.py",
        "_server_url",
        "if port is not None and not 1 <= port <= 65535:",
        "if port is not None and not 0 <= port <= 65535:",
        ("tests/test_validation.py::test_types_accept_their_domain_and_nothing_else",),
        "a server URL with port 0 is accepted",
    ),
    Fault(
        "validation-blank-text",
        "dflashkit/validation.py",
        "<module>",
        'Text = Annotated[str, Field(min_length=1, pattern=r"\\S")',
        "Text = Annotated[str, Field(min_length=1)",
        ("tests/test_validation.py::test_types_accept_their_domain_and_nothing_else",),
        "a string of spaces passes as non-empty text",
    ),
    Fault(
        "config-mask-token-bound",
        "dflashkit/drafter/config.py",
        "validate",
        "if not self.mask_token_id < self.vocab_size:",
        "if not self.mask_token_id <= self.vocab_size:",
        ("tests/drafter/test_model.py::test_bad_config_fields",),
        "mask_token_id = vocab_size (one past the embedding table) is accepted",
    ),
    # ----------------------------------------------------------------------------------------------- capture
    Fault(
        "capture-layer-off-by-one",
        "dflashkit/target/model.py",
        "_hooks",
        "handles.append(self.layers[idx].register_forward_hook(hook))",
        "handles.append(self.layers[idx - 1].register_forward_hook(hook))",
        ("tests/target/test_model.py::test_features_equal_output_hidden_states",),
        "feature i is the output of decoder layer i − 1 (HF hidden_states[i], not [i + 1])",
    ),
)

# pytest's exit codes: 1 tests failed, 2 interrupted (a collection error counts: the fault broke an import).
CAUGHT_CODES = (1, 2)
# Each run gets this many times the baseline's duration (the union of every selected fault's tests, so at least as
# long as any one fault's), and never less than MIN_TIMEOUT: a fault that hangs a test is caught by the timeout.
TIMEOUT_FACTOR = 4
MIN_TIMEOUT = 120.0


def problems(faults: tuple[Fault, ...], root: Path) -> list[str]:
    """Why the fault table does not match the files under `root` (empty when it does): every `old` occurs exactly
    once in its file, inside the function `within` names, and differs from `new`; every id is unique; every named test
    file and function exists. (A snippet can stay unique yet move to code its tests do not reach — a copy of a line
    in another function after a refactor — hence `within`.)"""
    out: list[str] = []
    seen: set[str] = set()
    for f in faults:
        if f.id in seen:
            out.append(f"{f.id}: the id is used twice")
        seen.add(f.id)
        path = root / f.file
        if not path.is_file():
            out.append(f"{f.id}: {f.file} does not exist")
            continue
        text = path.read_text(encoding="utf-8")
        count = text.count(f.old)
        if count != 1:
            out.append(f"{f.id}: `{f.old}` occurs {count} times in {f.file}, expected exactly once")
        elif (holder := enclosing(text, line_of(text, f.old))) != f.within:
            out.append(f"{f.id}: `{f.old}` is in {holder} of {f.file}, expected in {f.within}")
        if f.old == f.new:
            out.append(f"{f.id}: `new` equals `old`")
        if not f.tests:
            out.append(f"{f.id}: no test named")
        for node in f.tests:
            problem = _node_problem(root, node)
            if problem:
                out.append(f"{f.id}: {problem}")
    return out


def enclosing(text: str, line: int) -> str:
    """The innermost function or class of the Python source `text` that spans `line` ("<module>": none does)."""
    best, span = "<module>", None
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            end = node.end_lineno or node.lineno
            if node.lineno <= line <= end and (span is None or end - node.lineno < span):
                best, span = node.name, end - node.lineno
    return best


def _node_problem(root: Path, node: str) -> str | None:
    """Why the pytest node id `file` or `file::function` names nothing under `root` (None when it exists)."""
    file, _, name = node.partition("::")
    path = root / file
    if not (path.is_file() and path.name.startswith("test_") and path.suffix == ".py"):
        return f"{file} is not a test file"
    if not name:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"))
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    return None if name in defined else f"{file} defines no {name}"


def select(faults: tuple[Fault, ...], only: str | None) -> tuple[Fault, ...]:
    """The faults named by `--only ID[,ID]` (all when None); an unknown id is a SystemExit."""
    if not only:
        return faults
    wanted = [x.strip() for x in only.split(",") if x.strip()]
    known = {f.id for f in faults}
    unknown = [x for x in wanted if x not in known]
    if unknown:
        raise SystemExit(f"mutation_check: unknown fault id(s) {', '.join(unknown)} (see --list)")
    return tuple(f for f in faults if f.id in wanted)


def line_of(text: str, snippet: str) -> int:
    """1-based line where `snippet` starts in `text`."""
    return text[: text.index(snippet)].count("\n") + 1


def copy_head(repo: Path, dest: Path) -> None:
    """The tracked files of `repo` at HEAD, extracted into `dest` (no .git, no ignored build outputs)."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def copy_env(copy: Path) -> dict[str, str]:
    """The environment for runs in `copy`: its package first on the path, and no bytecode written — a mutated file
    can keep its size and modification second, and a stale .pyc would then run the unmutated code."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(copy), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_copy(copy: Path, env: dict[str, str]) -> str:
    """The file `dflashkit` is imported from in `copy`'s environment; SystemExit unless it is the copy's (an
    editable install of the checkout must not win over the copy)."""
    code = "import dflashkit, dflashkit.validation as v; print(dflashkit.__file__); print(v.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True, check=True)
    files = out.stdout.split()
    if not all(Path(f).resolve().is_relative_to(copy.resolve()) for f in files):
        raise SystemExit(f"mutation_check: the copy imports dflashkit from {files}, not from {copy}")
    return files[0]


@dataclass
class Run:
    """One pytest run: its exit code (None: timed out), seconds, and the first failing node it reported."""

    code: int | None
    seconds: float
    failed: str
    tail: str


def run_tests(copy: Path, env: dict[str, str], tests: list[str], timeout: float) -> Run:
    """pytest -x over `tests` in `copy`, serially, within `timeout` seconds."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Run(None, time.monotonic() - start, f"(timed out after {timeout:.0f} s)", "")
    text = out.stdout + out.stderr
    first = re.search(r"^(?:FAILED|ERROR) (.+?)(?: - |$)", text, re.MULTILINE)  # pytest's -ra summary line
    return Run(out.returncode, time.monotonic() - start, first.group(1) if first else "", text[-3000:])


def print_list(faults: tuple[Fault, ...], root: Path) -> None:
    for f in faults:
        text = (root / f.file).read_text(encoding="utf-8")
        where = f"{f.file}:{line_of(text, f.old)}" if text.count(f.old) == 1 else f"{f.file}:?"
        print(f"{f.id:26s} {where:42s} {f.why}")
        print(f"{'':26s} - {f.old}\n{'':26s} + {f.new}")
        for node in f.tests:
            print(f"{'':26s}   {node}")


def mutate_all(copies: list[Path], faults: tuple[Fault, ...], timeout: float) -> list[tuple[Fault, Run]]:
    """Apply each fault alone in one of `copies` (one fault a copy at a time: the copies run side by side, each
    fault's pytest mostly single-threaded start-up), run its tests, restore the file; print one table row per fault
    as it finishes. Results come back in the faults' order."""
    print(f"{'fault':26s} {'where':42s} {'result':7s} {'s':>6s}  caught by")
    free: queue.Queue[Path] = queue.Queue()
    for c in copies:
        free.put(c)
    printing = threading.Lock()

    def one(f: Fault) -> Run:
        copy = free.get()
        try:
            path = copy / f.file
            original = path.read_text(encoding="utf-8")
            where = f"{f.file}:{line_of(original, f.old)}"
            path.write_text(original.replace(f.old, f.new, 1), encoding="utf-8")
            try:
                run = run_tests(copy, copy_env(copy), list(f.tests), timeout)
            finally:
                path.write_text(original, encoding="utf-8")
        finally:
            free.put(copy)
        verdict = "caught" if run.code is None or run.code in CAUGHT_CODES else "MISSED" if run.code == 0 else "ERROR"
        by = run.failed or ("" if verdict == "MISSED" else f"pytest exit {run.code}")
        with printing:
            print(f"{f.id:26s} {where:42s} {verdict:7s} {run.seconds:6.1f}  {by}", flush=True)
            if verdict == "ERROR":
                print(run.tail)
        return run

    with ThreadPoolExecutor(max_workers=len(copies)) as pool:
        return list(zip(faults, pool.map(one, faults), strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent, help="the checkout")
    parser.add_argument("--only", help="comma-separated fault ids (default: all)")
    parser.add_argument("--list", action="store_true", help="print the fault table and exit")
    parser.add_argument(
        "--workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="faults tried side by side (default: cores, ≤ 4)",
    )
    args = parser.parse_args(argv)
    faults = select(FAULTS, args.only)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dflashkit-mutation-") as tmp:
        copies = [Path(tmp) / f"copy{i}" for i in range(max(1, args.workers))]  # one a worker: one fault each at a time
        copy = copies[0]
        copy.mkdir()
        copy_head(args.repo, copy)
        if args.list:
            print_list(faults, copy)
            return 0
        stale = problems(faults, copy)
        if stale:
            for line in stale:
                print(f"mutation_check: stale fault table: {line}", file=sys.stderr)
            return 2
        env = copy_env(copy)
        print(f"copy of {args.repo} at HEAD: {copy} (dflashkit imported from {check_imports_copy(copy, env)})")
        union = list(dict.fromkeys(node for f in faults for node in f.tests))
        base = run_tests(copy, env, union, timeout=3600)
        print(f"baseline: {len(union)} test nodes on the unmutated copy, exit {base.code}, {base.seconds:.1f} s")
        if base.code != 0:
            print(base.tail)
            print("mutation_check: the tests fail on the unmutated copy; nothing to prove", file=sys.stderr)
            return 1
        timeout = max(MIN_TIMEOUT, TIMEOUT_FACTOR * base.seconds)
        print(f"per-fault timeout {timeout:.0f} s\n")
        for other in copies[1:]:
            other.mkdir()
            copy_head(args.repo, other)
        results = mutate_all(copies, faults, timeout)
    missed = [f.id for f, r in results if r.code == 0]
    errors = [f.id for f, r in results if r.code is not None and r.code not in (0, *CAUGHT_CODES)]
    caught = len(results) - len(missed) - len(errors)
    print(
        f"\n{caught}/{len(results)} faults caught, {len(missed)} missed{': ' + ', '.join(missed) if missed else ''}, "
        f"{len(errors)} errors{': ' + ', '.join(errors) if errors else ''}; {time.monotonic() - started:.0f} s in all"
    )
    return 0 if not missed and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
