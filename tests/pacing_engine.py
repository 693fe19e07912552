"""A minimal OpenAI-style engine for tests/test_agentprogress.py whose streamed completions come at the pace the
request asks: ``max_tokens`` chunks, the first after ``first_s``, each next after ``step_s``, and after chunk
``pause_at`` a pause of ``pause_s`` (an engine core stuck for a while, its HTTP server answering). Healthy, lists one
model, answers a whole completion at once.

Usage: python tests/pacing_engine.py PORT
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

from fakeengine import WHOLE, FakeEngineHandler, serve  # tests/fakeengine.py: a script's folder is on sys.path


class Handler(FakeEngineHandler):
    def do_POST(self) -> None:
        request = self.request_body()
        if request.get("stream"):
            self.stream(paced(request))
        else:
            self.reply(WHOLE)


def paced(request: dict) -> Iterator[dict]:
    """``max_tokens`` chunks at the pace ``request`` asks (module docstring)."""
    time.sleep(request.get("first_s", 0.0))
    for n in range(request["max_tokens"]):
        time.sleep(request.get("step_s", 0.0) if n else 0.0)
        time.sleep(request.get("pause_s", 0.0) if n == request.get("pause_at") else 0.0)
        yield {"id": "c", "object": "text_completion", "model": "fake", "choices": [{"index": 0, "text": "x"}]}


if __name__ == "__main__":
    serve(int(sys.argv[1]), Handler)
