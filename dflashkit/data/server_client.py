"""A client for OpenAI-compatible completion servers (vLLM, SGLang, llama.cpp's `llama-server`) that regenerates
from token ids, spread over several servers, with retries.

    pool = ServerPool(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    pool.connect(tokenizer)                      # which protocol each server speaks; its tokenizer checked
    c = pool.complete(prompt_ids, max_tokens=256, temperature=0.0, top_p=1.0, seed=0, stop_ids=[2])
    c.token_ids, c.text, c.finished               # ids as the server generated them (None: text only)

Protocols, found per server by `connect`:
  llama.cpp  `GET /props` answers → `POST /completion` with `return_tokens: true` (its OpenAI endpoint returns no
             ids); the stop token it generated is part of `tokens`.
  sglang     `GET /get_model_info` answers → SGLang's native `POST /generate` with `input_ids` (its answer carries
             `output_ids`; `meta_info.finish_reason.type` says stop or length);
  openai     `GET /v1/models` answers → `POST /v1/completions` with the prompt as a token-id list and
             `return_token_ids: true` (vLLM returns `choices[0].token_ids`; a server that does not returns text only
             and the caller re-tokenises it), `stop_token_ids` set to the target's end-of-turn ids.
The prompt always goes as token ids: dflashkit renders the chat template itself, so the prompt the server sees is
exactly the one capture and training see. `connect` also tokenises a probe text through `POST /tokenize` where a
server offers it and refuses a server whose ids differ from the target tokenizer's (another model).

Timeouts (`ServerTimeouts`, settable: `prepare --server-timeouts CONNECT,FIRST_BYTE,TOTAL`): connecting, the first
byte of the answer (a whole completion is generated before it arrives), and the whole request — so a server that
accepts and never answers, or answers and then sends a byte a second, costs at most those seconds.
Failures: a connection error, a timeout or a 5xx is retried on the next server with exponential backoff (a
server that failed rests a while); a 4xx is the request's own fault and raises `ServerError` at once, naming the URL,
the status and the server's message; when no server answers `retries` times in a row, `ServerError` lists each
URL with its last failure. Uses only the standard library (urllib).
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflashkit.errors import DataError
from dflashkit.validation import ServerUrl, problem

PROBE_TEXT = "Regenerate: the quick brown fox — 12 345 jumps; naïve café ✓ def f(x): return x**2\n"


class ServerError(DataError):
    """A server refused a request, served another model, or no server answered."""


class _Retryable(Exception):
    """A failure worth trying again (connection, timeout, 5xx)."""


@dataclass
class Completion:
    """One generated response."""

    token_ids: list[int] | None  # the server's ids (incl. the stop token when finished); None: text only
    text: str
    finished: bool  # stopped at an end-of-turn token (False: max_tokens reached)
    info: dict[str, Any] = field(default_factory=dict)  # the answer's other fields (timings, meta_info, usage, …)


@dataclass
class _Server:
    url: str
    protocol: str = ""  # "llama.cpp" | "sglang" | "openai", set by connect
    model: str = ""  # the served model's name (sent in OpenAI requests)
    down_until: float = 0.0
    last_error: str = ""
    requests: int = 0
    tokenizer_check: str = ""  # "same ids" | "not offered by the server"


_GENERATING_PATHS = ("/completion", "/generate", "/v1/completions")


class _Timeout(Exception):
    """A request ran past one of its timeouts (the message says which)."""


def _exchange(
    url: str, method: str, path: str, data: bytes | None, connect_s: float, first_byte_s: float, deadline: _Deadline
) -> tuple[int, bytes]:
    """(status, body) of one HTTP request within the three timeouts. The body is read piece by piece against the
    whole-request deadline, so a server that trickles its answer cannot hold the caller."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port
    connect = max(0.001, min(connect_s, deadline.left()))
    if parts.scheme == "https":
        ctx = ssl.create_default_context()
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, port, timeout=connect, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=connect)
    try:
        try:
            conn.connect()
        except TimeoutError:
            raise _Timeout(f"no connection within {connect:g} s") from None
        sock = conn.sock  # kept: http.client drops conn.sock once an answer says it closes the connection
        first = max(0.001, min(first_byte_s, deadline.left()))
        sock.settimeout(first)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, (parts.path.rstrip("/") + path) or "/", body=data, headers=headers)
        try:
            resp = conn.getresponse()
        except TimeoutError:
            raise _Timeout(f"accepted the request but sent no answer within {first:g} s") from None
        pieces = []
        while True:
            left = deadline.left()
            if left <= 0:
                raise _Timeout(f"its answer was still arriving after {deadline.total:g} s (a trickle)")
            sock.settimeout(left)
            try:
                piece = resp.read1(1 << 16)
            except TimeoutError:
                raise _Timeout(f"its answer stalled past the request's {deadline.total:g} s") from None
            if not piece:
                if resp.length:  # Content-Length promised more than arrived: the server closed early
                    raise http.client.IncompleteRead(b"".join(pieces), resp.length)
                return resp.status, b"".join(pieces)
            pieces.append(piece)
    finally:
        conn.close()


