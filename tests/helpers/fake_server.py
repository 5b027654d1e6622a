"""A small completion server on 127.0.0.1 for the regeneration client's tests: it answers like llama-server
(`/props`, `/completion`, `/tokenize`), like SGLang's native API (`/get_model_info`, `/generate`, `/tokenize`) or
like vLLM (`/v1/models`, `/v1/completions`, `/tokenize`), generating
greedily with a real (tiny) HF target, and can be told to fail: HTTP 5xx, a dropped connection, a 4xx, another
tokenizer, or no token ids in its answers (text only, as some servers do).

    with FakeServer(target, protocol="openai", failures=["503", "drop"]) as srv:
        srv.url        # http://127.0.0.1:PORT
        srv.requests   # completion requests answered
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dflashkit.data.conversations import end_of_turn_ids
from dflashkit.data.regenerate import generate_batch


class FakeServer:
    def __init__(
        self,
        target: Any,
        *,
        protocol: str = "openai",  # "openai" | "llama.cpp" | "sglang"
        token_ids: bool = True,  # False: answers carry text only
        failures: list[str] | None = None,  # per completion request, in order: "503", "drop", "400", "ok"
        tokenizer_shift: int = 0,  # /tokenize answers ids + shift: another model's tokenizer
        model: str = "tiny-target",
        fail_after: int | None = None,  # every completion request after this many answered fails with "drop"
    ) -> None:
        self.target, self.protocol, self.token_ids = target, protocol, token_ids
        self.failures = list(failures or [])
        self.tokenizer_shift, self.model, self.fail_after = tokenizer_shift, model, fail_after
        self.requests = 0
        self.prompts: list[list[int]] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop answering (as a killed server): the port is closed."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------------------------------------------ answers
    def _generate(self, prompt: list[int], max_tokens: int) -> tuple[list[int], bool]:
        stops = end_of_turn_ids(self.target.tokenizer)
        with self._lock:
            return generate_batch(self.target, [prompt], max_new_tokens=max_tokens, stop_ids=stops)[0]

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = [int(t) for t in body.get("prompt", body.get("input_ids", []))]
        self.prompts.append(prompt)
        n = body.get("n_predict", body.get("max_tokens", (body.get("sampling_params") or {}).get("max_new_tokens")))
        ids, finished = self._generate(prompt, int(n))
        text = self.target.tokenizer.decode(ids, skip_special_tokens=True)
        if self.protocol == "sglang":
            reason = {"type": "stop", "matched": ids[-1]} if finished else {"type": "length", "length": len(ids)}
            out: dict[str, Any] = {"text": text, "meta_info": {"finish_reason": reason}}
            if self.token_ids:
                out["output_ids"] = ids
            return out
        if self.protocol == "llama.cpp":
            return {
                "content": text,
                "tokens": ids if (self.token_ids and body.get("return_tokens")) else [],
                "stop": True,
                "stop_type": "eos" if finished else "limit",
            }
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "stop" if finished else "length"}
        if self.token_ids and body.get("return_token_ids"):
            choice["token_ids"] = ids
        return {"object": "text_completion", "model": self.model, "choices": [choice]}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/props" and fake.protocol == "llama.cpp":
                    return self._send(
                        200, {"default_generation_settings": {}, "total_slots": 4, "model_alias": fake.model}
                    )
                if self.path == "/get_model_info" and fake.protocol == "sglang":
                    return self._send(200, {"model_path": f"/models/{fake.model}", "is_generation": True})
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": fake.model, "object": "model"}]})
                self._send(404, {"error": {"code": 404, "message": "File Not Found"}})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/tokenize":
                    text = body.get("content", body.get("prompt", ""))
                    ids = fake.target.tokenizer(text, add_special_tokens=False)["input_ids"]
                    return self._send(200, {"tokens": [i + fake.tokenizer_shift for i in ids]})
                want = {"llama.cpp": "/completion", "sglang": "/generate"}.get(fake.protocol, "/v1/completions")
                if self.path != want:
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                with fake._lock:
                    action = fake.failures.pop(0) if fake.failures else "ok"
                    if fake.fail_after is not None and fake.requests >= fake.fail_after:
                        action = "drop"
                if action == "503":
                    return self._send(503, {"error": {"message": "Loading model", "code": 503}})
                if action == "400":
                    return self._send(400, {"error": {"message": "the prompt is too long for the context"}})
                if action == "drop":
                    self.close_connection = True
                    self.connection.close()
                    return None
                answer = fake._completion(body)
                with fake._lock:
                    fake.requests += 1
                return self._send(200, answer)

        return Handler
