"""A SHA-256 per drafter head and pipeline stage of what must not change when code is refactored: every head in the
registry through init-drafter → capture → train → eval → convert (each `--to` the CLI offers) on the embedded
default target, with the tiniest settings, a fixed seed and every choice dflashkit would measure at run time pinned.

    .venv/bin/python scripts/pipeline_fingerprint.py --out /tmp/fp.json              # this checkout
    .venv/bin/python scripts/pipeline_fingerprint.py --repo /tmp/old --out /tmp/old.json --heads dflash,dspark
    .venv/bin/python scripts/pipeline_fingerprint.py --compare /tmp/old.json /tmp/fp.json   # exit 1 where they differ

What is hashed, never the files as such (safetensors metadata, timestamps and temp paths do not count):
  target     the default target's de-quantised tensors (a fresh DFLASHKIT_CACHE: converted anew)
  prepare    tokens.jsonl, regenerated.jsonl and prepare.json without timings
  init       init-drafter's tensors and config.json
  capture    the features' tensors, shard by shard
  train      final/'s tensors and config.json; metrics.jsonl without timings (losses, accuracies, grad norms)
  eval       results.json and progress.jsonl without timings (τ, histograms, per-position acceptance, tokens)
  convert:F  every file written: tensors (safetensors, .pt, GGUF with its keys) and JSON; the model card is left out
A stage that does not apply (a format the head's export refuses) is recorded as skipped with the refusal; a stage
after a failed one as skipped with that reason. Timings are recorded beside the hashes and never compared.

Each head runs in its own process (PYTHONPATH=--repo, cwd there), its commands in process through dflashkit.cli.main,
with one thread and the run-time choices forced both through the per-choice variables older commits read
(DFLASHKIT_PRODUCTS=stock, …) and through DFLASHKIT_CHOICES (filtered to the names the checkout knows: unknown
names are refused there).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SEED = 0
THREADS = "1"
PREPARE = ["--data", "sharegpt", "--limit", "4", "--max-new-tokens", "16", "--seed", str(SEED)]
DRAFTER = {"num_hidden_layers": "1", "block_size": "4"}
# enough steps on 4 samples that chain acceptance on their own prompts is above zero (the eval hash then sees it)
TRAIN = ["max_steps=16", "lr=0.003", "max_tokens=256", "max_anchors=16", "tensorboard=false", "save_every=0"]
EVAL = ["--dataset", "sharegpt", "--limit", "2", "--max-new-tokens", "16", "--methods", "ar,chain,ddtree:4"]
CONVERT_FALLBACK = ("zlab", "vllm", "speculators", "deepspec", "gguf")
# the old per-choice variables (read by commits before DFLASHKIT_CHOICES; ignored after)
OLD_VARS = {
    "DFLASHKIT_PRODUCTS": "stock",
    "DFLASHKIT_NATIVE": "off",
    "DFLASHKIT_PRODUCTS_STORE": "off",
    "DFLASHKIT_TRAIN_PRECISION": "fp32",
    "DFLASHKIT_TRAIN_COMPILE": "off",
    "DFLASHKIT_CAPTURE_PRECISION": "fp32",
    "DFLASHKIT_CAPTURE_COMPILE": "off",
    "DFLASHKIT_DECODE_COMPILE": "off",
    "DFLASHKIT_REGENERATE_COMPILE": "off",
    "DFLASHKIT_ADAMW": "foreach",
}
# the same meaning as DFLASHKIT_CHOICES entries; the checkout's NAMES decide which are passed (adamw: an alias)
CHOICES = {
    "products": "stock",
    "native": "off",
    "store": "off",
    "train_precision": "fp32",
    "train_compile": "off",
    "capture_precision": "fp32",
    "capture_compile": "off",
    "decode_compile": "off",
    "regenerate_compile": "off",
    "optimizer": "foreach",
    "adamw": "foreach",
}
# keys of timing, machine or path fields in JSON outputs: never hashed
UNHASHED_KEYS = {"seconds", "minutes", "wall", "elapsed", "date", "time", "timestamp", "measured_at", "machine",
                 "source", "key", "efficiency"}  # fmt: skip
UNHASHED_SUFFIXES = ("_s", "_ms", "_seconds", "_minutes", "_at")


def unhashed(key: str) -> bool:
    """Whether a JSON field is a timing (or a machine, a path, a cache key): left out of every digest."""
    k = key.lower()
    return k in UNHASHED_KEYS or k.endswith(UNHASHED_SUFFIXES) or k.startswith("timings") or "speedup" in k


# ----------------------------------------------------------------------------------------------------- digests


def _sha(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(len(c).to_bytes(8, "little"))
        h.update(c)
    return h.hexdigest()


def clean(obj: Any, roots: list[str]) -> Any:
    """`obj` without timing fields, with the temp and repository paths in strings replaced by placeholders."""
    if isinstance(obj, dict):
        return {k: clean(v, roots) for k, v in obj.items() if not unhashed(str(k))}
    if isinstance(obj, list):
        return [clean(v, roots) for v in obj]
    if isinstance(obj, str):
        for i, root in enumerate(roots):
            obj = obj.replace(root, f"<root{i}>")
    return obj


def json_digest(obj: Any, roots: list[str]) -> str:
    return _sha(json.dumps(clean(obj, roots), sort_keys=True, ensure_ascii=True).encode())


def jsonl_digest(path: Path, roots: list[str]) -> str:
    return json_digest([json.loads(line) for line in path.read_text().splitlines() if line.strip()], roots)


def tensor_chunks(name: str, t: Any) -> list[bytes]:
    import torch

    t = t.detach().cpu().contiguous()
    data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return [name.encode(), str(t.dtype).encode(), repr(tuple(t.shape)).encode(), data]


def tensors_digest(tensors: dict[str, Any]) -> str:
    return _sha(*(c for k in sorted(tensors) for c in tensor_chunks(k, tensors[k])))


def safetensors_digest(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return _sha(*(c for k in sorted(f.keys()) for c in tensor_chunks(k, f.get_tensor(k))))


def gguf_digest(path: Path) -> str:
    """A GGUF's key-value fields and tensors (name, type, shape, bytes), in file order as llama.cpp reads them."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    chunks = []
    for name, field in reader.fields.items():
        try:
            value = field.contents()
        except Exception:  # older gguf readers: the raw parts
            value = [bytes(p.tobytes()).hex() for p in field.parts]
        chunks += [name.encode(), json.dumps(value, sort_keys=True, default=str).encode()]
    for t in reader.tensors:
        chunks += [t.name.encode(), str(t.tensor_type).encode(), repr(list(t.shape)).encode(), t.data.tobytes()]
    return _sha(*chunks)