def _message(body: bytes) -> str:
    """The server's own error message out of a JSON or text body."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:300]
    err = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(err, dict):
        err = err.get("message") or err.get("detail") or err
    if isinstance(data, dict) and "detail" in data and not isinstance(err, str):
        err = data["detail"]
    return str(err)[:300]


@dataclass(frozen=True)
class ServerTimeouts:
    """Seconds a request may take: to connect, to the first byte of the answer (a completion is generated whole
    before its answer starts; probes get at most `probe_s`), and in all (a server trickling its answer is cut off)."""

    connect_s: float = 10.0
    first_byte_s: float = 3600.0  # a long response on a server with hundreds in flight takes minutes
    total_s: float = 7200.0
    probe_s: float = 60.0  # GET /props, /v1/models, POST /tokenize: answered at once by a live server


class _Deadline:
    """Time left of a request's whole-time budget."""

    def __init__(self, seconds: float) -> None:
        self.total = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


@dataclass
class ServerPool:
    """Several servers of one target; requests are spread round-robin and fail over to the others."""

    urls: list[str]
    retries: int = 6  # consecutive failed attempts (over all servers) before giving up
    backoff_s: float = 0.5  # first wait after a failure; doubles up to max_backoff_s
    max_backoff_s: float = 20.0
    timeouts: ServerTimeouts = field(default_factory=ServerTimeouts)
    sleep: Callable[[float], None] = time.sleep
    servers: list[_Server] = field(init=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ServerError("no server URL given (expected --server http://HOST:PORT)")
        self.servers = []
        for url in self.urls:
            why = problem(ServerUrl, url)  # the check `--server` runs when it is parsed
            if why:
                raise ServerError(f"--server {url}: {why}")
            self.servers.append(_Server(url.rstrip("/")))
        self._lock = threading.Lock()
        self._next = 0

    # -------------------------------------------------------------------------------------------- HTTP
    def _http(self, server: _Server, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One request; JSON back. Raises _Retryable (connection, timeout, 5xx) or ServerError (4xx, not JSON)."""
        data = None if body is None else json.dumps(body).encode()
        t = self.timeouts
        first_byte = t.first_byte_s if path in _GENERATING_PATHS else min(t.probe_s, t.first_byte_s)
        try:
            status, raw = _exchange(server.url, method, path, data, t.connect_s, first_byte, _Deadline(t.total_s))
        except _Timeout as e:
            raise _Retryable(str(e)) from None
        except (OSError, http.client.HTTPException) as e:  # refused, reset, DNS, closed early
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        if status >= 500:
            raise _Retryable(f"HTTP {status}: {_message(raw)}")
        if status >= 400:
            raise ServerError(f"{server.url}{path}: HTTP {status}: {_message(raw)}")
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(
                f"{server.url}{path}: expected a JSON answer, got {raw[:200].decode('utf-8', 'replace')!r}"
            ) from None

    def _pick(self) -> _Server:
        with self._lock:
            now = time.monotonic()
            n = len(self.servers)
            for k in range(n):
                s = self.servers[(self._next + k) % n]
                if s.down_until <= now:
                    self._next = (self._next + k + 1) % n
                    return s
            s = min(self.servers, key=lambda s: s.down_until)  # all resting: the one back soonest
            self._next = (self.servers.index(s) + 1) % n
            return s

    def _with_retries(self, what: str, call: Callable[[_Server], Any]) -> Any:
        wait = self.backoff_s
        for attempt in range(self.retries + 1):
            server = self._pick()
            try:
                out = call(server)
                server.requests += 1
                return out
            except _Retryable as e:
                server.last_error = str(e)
                server.down_until = time.monotonic() + wait
                if attempt == self.retries:
                    break
                self.sleep(wait)
                wait = min(wait * 2, self.max_backoff_s)
        failures = "; ".join(f"{s.url} ({s.last_error or 'not tried'})" for s in self.servers)
        raise ServerError(f"no server answers {what} after {self.retries + 1} attempts: {failures}")

    # -------------------------------------------------------------------------------------------- setup
    def _detect(self, server: _Server) -> None:
        """Protocol and model name of one server (raises _Retryable when it does not answer)."""
        try:
            props = self._http(server, "GET", "/props")
            if isinstance(props, dict) and ("default_generation_settings" in props or "total_slots" in props):
                server.protocol = "llama.cpp"
                name = str(props.get("model_alias") or props.get("model_path") or "")
                server.model = name.replace("\\", "/").rsplit("/", 1)[-1]  # a file name, not where it is kept
                return
        except ServerError:
            pass  # no /props: not llama.cpp
        try:
            info = self._http(server, "GET", "/get_model_info")
            if isinstance(info, dict) and "model_path" in info:
                server.protocol = "sglang"
                server.model = str(info["model_path"]).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
                return
        except ServerError:
            pass  # not SGLang
        models = self._http(server, "GET", "/v1/models")
        ids = (
            [m.get("id") for m in (models.get("data") or []) if isinstance(m, dict)] if isinstance(models, dict) else []
        )
        if not ids:
            raise ServerError(f"{server.url}/v1/models: expected a list of served models, got {str(models)[:200]}")
        server.protocol, server.model = "openai", str(ids[0])

    def _check_tokenizer(self, server: _Server, tokenizer: Any) -> None:
        want = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
        body = {"content": PROBE_TEXT, "prompt": PROBE_TEXT, "add_special": False, "add_special_tokens": False}
        if server.protocol == "openai":
            body["model"] = server.model
        try:
            got = self._http(server, "POST", "/tokenize", body)
        except ServerError:
            server.tokenizer_check = "not offered by the server"
            return
        ids = got.get("tokens") if isinstance(got, dict) else None
        ids = [t["id"] if isinstance(t, dict) else t for t in ids] if isinstance(ids, list) else None
        if ids is None:
            server.tokenizer_check = "not offered by the server"
            return
        if ids != want:
            raise ServerError(
                f"{server.url} serves {server.model or 'a model'} whose tokenizer differs from the target's: "
                f"{PROBE_TEXT!r} → {ids[:12]}… there, {want[:12]}… here; expected a server of the target model"
            )
        server.tokenizer_check = "same ids"

    def connect(self, tokenizer: Any) -> list[dict[str, str]]:
        """Find each server's protocol and check its tokenizer; servers that do not answer are retried later, but
        at least one must answer now. Returns `describe()`."""
        for server in self.servers:
            try:
                self._detect(server)
                if tokenizer is not None:  # a target without one (token-id prompts) has nothing to compare
                    self._check_tokenizer(server, tokenizer)
            except _Retryable as e:
                server.last_error, server.down_until = str(e), time.monotonic() + self.backoff_s
        if not any(s.protocol for s in self.servers):
            failures = "; ".join(f"{s.url} ({s.last_error})" for s in self.servers)
            raise ServerError(f"no server answers: {failures}")
        return self.describe()

    # -------------------------------------------------------------------------------------------- completion
    def _request(self, server: _Server, prompt: list[int], params: dict[str, Any], stop_ids: list[int]) -> Completion:
        if not server.protocol:  # did not answer at connect time
            self._detect(server)
        temperature = params["temperature"]
        if server.protocol == "llama.cpp":
            body = {
                "prompt": prompt,
                "n_predict": params["max_tokens"],
                "temperature": temperature,
                "top_p": params["top_p"] if temperature > 0 else 1.0,
                "top_k": 0 if temperature > 0 else 1,
                "min_p": 0.0,
                "seed": params["seed"],
                "return_tokens": True,
                "stream": False,
            }
            if params.get("ignore_eos"):
                body["ignore_eos"] = True
            out = self._http(server, "POST", "/completion", body)
            if not isinstance(out, dict) or "content" not in out:
                raise ServerError(f"{server.url}/completion: expected a completion object, got {str(out)[:200]}")
            ids = out.get("tokens") or None
            finished = out.get("stop_type") in ("eos", "word") or (bool(ids) and ids[-1] in stop_ids)
            info = {k: v for k, v in out.items() if k not in ("content", "tokens")}
            return Completion([int(t) for t in ids] if ids else None, str(out["content"]), finished, info)
        if server.protocol == "sglang":
            return self._sglang(server, prompt, params, stop_ids)
        body = {
            "model": server.model,
            "prompt": prompt,
            "max_tokens": params["max_tokens"],
            "temperature": temperature,
            "top_p": params["top_p"] if temperature > 0 else 1.0,
            "seed": params["seed"],
            "stop_token_ids": stop_ids,
            "return_token_ids": True,
            "skip_special_tokens": True,
        }
        if params.get("ignore_eos"):
            body["ignore_eos"] = True
        out = self._http(server, "POST", "/v1/completions", body)
        try:
            choice = out["choices"][0]
            text = str(choice.get("text") or "")
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ServerError(f"{server.url}/v1/completions: expected 'choices', got {str(out)[:200]}") from None
        ids = choice.get("token_ids") or None
        info = {k: v for k, v in out.items() if k != "choices"}
        info.update({k: v for k, v in choice.items() if k not in ("text", "token_ids")})
        return Completion([int(t) for t in ids] if ids else None, text, choice.get("finish_reason") == "stop", info)

    def _sglang(self, server: _Server, prompt: list[int], params: dict[str, Any], stop_ids: list[int]) -> Completion:
        temperature = params["temperature"]
        sampling = {
            "max_new_tokens": params["max_tokens"],
            "temperature": temperature,
            "top_p": params["top_p"] if temperature > 0 else 1.0,
            "stop_token_ids": stop_ids,
        }
        if params.get("ignore_eos"):
            sampling["ignore_eos"] = True
        out = self._http(server, "POST", "/generate", {"input_ids": prompt, "sampling_params": sampling})
        if not isinstance(out, dict) or "text" not in out:
            raise ServerError(f"{server.url}/generate: expected a generation object, got {str(out)[:200]}")
        ids = out.get("output_ids") or None
        reason = (out.get("meta_info") or {}).get("finish_reason") or {}
        finished = (reason.get("type") if isinstance(reason, dict) else str(reason)) == "stop"
        info = {k: v for k, v in out.items() if k not in ("text", "output_ids")}
        return Completion([int(t) for t in ids] if ids else None, str(out["text"]), finished, info)

    def complete(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        stop_ids: list[int],
        ignore_eos: bool = False,
    ) -> Completion:
        """Generate one response to `prompt_ids` on some server (retried and failed over as the module says);
        `ignore_eos`: exactly `max_tokens` tokens, end-of-turn tokens included (serve-check's fixed-length outputs)."""
        params: dict[str, Any] = {"max_tokens": int(max_tokens), "temperature": float(temperature)}
        params.update(top_p=float(top_p), seed=int(seed), ignore_eos=bool(ignore_eos))
        return self._with_retries(
            "a completion request", lambda server: self._request(server, list(prompt_ids), params, stop_ids)
        )

    def text(self, path: str) -> str:
        """GET `path` of the first server as text (e.g. Prometheus `/metrics`), within the probe timeouts; ServerError
        when it is not served (4xx), after retries when the server does not answer."""
        server, t = self.servers[0], self.timeouts

        def get(_: _Server) -> str:
            try:
                status, raw = _exchange(server.url, "GET", path, None, t.connect_s, t.probe_s, _Deadline(t.probe_s))
            except _Timeout as e:
                raise _Retryable(str(e)) from None
            except (OSError, http.client.HTTPException) as e:
                raise _Retryable(f"{type(e).__name__}: {e}") from None
            if status >= 500:
                raise _Retryable(f"HTTP {status}: {_message(raw)}")
            if status >= 400:
                raise ServerError(f"{server.url}{path}: HTTP {status}: {_message(raw)}")
            return raw.decode("utf-8", "replace")

        return self._with_retries(f"GET {path}", get)

    def chat_ids(
        self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None
    ) -> list[int] | None:
        """The prompt token ids the first server makes of a chat (its own template, generation prompt added) — what a
        chat request to it runs on; None when the server offers no way to see them (SGLang, older servers)."""
        server = self.servers[0]
        if not server.protocol:
            self._detect(server)
        try:
            if server.protocol == "llama.cpp":  # its template renders to text, which its tokenizer parses
                body: dict[str, Any] = {"messages": messages}
                if template_kwargs:
                    body["chat_template_kwargs"] = template_kwargs
                text = self._with_retries("/apply-template", lambda s: self._http(s, "POST", "/apply-template", body))
                prompt = text.get("prompt") if isinstance(text, dict) else None
                if not isinstance(prompt, str):
                    return None
                got = self._http(
                    server, "POST", "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}
                )
            elif server.protocol == "openai":  # vLLM's /tokenize renders messages with the served template
                body = {"model": server.model, "messages": messages, "add_generation_prompt": True}
                if template_kwargs:
                    body["chat_template_kwargs"] = template_kwargs
                got = self._with_retries("/tokenize", lambda s: self._http(s, "POST", "/tokenize", body))
            else:
                return None
        except ServerError:
            return None
        ids = got.get("tokens") if isinstance(got, dict) else None
        if not isinstance(ids, list):
            return None
        return [int(t["id"] if isinstance(t, dict) else t) for t in ids]

    def describe(self) -> list[dict[str, Any]]:
        """Per server: URL, protocol, model, tokenizer check, requests served, last failure."""
        return [
            {"url": s.url, "protocol": s.protocol, "model": s.model, "tokenizer_check": s.tokenizer_check,
             "requests": s.requests, "last_error": s.last_error}
            for s in self.servers
        ]  # fmt: skip


__all__ = ["Completion", "ServerError", "ServerPool"]
