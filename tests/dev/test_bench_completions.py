"""The benches' completions client (kvpool_dev.bench.completions) against a real HTTP
server on loopback that answers as vLLM's `/v1/completions` does (the SSE framing and fields
of vllm/entrypoints/openai/completion; no vLLM needed to check the client's parsing)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvpool_dev.bench import completions


class _Completions(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive, the stream sent in chunked encoding one event per chunk,
    as uvicorn sends vLLM's: the client must read the framing, not wait for a close."""

    protocol_version = "HTTP/1.1"
    bodies: list[dict] = []

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        if body.get("max_tokens", 0) < 1:
            self._send(400, "application/json",
                       b'{"error": {"message": "max_tokens must be at least 1,\n got 0"}}')
            return
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": 32}}
        if not body.get("stream"):
            self._send(200, "application/json", json.dumps(
                {"choices": [{"text": "ab"}], "usage": usage,
                 "kv_transfer_params": {"kvpool": {"tokens": 40}}}).encode())
            return
        events = [{"choices": [{"text": "a", "token_ids": [11]}]},
                  {"choices": [{"text": "b", "token_ids": [12, 13]}]},
                  {"choices": [], "usage": usage}]
        if body.get("cache_salt") == "fail":  # vLLM: 200, then the error inside the stream
            events = events[:1] + [{"error": {"message": "KV load\nfailed", "code": 500}}]
        if body.get("cache_salt") == "empty":  # a stream that ends before any token
            events = events[2:]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for e in [json.dumps(e) for e in events] + ["[DONE]"]:
            data = f"data: {e}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def _send(self, status: int, ctype: str, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture()
def server():
    _Completions.bodies = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_stream_times_each_chunk_and_keeps_the_generated_ids_and_usage(server):
    s = completions.stream(server, list(range(40)), 3, {"kvpool": {"x": 1}},
                           return_token_ids=True, cache_salt="t1")
    assert s["ids"] == [11, 12, 13] and s["usage"]["prompt_tokens"] == 40
    # a time per chunk with a choice: not the usage chunk, whose choices are empty
    assert len(s["times"]) == 2 and s["t0"] <= s["times"][0] <= s["times"][1]
    assert completions.computed_of(s["usage"]) == 8
    body = _Completions.bodies[-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert (body["return_token_ids"], body["cache_salt"]) == (True, "t1")
    assert body["kv_transfer_params"] == {"kvpool": {"x": 1}} and body["ignore_eos"]


def test_a_completion_returns_vllms_response(server):
    out = completions.complete(server, [1, 2, 3], 1, {"do_remote_decode": True})
    assert out["kv_transfer_params"] == {"kvpool": {"tokens": 40}}
    assert _Completions.bodies[-1]["kv_transfer_params"] == {"do_remote_decode": True}
    assert "stream" not in _Completions.bodies[-1]


def test_a_refused_request_is_one_line_with_the_servers_reason(server):
    with pytest.raises(RuntimeError) as e:
        completions.stream(server, [1, 2], 0)
    msg = str(e.value)
    assert msg.startswith("/v1/completions: HTTP 400:") and "max_tokens must be" in msg
    assert "\n" not in msg


def test_an_error_inside_the_stream_is_one_line_not_a_short_stream(server):
    with pytest.raises(RuntimeError) as e:
        completions.stream(server, [1, 2], 4, cache_salt="fail")
    assert str(e.value) == "/v1/completions: error in the stream: KV load failed"


def test_bench_chat_takes_no_ttft_from_a_stream_without_a_token(server):
    from kvpool_dev.bench import chat_bench

    assert chat_bench._turn(server, [1, 2], 4)["ttft_s"] > 0
    with pytest.raises(RuntimeError, match="no token streamed"):
        chat_bench._turn(server, [1, 2], 4, cache_salt="empty")
