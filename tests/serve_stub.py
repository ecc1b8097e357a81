"""A stand-in for ``vllm serve`` in the CPU tests of benchmarks/bench_serve.py: the OpenAI completions API that
``vllm bench serve`` drives (streamed chunks, one word per token, the usage chunk last), /health and /metrics,
on the loopback address and port it is given. It starts a child process, as vLLM's API server starts its engine
core, so that a test can see the whole process group stopped.

    python tests/serve_stub.py --host 127.0.0.1 --port PORT [--child-pid-file PATH] [anything vllm serve takes]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_DELAY_S = 0.002


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/metrics":
            self._send(200, b"# no metrics\n", "text/plain")
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path != "/v1/completions":
            self._send(404, b"{}")
            return
        prompt_tokens = len(str(body.get("prompt", "")).split())
        n = int(body.get("max_tokens") or 1)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def event(data) -> None:
            payload = f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            self.wfile.flush()

        for i in range(n):
            time.sleep(TOKEN_DELAY_S)
            event({"id": "cmpl-stub", "object": "text_completion", "model": body.get("model"),
                   "choices": [{"index": 0, "text": f" t{3 + i}", "finish_reason": None if i < n - 1 else "length"}]})
        event({"id": "cmpl-stub", "object": "text_completion", "model": body.get("model"), "choices": [],
               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}})
        event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--child-pid-file")
    args, _ = parser.parse_known_args()
    # the "engine core": it ignores SIGTERM and SIGINT, so only the process group's SIGKILL ends it
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"])
    if args.child_pid_file:
        with open(args.child_pid_file, "w") as f:
            f.write(str(child.pid))
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # bench_serve.py stops a server with SIGTERM
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
