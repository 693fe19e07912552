"""A minimal OpenAI-style engine for tests/test_agent.py: healthy, lists one model, answers completions,
except that a prompt of ``"drop"`` gets its connection closed with no answer (an engine dying mid-request).

Usage: python tests/dropping_engine.py PORT
"""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.reply({"data": [{"id": "fake"}]} if self.path == "/v1/models" else {})

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if request.get("prompt") == "drop":
            self.close_connection = True
            self.connection.close()
            return
        self.reply({"choices": [{"text": "x", "index": 0, "finish_reason": "length"}]})

    def reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
