"""A speculative-decoding server on 127.0.0.1 for `serve-check --server`'s tests, deployed right or wrong on purpose.

It answers like vLLM (`/v1/models`, `/v1/completions`, `/tokenize` of chat messages, Prometheus `/metrics` under
`vllm:`) or like llama-server (`/props`, `/completion` with `timings.draft_n*`, `/apply-template`, `/tokenize`,
`/metrics` under `llamacpp:`), decodes with a real tiny target, and counts its drafter's rounds by that engine's rule
— the rounds a real engine runs, since greedy verification commits the target's greedy tokens. The deployment
faults it can be given are the ones users hit:

    FakeEngine(target, drafter, protocol="openai")                  # deployed as trained
    FakeEngine(..., system_prompt=[7, 7])      # its chat template adds a system prompt
    FakeEngine(..., target_noise=0.05)         # the served target runs other numerics (a quantized one)
    FakeEngine(..., layer_map={1: 2, 2: 3})   # it feeds the drafter other target layers than trained
    FakeEngine(..., window=24)                 # a context of 24 tokens: longer prompts lose their head
    FakeEngine(..., temperature=1.0)           # it samples whatever the request asks
    FakeEngine(..., other_traffic=5)           # another client's tokens land in its counters
    FakeEngine(..., metrics=False) / (..., speculative=False) / (..., reset_after=1)

Chats are rendered by `render(messages)` (a stand-in template over the tiny vocabulary); the checker renders the
same way for the drafter's "training" template.
"""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from dflashkit.drafter.model import DFlashDrafter
from dflashkit.evaluate.simulate import replay_rounds
from dflashkit.evaluate.stats import parse_method
from dflashkit.export.served import RESERVE, replay_counts, transcript


def render(messages: list[dict[str, str]], system_prompt: list[int] | None = None) -> list[int]:
    """A chat as token ids of the tiny vocabulary (97): per message a role marker then its characters folded into
    3…96; `system_prompt` ids go first (the template fault)."""
    ids = [1, *list(system_prompt or [])]
    for m in messages:
        ids += [4 if m["role"] == "user" else 5] + [3 + (ord(ch) * 7) % 94 for ch in m["content"]]
    return [*ids, 5]


