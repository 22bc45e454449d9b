"""The benches' client for vLLM's `/v1/completions`: one request, streamed or not, timed.

A plain `http.client` connection per request (a loopback connect costs ~0.1 ms), no HTTP
library client: `httpx.stream()` builds a new client, SSL context included, for every call,
which put ~20 ms into every TTFT `kvpool bench chat` measured (40 ms against 21 ms through
one kept-alive client, for a 200-token prompt the server had cached, on an idle machine),
time no user's kept-alive client pays and which shrinks every ratio between arms.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from typing import Any


def _post(base_url: str, body: dict[str, Any], timeout: float
          ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """The connection (the caller closes it) and its 200 response; a refusal is a one-line
    RuntimeError with the server's reason."""
    u = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(http_error(resp.status, resp.read().decode(errors="replace"),
                                          "/v1/completions"))
    except BaseException:
        conn.close()
        raise
    return conn, resp


def http_error(status: int, text: str, endpoint: str) -> str:
    """A refused request as one line: the endpoint, the status, the server's reason."""
    return f"{endpoint}: HTTP {status}: {' '.join(text.split())[:300]}"


def _body(prompt: list[int], max_tokens: int, kv_transfer_params: dict | None,
          fields: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "local", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "ignore_eos": True, **fields}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def complete(base_url: str, prompt: list[int], max_tokens: int,
             kv_transfer_params: dict | None = None, timeout: float = 1800,
             **fields: Any) -> dict[str, Any]:
    """One non-streaming completion (a P/D prefill): vLLM's response (usage,
    kv_transfer_params). `fields` are more request fields (cache_salt, say)."""
    conn, resp = _post(base_url, _body(prompt, max_tokens, kv_transfer_params, fields), timeout)
    try:
        return json.loads(resp.read())
    finally:
        conn.close()


def stream(base_url: str, prompt: list[int], max_tokens: int,
           kv_transfer_params: dict | None = None, timeout: float = 1800,
           **fields: Any) -> dict[str, Any]:
    """One streaming completion: when it was sent and when each chunk with a choice came
    (perf_counter, taken as the line arrives), the generated token ids (with
    `return_token_ids=True`), the usage. An error the server sends inside the stream (vLLM
    answers 200, then `data: {"error": ...}`: a request that failed after it started) is a
    one-line RuntimeError, not a short stream."""
    body = _body(prompt, max_tokens, kv_transfer_params, fields)
    body.update(stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    conn, resp = _post(base_url, body, timeout)
    times: list[float] = []
    ids: list[int] = []
    usage: dict[str, Any] | None = None
    try:
        while True:
            line = resp.readline()
            arrived = time.perf_counter()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if msg.get("error"):
                err = msg["error"]
                reason = err.get("message", err) if isinstance(err, dict) else err
                raise RuntimeError(f"/v1/completions: error in the stream: "
                                   f"{' '.join(str(reason).split())[:300]}")
            if msg.get("choices"):
                times.append(arrived)
                for choice in msg["choices"]:
                    ids += choice.get("token_ids") or []
            if msg.get("usage"):
                usage = msg["usage"]
    finally:
        conn.close()
    return {"t0": t0, "times": times, "ids": ids, "usage": usage or {}}


def computed_of(usage: dict[str, Any]) -> int | None:
    """Prompt tokens the engine computed: prompt tokens - cached (its prefix cache and
    connector hits; `--enable-prompt-tokens-details`) (pure)."""
    if "prompt_tokens" not in usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(usage["prompt_tokens"]) - int(cached)
