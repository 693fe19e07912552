"""A minimal OpenAI-style engine for tests/test_agentprogress.py whose streamed completions come at the pace the
request asks: ``max_tokens`` chunks, the first after ``first_s``, each next after ``step_s``, and after chunk
``pause_at`` a pause of ``pause_s`` (an engine core stuck for a while, its HTTP server answering). Healthy, lists one
model, answers a whole completion at once.

Usage: python tests/pacing_engine.py PORT
"""

from __future__ import annotations

import json
import sys
import time

from fakeengine import WHOLE, FakeEngineHandler, serve  # tests/fakeengine.py: a script's folder is on sys.path


class Handler(FakeEngineHandler):
    def do_POST(self) -> None:
        request = self.request_body()
        if not request.get("stream"):
            self.reply(WHOLE)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        time.sleep(request.get("first_s", 0.0))
        for n in range(request["max_tokens"]):
            time.sleep(request.get("step_s", 0.0) if n else 0.0)
            time.sleep(request.get("pause_s", 0.0) if n == request.get("pause_at") else 0.0)
            chunk = {"id": "c", "object": "text_completion", "model": "fake", "choices": [{"index": 0, "text": "x"}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


if __name__ == "__main__":
    serve(int(sys.argv[1]), Handler)
