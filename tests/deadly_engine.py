"""A minimal engine for tests/test_request_of_death.py: primary, and answers completions (a stream with token ids,
as the gateway migrates them, or one JSON reply), except a request of death: one whose body holds ``DEADLY``, or
the continuation of one (its prompt ids begin with ``DEADLY_ID``, as its first chunk said), reaching any engine:

- ``kill``: the process exits with the request in flight (an engine the request crashes): a stream once its headers
  went out (an engine sends them as it starts a request, before the model sees it: docs/engine-contract.md), any
  other request before its headers;
- ``stall``: it stops answering anything, its health checks included (an engine whose event loop the request
  blocks), until it is killed; a stream after its first event, any other request before its headers.

Or ``queue``: every stream waits ``QUEUED_S`` before its headers (a full engine's queue), then is answered; its
``/primary`` answer counts those waiting (``waiting``).

Usage: python tests/deadly_engine.py PORT kill|stall|queue
"""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

DEADLY = "request of death"
DEADLY_ID = 666
QUEUED_S = 10.0
STALLED = threading.Event()
WAITING: list[int] = []  # one entry per stream waiting in the queue
CHUNK = {"id": "c", "object": "text_completion", "created": 1, "model": "fake"}
CHOICE = {"index": 0, "text": "x", "token_ids": [5], "prompt_token_ids": [1], "finish_reason": None}


def is_deadly(raw: bytes, body: dict) -> bool:
    prompt = body.get("prompt")
    return DEADLY.encode() in raw or (isinstance(prompt, list) and prompt[:1] == [DEADLY_ID])


def stall_forever() -> None:
    STALLED.set()
    threading.Event().wait()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    mode = "kill"

    def do_GET(self) -> None:  # /primary, /health/*
        if STALLED.is_set():
            stall_forever()
        answer = {"role": "primary", "state": "ready", "pid": os.getpid(), "waiting": len(WAITING)}
        self.reply("application/json", json.dumps(answer))

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers["content-length"]))
        body = json.loads(raw)
        stream, deadly = bool(body.get("stream")), is_deadly(raw, body)
        if deadly and self.mode == "kill" and not stream:
            os._exit(1)
        if stream and self.mode == "queue":
            WAITING.append(1)
            threading.Event().wait(QUEUED_S)
            WAITING.pop()
        if deadly and not stream:
            stall_forever()
        if not stream:
            self.reply("application/json", json.dumps(CHUNK | {"choices": [CHOICE | {"finish_reason": "length"}]}))
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        if deadly and self.mode == "kill":
            os._exit(1)
        self.event(CHUNK | {"choices": [CHOICE | ({"prompt_token_ids": [DEADLY_ID]} if deadly else {})]})
        if deadly:
            stall_forever()
        self.event(CHUNK | {"choices": [CHOICE | {"text": "", "token_ids": [], "finish_reason": "length"}]})
        self.event(CHUNK | {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        self.write(b"data: [DONE]\n\n")
        self.write(b"")

    def event(self, payload: dict) -> None:
        self.write(f"data: {json.dumps(payload)}\n\n".encode())

    def write(self, data: bytes) -> None:
        """One chunk of a chunked body (the empty one ends it)."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def reply(self, media: str, text: str) -> None:
        data = text.encode()
        self.send_response(200)
        self.send_header("content-type", media)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        pass


if __name__ == "__main__":
    Handler.mode = sys.argv[2]
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