class FakeEngine:
    def __init__(
        self,
        target: Any,
        drafter: DFlashDrafter,
        *,
        protocol: str = "openai",  # "openai" (vLLM) | "llama.cpp"
        system_prompt: list[int] | None = None,
        target_noise: float = 0.0,
        layer_map: dict[int, int] | None = None,
        window: int | None = None,
        temperature: float | None = None,
        other_traffic: int = 0,
        metrics: bool = True,
        speculative: bool = True,
        reset_after: int | None = None,
        model: str = "tiny-target",
    ) -> None:
        self.protocol, self.model, self.system_prompt = protocol, model, system_prompt
        self.metrics, self.speculative, self.other_traffic = metrics, speculative, other_traffic
        self.temperature, self.reset_after, self.layer_map = temperature, reset_after, layer_map or {}
        self.target = _noisy(target, target_noise) if target_noise else target
        self.drafter, self.window = drafter, window
        self.counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "generated": 0}
        self.per_pos = [0] * (drafter.config.block_size - drafter.first_draft_slot())
        self.requests = 0
        self._lock, self._decoding = threading.Lock(), threading.Lock()
        self._gen = torch.Generator().manual_seed(1234)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------------------------------------ decoding
    def _sample(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                logits = self.target.forward(torch.tensor([ids]), layer_ids=[], logits=True).logits[0, -1]
                p = torch.softmax(logits.float() / float(self.temperature), dim=-1)
                ids.append(int(torch.multinomial(p, 1, generator=self._gen)))
        return ids[len(prompt) :]

    def _decode(self, prompt: list[int], n: int) -> tuple[list[int], dict[str, Any]]:
        """(output tokens, this request's counts) — counted by the engine's round rule on its own output."""
        reserve = RESERVE[self.protocol]
        slots = len(self.per_pos)
        layers = sorted(set(self.layer_map.values()) | set(self.drafter.config.target_layer_ids))
        if self.window is not None:  # a context of `window` tokens: the prompt's head is cut off
            prompt = prompt[-self.window :]
        if self.temperature:
            out = self._sample(prompt, n)
            tr = transcript(self.target, layers, prompt, out, slots if reserve is None else 0)
        else:
            tr = transcript(self.target, layers, prompt, [], n + (slots if reserve is None else 0))
            out = tr.ids[len(prompt) : len(prompt) + n]
        mapping = self.layer_map or None
        c = replay_counts(self.drafter, self.target, tr, n, reserve, mapping)
        if mapping:
            tr = replace(tr, layers={i: tr.layers[mapping.get(i, i)] for i in self.drafter.config.target_layer_ids})
        _, drafted = replay_rounds(
            self.drafter, tr, embed_weight=self.target.embed_weight, lm_head_weight=self.target.lm_head_weight,
            max_new_tokens=n, method=parse_method("chain"), reserve=reserve,
        )  # fmt: skip
        return out, {"drafts": c.drafts, "accepted": c.accepted, "per_pos": c.accepted_per_pos, "drafted": sum(drafted)}

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = [int(t) for t in body["prompt"]]
        n = int(body.get("n_predict", body.get("max_tokens", 16)))
        with self._decoding:  # one decode at a time: the tiny target is not shared across threads
            out, counts = self._decode(prompt, n)
        with self._lock:
            self.requests += 1
            if self.reset_after is not None and self.requests > self.reset_after:
                self.counters = dict.fromkeys(self.counters, 0)
                self.per_pos = [0] * len(self.per_pos)
                self.reset_after = None
            if self.speculative:
                self.counters["drafts"] += counts["drafts"] + self.other_traffic
                self.counters["draft_tokens"] += counts["drafted"]
                self.counters["accepted"] += counts["accepted"] + self.other_traffic
                for j, v in enumerate(counts["per_pos"]):
                    self.per_pos[j] += v
            self.counters["generated"] += len(out) + self.other_traffic
        if self.protocol == "llama.cpp":
            timings: dict[str, Any] = {"predicted_n": len(out)}
            if self.speculative and counts["drafted"]:
                timings.update(draft_n=counts["drafted"], draft_n_accepted=counts["accepted"])
            settings = {"temperature": float(self.temperature or body.get("temperature", 0.0))}
            return {"content": "x" * len(out), "tokens": out, "stop": True, "stop_type": "limit",
                    "timings": timings, "generation_settings": settings, "tokens_evaluated": len(prompt)}  # fmt: skip
        choice = {"index": 0, "text": "x" * len(out), "finish_reason": "length", "token_ids": out}
        return {"object": "text_completion", "model": self.model, "choices": [choice]}

    def metrics_text(self) -> str:
        prefix = "vllm" if self.protocol == "openai" else "llamacpp"
        label = '{engine="0",model_name="tiny"}' if prefix == "vllm" else ""
        gen = "generation_tokens" if prefix == "vllm" else "tokens_predicted"
        lines = [f"# TYPE {prefix}:{gen}_total counter", f"{prefix}:{gen}_total{label} {self.counters['generated']}"]
        if self.speculative:
            for name, key in (("drafts", "drafts"), ("draft_tokens", "draft_tokens"), ("accepted_tokens", "accepted")):
                lines.append(f"{prefix}:spec_decode_num_{name}_total{label} {float(self.counters[key])}")
            for j, v in enumerate(self.per_pos):
                pos = f'{{engine="0",model_name="tiny",position="{j}"}}' if prefix == "vllm" else f'{{position="{j}"}}'
                lines.append(f"{prefix}:spec_decode_num_accepted_tokens_per_pos_total{pos} {float(v)}")
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------------------------------------ HTTP
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, obj: Any, text: bool = False) -> None:
                data = obj.encode() if text else json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/metrics" and fake.metrics:
                    return self._send(200, fake.metrics_text(), text=True)
                if self.path == "/props" and fake.protocol == "llama.cpp":
                    return self._send(200, {"default_generation_settings": {}, "total_slots": 1, "model_alias": "m"})
                if self.path == "/v1/models" and fake.protocol == "openai":
                    return self._send(200, {"object": "list", "data": [{"id": fake.model, "object": "model"}]})
                self._send(404, {"error": {"code": 404, "message": "File Not Found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/tokenize" and fake.protocol == "openai" and "messages" in body:
                    return self._send(200, {"tokens": render(body["messages"], fake.system_prompt)})
                if self.path == "/apply-template" and fake.protocol == "llama.cpp":
                    ids = render(body["messages"], fake.system_prompt)
                    return self._send(200, {"prompt": " ".join(map(str, ids))})
                if self.path == "/tokenize" and fake.protocol == "llama.cpp":
                    return self._send(200, {"tokens": [int(t) for t in str(body.get("content", "")).split()]})
                want = "/completion" if fake.protocol == "llama.cpp" else "/v1/completions"
                if self.path != want:
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                return self._send(200, fake._complete(body))

        return Handler


def _noisy(target: Any, scale: float) -> Any:
    """The target loaded again, its weights with relative noise: another precision's numerics."""
    from dflashkit.target.model import Target

    other = Target.load(target.source)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return other