def file_digest(path: Path, roots: list[str]) -> str | None:
    """A file's digest by its kind; None for files not hashed (model cards)."""
    import torch

    suffix = path.suffix.lower()
    if suffix == ".md":
        return None
    if suffix == ".safetensors":
        return safetensors_digest(path)
    if suffix == ".gguf":
        return gguf_digest(path)
    if suffix == ".json":
        return json_digest(json.loads(path.read_text()), roots)
    if suffix == ".jsonl":
        return jsonl_digest(path, roots)
    if suffix in (".pt", ".bin"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        return tensors_digest(obj if isinstance(obj, dict) else {"": obj})
    return _sha(path.read_bytes())


def shards(folder: Path) -> dict[str, str]:
    """{shard file: digest of its tensors} of a capture directory."""
    return {p.name: safetensors_digest(p) for p in sorted(folder.glob("*.safetensors"))}


def tree_digest(path: Path, roots: list[str]) -> dict[str, str]:
    """{relative file: digest} of a file or every file under a directory (model cards left out)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    out = {}
    for f in files:
        d = file_digest(f, roots)
        if d is not None:
            out[f.name if f == path else str(f.relative_to(path))] = d
    return out


def stage(parts: dict[str, str], seconds: float, **info: Any) -> dict[str, Any]:
    return {"sha256": _sha(*(c for k in sorted(parts) for c in (k.encode(), parts[k].encode()))), "parts": parts,
            "seconds": round(seconds, 1), **({"info": info} if info else {})}  # fmt: skip


# ------------------------------------------------------------------------------------------- worker (one process)


class Runner:
    """dflashkit commands in this process: exit code, seconds and the last line they printed to stderr."""

    def __init__(self, log: Path, roots: list[str]) -> None:
        self.log, self.roots = log, roots

    def cli(self, argv: list[str]) -> tuple[int, float, str]:
        from dflashkit.cli import main

        err = io.StringIO()
        t0 = time.monotonic()
        with open(self.log, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(err):
            print(f"$ dflashkit {' '.join(argv)}", flush=True)
            try:
                rc = main(argv)
            except SystemExit as e:  # a command that exits instead of returning
                rc = e.code if isinstance(e.code, int) else 1
        seconds = time.monotonic() - t0
        text = err.getvalue()
        with open(self.log, "a") as log:
            log.write(text)
        lines = [ln for ln in text.splitlines() if ln.strip() and "it/s]" not in ln]
        errors = [ln for ln in lines if ": error:" in ln or "internal error" in ln or "Error" in ln]
        return rc, seconds, clean(((errors or lines or [""])[-1]).strip()[:300], self.roots)


def pin_choices() -> dict[str, str]:
    """The DFLASHKIT_CHOICES entries the checkout parses (none where it has no such variable)."""
    try:
        from dflashkit.cpu_products.choice import overrides
    except ImportError:
        return {}
    return dict(overrides())


def convert_formats() -> list[str]:
    """The `--to` choices of the checkout's `convert` parser."""
    try:
        from dflashkit.cli import build_parser

        p = build_parser("convert").command_parsers["convert"]
        return list(next(a.choices for a in p._actions if "--to" in a.option_strings))
    except Exception:
        return list(CONVERT_FALLBACK)


def worker_shared(work: Path, roots: list[str]) -> dict[str, Any]:
    """The default target (converted into the fresh cache) and the prepared data every head trains on."""
    import torch

    from dflashkit.drafter.heads import HEADS
    from dflashkit.target.default import default_target_dir
    from dflashkit.target.model import Target

    run = Runner(work / "shared.log", roots)
    stages: dict[str, Any] = {}
    t0 = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        Target.load("default")
    model = default_target_dir()
    parts = {p.name: safetensors_digest(p) for p in sorted(model.glob("*.safetensors"))}
    parts["config.json"] = json_digest(json.loads((model / "config.json").read_text()), roots)
    stages["target"] = stage(parts, time.monotonic() - t0)
    data = work / "data"
    rc, s, last = run.cli(["prepare", "--out", str(data), "--compile", "off", *PREPARE])
    if rc != 0:
        stages["prepare"] = {"error": f"exit {rc}: {last}", "seconds": round(s, 1)}
    else:
        stages["prepare"] = stage(tree_digest(data, roots), s)
    return {"heads_registry": list(HEADS), "convert_formats": convert_formats(), "torch": torch.__version__,
            "stages": stages}  # fmt: skip


def worker_head(kind: str, work: Path, roots: list[str]) -> dict[str, Any]:
    """One head through init-drafter → capture → train → eval → convert, each stage's digest."""
    base = work / kind
    base.mkdir(parents=True, exist_ok=True)
    run = Runner(base / "log.txt", roots)
    tokens = work / "data" / "tokens.jsonl"
    stages: dict[str, Any] = {}
    t0 = time.monotonic()

    def step(name: str, argv: list[str], digest: Any) -> bool:
        rc, s, last = run.cli(argv)
        if rc == 0:
            stages[name] = digest(s)
        elif rc == 2:
            stages[name] = {"skipped": f"refused: {last}", "seconds": round(s, 1)}
        else:
            stages[name] = {"error": f"exit {rc}: {last}", "seconds": round(s, 1)}
        return rc == 0

    def skip_rest(names: list[str], why: str) -> None:
        for n in names:
            stages.setdefault(n, {"skipped": why})

    formats = convert_formats()
    later = ["capture", "train", "eval", *(f"convert:{f}" for f in formats)]
    if not tokens.is_file():
        skip_rest(["init", *later], "prepare failed")
        return {"stages": stages, "seconds": 0.0}
    init, feats, out, ev = base / "init", base / "capture", base / "train", base / "eval"
    drafter = [f"{k}={v}" for k, v in {"kind": kind, **DRAFTER}.items()]
    ok = step("init", ["init-drafter", str(init), "--seed", str(SEED), *drafter],
              lambda s: stage(tree_digest(init, roots), s))  # fmt: skip
    if not ok:
        skip_rest(later, "init-drafter failed")
        return {"stages": stages, "seconds": round(time.monotonic() - t0, 1)}
    capture = ["--tokens", str(tokens), "--out", str(feats), "--drafter-config", str(init), "--compile", "off"]
    ok = step("capture", ["capture", *capture, "--precision", "fp32", "--quiet"], lambda s: stage(shards(feats), s))
    if not ok:
        skip_rest(later, "capture failed")
        return {"stages": stages, "seconds": round(time.monotonic() - t0, 1)}

    def train_digest(s: float) -> dict[str, Any]:
        parts = {f"final/{k}": v for k, v in tree_digest(out / "final", roots).items()}
        parts["metrics.jsonl"] = jsonl_digest(out / "metrics.jsonl", roots)
        last = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()][-1]
        return stage(parts, s, last_loss=last.get("loss"), steps=last.get("step"))

    ok = step("train", ["train", "-", "--no-progress", f"features={feats}", f"out={out}", f"seed={SEED}",
              "dtype=fp32", "compile=off", "optimizer_impl=foreach", *TRAIN, *(f"drafter.{d}" for d in drafter)],
              train_digest)  # fmt: skip
    if not ok:
        skip_rest(later, "train failed")
        return {"stages": stages, "seconds": round(time.monotonic() - t0, 1)}

    def eval_digest(s: float) -> dict[str, Any]:
        results = json.loads((ev / "results.json").read_text())
        taus = {f"{d}/{m}": r.get("tau_micro") for d, ms in results.get("results", {}).items() for m, r in ms.items()}
        parts = {
            "results.json": json_digest(results, roots),
            "progress.jsonl": jsonl_digest(ev / "progress.jsonl", roots),
        }
        return stage(parts, s, tau_micro=taus)

    step("eval", ["eval", "--drafter", f"{kind}={out / 'final'}", "--out", str(ev), "--no-warmup", "--no-resume",
         "--compile", "off", "--quiet", "--seed", str(SEED), *EVAL], eval_digest)  # fmt: skip
    for fmt in formats:
        dest = base / f"convert-{fmt}"
        path = dest / f"{kind}.gguf" if fmt == "gguf" else dest
        dest.mkdir(parents=True, exist_ok=True)
        target = ["--target", "default"] if fmt != "zlab" else []
        step(f"convert:{fmt}", ["convert", str(out / "final"), str(path), "--to", fmt, *target],
             lambda s, d=dest: stage(tree_digest(d, roots), s))  # fmt: skip
    return {"stages": stages, "seconds": round(time.monotonic() - t0, 1)}


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(int(THREADS))
    torch.manual_seed(SEED)
    choices = pin_choices()
    work = Path(args.work)
    roots = [str(work), str(Path(args.repo).resolve())]
    import dflashkit

    if not Path(dflashkit.__file__).resolve().is_relative_to(Path(args.repo).resolve()):
        raise SystemExit(f"dflashkit imported from {dflashkit.__file__}, not from --repo {args.repo}")
    result = worker_shared(work, roots) if args.worker == "shared" else worker_head(args.worker, work, roots)
    result["choices"] = choices
    Path(args.result).write_text(json.dumps(result, indent=1) + "\n")
    return 0


