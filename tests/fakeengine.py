"""What the minimal OpenAI-style engines of the tests share (``tests/*_engine.py``, each run as a script by the tests
of the agent): a request handler that lists one model, answers JSON or a stream of events, reads a request's JSON
body and logs nothing, and the server that runs it on a port of 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WHOLE = {"choices": [{"text": "x", "index": 0, "finish_reason": "length"}]}  # a non-streamed completion's answer


class FakeEngineHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.reply({"data": [{"id": "fake"}]} if self.path == "/v1/models" else {})

    def request_body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["content-length"])))

    def reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def stream(self, chunks: Iterable[dict]) -> None:
        """A streamed completion: each of ``chunks`` as an SSE event as it comes, then ``[DONE]``."""
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


def serve(port: int, handler: type[BaseHTTPRequestHandler]) -> None:
    ThreadingHTTPServer(("127.0.0.1", port), handler).serve_forever()
