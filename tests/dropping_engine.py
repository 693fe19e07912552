"""A minimal OpenAI-style engine for tests/test_agent.py: healthy, lists one model, answers completions,
except that a prompt of ``"drop"`` gets its connection closed with no answer (an engine dying mid-request).

Usage: python tests/dropping_engine.py PORT
"""

from __future__ import annotations

import sys

from fakeengine import WHOLE, FakeEngineHandler, serve  # tests/fakeengine.py: a script's folder is on sys.path


class Handler(FakeEngineHandler):
    def do_POST(self) -> None:
        request = self.request_body()
        if request.get("prompt") == "drop":
            self.close_connection = True
            self.connection.close()
            return
        self.reply(WHOLE)


if __name__ == "__main__":
    serve(int(sys.argv[1]), Handler)
