"""Runs a DFlash drafter in vLLM and writes what it did as JSON — executed by `serve-check` with the Python of the
vLLM environment (`scripts/setup_vllm.sh` → `.venv-vllm`), never imported by dflashkit (vLLM pins another
transformers, so it lives in its own environment; this file imports nothing of dflashkit).

    .venv-vllm/bin/python dflashkit/export/vllm_runner.py REQUEST.json RESULT.json

REQUEST: {"target": dir, "drafter": dir, "prompts": [[ids…], …], "max_new_tokens": n, "num_speculative_tokens": k,
          "dtype": "float32", "max_model_len": m}
RESULT:  {"vllm": version, "prompts": [{"tokens": [...], "drafts": d, "draft_tokens": t, "accepted": a,
          "accepted_per_pos": [...]}, …]}
Greedy (temperature 0), EOS ignored, one prompt at a time, so each prompt's counts are the deltas of vLLM's own
metrics `vllm:spec_decode_num_drafts`, `…_num_draft_tokens`, `…_num_accepted_tokens` and
`…_num_accepted_tokens_per_pos` around its request.
"""

from __future__ import annotations

import json
import os
import sys


def _counts(llm) -> dict[str, object]:
    out: dict[str, object] = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per = out["accepted_per_pos"]
            values = [int(v) for v in m.values]
            out["accepted_per_pos"] = [a + b for a, b in zip(per, values, strict=False)] if per else values
    return out


def _delta(after: dict[str, object], before: dict[str, object]) -> dict[str, object]:
    out = {k: int(after[k]) - int(before[k]) for k in ("drafts", "draft_tokens", "accepted")}
    b = before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
    out["accepted_per_pos"] = [x - y for x, y in zip(after["accepted_per_pos"], b, strict=False)]
    return out


def main(argv: list[str]) -> int:
    request_path, result_path = argv[1], argv[2]
    with open(request_path) as f:
        req = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a few short prompts
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=req["target"],
        dtype=req.get("dtype", "float32"),
        max_model_len=int(req["max_model_len"]),
        enforce_eager=True,
        disable_log_stats=False,
        seed=0,
        speculative_config={
            "method": "dflash",
            "model": req["drafter"],
            "num_speculative_tokens": int(req["num_speculative_tokens"]),
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_new_tokens"]), ignore_eos=True)
    results = []
    for ids in req["prompts"]:
        before = _counts(llm)
        out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)[0]
        after = _counts(llm)
        results.append({"tokens": list(out.outputs[0].token_ids), **_delta(after, before)})
    with open(result_path, "w") as f:
        json.dump({"vllm": vllm.__version__, "prompts": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