# --------------------------------------------------------------------------------------------- parent (the run)


def choice_names(repo: Path) -> set[str] | None:
    """The entry names the checkout's DFLASHKIT_CHOICES accepts (`NAMES` in cpu_products/choice.py, read from the
    source: an unknown name is refused as the variable is parsed, which may be at import), None without that module."""
    import ast

    source = repo / "dflashkit" / "cpu_products" / "choice.py"
    if not source.is_file():
        return None
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NAMES" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return None


def pinned_env(repo: Path, work: Path) -> dict[str, str]:
    """The environment of every worker: the checkout first on the path, one thread, no GPU, a fresh cache, and every
    measured-at-run-time choice forced (both spellings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASHKIT_")}
    env.update(OLD_VARS)
    names = choice_names(repo)
    if names is not None:  # a checkout without the variable never reads it
        env["DFLASHKIT_CHOICES"] = ",".join(f"{k}={v}" for k, v in CHOICES.items() if k in names)
    env.update({
        "PYTHONPATH": str(repo), "DFLASHKIT_CACHE": str(work / "cache"), "OMP_NUM_THREADS": THREADS,
        "MKL_NUM_THREADS": THREADS, "OPENBLAS_NUM_THREADS": THREADS, "PYTHONHASHSEED": "0",
        "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1", "TQDM_DISABLE": "1",
    })  # fmt: skip
    env.pop("LLAMACPP_HOME", None)
    return env


def spawn(name: str, repo: Path, work: Path, env: dict[str, str]) -> dict[str, Any]:
    result = work / f"result-{name}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--work", str(work), "--repo", str(repo),
           "--result", str(result)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - t0
    if proc.returncode != 0 or not result.is_file():
        tail = (proc.stderr.strip().splitlines() or [""])[-1][:300]
        return {"error": f"worker exit {proc.returncode}: {tail}", "seconds": round(seconds, 1), "stages": {}}
    out = json.loads(result.read_text())
    out["seconds"] = round(seconds, 1)
    return out


def git_commit(repo: Path) -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True).stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "dflashkit"))}


def fingerprint(repo: Path, heads: list[str] | None, keep: Path | None) -> dict[str, Any]:
    work = keep or Path(tempfile.mkdtemp(prefix="dflashkit-fp-"))
    work.mkdir(parents=True, exist_ok=True)
    env = pinned_env(repo, work)
    t0 = time.monotonic()
    shared = spawn("shared", repo, work, env)
    print(f"shared: {shared.get('seconds')} s  {shared.get('error', '')}", file=sys.stderr, flush=True)
    registry = shared.get("heads_registry") or []
    chosen = heads or registry
    unknown = [h for h in chosen if h not in registry]
    result: dict[str, Any] = {
        "repo": str(repo), **git_commit(repo), "torch": shared.get("torch"), "seed": SEED, "threads": int(THREADS),
        "env": {k: env[k] for k in sorted(env) if k.startswith("DFLASHKIT_") and k != "DFLASHKIT_CACHE"},
        "choices_passed": shared.get("choices"), "heads_registry": registry,
        "convert_formats": shared.get("convert_formats"), "shared": shared.get("stages", {}), "heads": {},
    }  # fmt: skip
    if "error" in shared:
        result["shared_error"] = shared["error"]
    for kind in chosen:
        if kind in unknown:
            result["heads"][kind] = {"stages": {}, "error": f"not in the registry ({', '.join(registry)})"}
            continue
        r = spawn(kind, repo, work, env)
        result["heads"][kind] = {k: r[k] for k in ("seconds", "stages", "error") if k in r}
        done = sum("sha256" in s for s in r.get("stages", {}).values())
        print(f"{kind}: {r.get('seconds')} s, {done} stages hashed  {r.get('error', '')}", file=sys.stderr, flush=True)
    result["seconds"] = round(time.monotonic() - t0, 1)
    if keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


# -------------------------------------------------------------------------------------------------------- compare


def _outcome(st: dict[str, Any] | None) -> str:
    if st is None:
        return "absent"
    if "sha256" in st:
        return st["sha256"][:16]
    return f"skipped ({st['skipped']})" if "skipped" in st else f"error ({st.get('error')})"


def compare(a_path: Path, b_path: Path) -> int:
    """Print every (head, stage) whose outcome differs between two fingerprints, with the parts that differ."""
    a, b = json.loads(a_path.read_text()), json.loads(b_path.read_text())
    print(f"A: {a_path} ({a.get('commit', '?')[:12]}{' dirty' if a.get('dirty') else ''})")
    print(f"B: {b_path} ({b.get('commit', '?')[:12]}{' dirty' if b.get('dirty') else ''})")
    both = not (a.get("shared_error") or b.get("shared_error"))  # else the failure is named below
    shared = dict.fromkeys([*a.get("shared", {}), *b.get("shared", {})]) if both else {}
    rows = [("(shared)", n, a.get("shared", {}).get(n), b.get("shared", {}).get(n)) for n in shared]
    for side, x, y in (("A", a, b), ("B", b, a)):
        if x.get("shared_error"):
            print(f"  {side}: shared stages failed: {x['shared_error']}")
        only = [k for k in x.get("heads", {}) if k not in y.get("heads", {})]
        if only:
            print(f"  not compared: {', '.join(only)} (only in {side})")
    for kind in [k for k in a.get("heads", {}) if k in b.get("heads", {})]:
        sa = a.get("heads", {}).get(kind, {}).get("stages", {})
        sb = b.get("heads", {}).get(kind, {}).get("stages", {})
        rows += [(kind, n, sa.get(n), sb.get(n)) for n in dict.fromkeys([*sa, *sb])]
    differ = 0
    for kind, name, x, y in rows:
        ox, oy = _outcome(x), _outcome(y)
        if ox == oy:
            print(f"  same     {kind:<10} {name:<20} {ox}")
            continue
        differ += 1
        print(f"  DIFFERS  {kind:<10} {name:<20} A {ox}  B {oy}")
        px, py = (x or {}).get("parts", {}), (y or {}).get("parts", {})
        for part in dict.fromkeys([*px, *py]):
            if px.get(part) != py.get(part):
                print(f"           part {part}: A {str(px.get(part))[:16]}  B {str(py.get(part))[:16]}")
        if (x or {}).get("info") != (y or {}).get("info"):
            print(f"           info: A {(x or {}).get('info')}  B {(y or {}).get('info')}")
    print(f"{differ} of {len(rows)} (head, stage) outcomes differ")
    return 1 if differ else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="checkout to fingerprint")
    ap.add_argument("--heads", default=None, help="comma-separated kinds (default: every head in the registry)")
    ap.add_argument("--out", default=None, help="write the JSON here (default: stdout)")
    ap.add_argument("--keep", default=None, help="work in this directory and keep it (default: a temp dir, removed)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print the (head, stage) outcomes that differ")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.compare:
        return compare(Path(args.compare[0]), Path(args.compare[1]))
    if args.worker:
        return worker(args)
    repo = Path(args.repo).resolve()
    heads = [h.strip() for h in args.heads.split(",") if h.strip()] if args.heads else None
    result = fingerprint(repo, heads, Path(args.keep).resolve() if args.keep else None)
    text = json.dumps(result, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    failed = [k for k, h in result["heads"].items() if "error" in h] + (["shared"] if "shared_error" in result else [])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
