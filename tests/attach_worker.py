"""An engine-like process for the cache tests: attaches, then answers commands on stdin.

One JSON reply per line on stdout. Commands: generate, checksum, digest, memory, fds, close, exit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from hotweights.cache.loadspec import LoadSpec
from hotweights.standby.model import generate
from hotweights.standby.weights import load_model
from hotweights.tokenizer import load_tokenizer

PROMPT = "The failover took"
CHUNK = 1 << 15  # elements per slice of a checksum (256 KiB in float64)


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's bytes: bitwise comparison across processes and devices."""
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def checksum(tensor: torch.Tensor) -> float:
    """The sum of a tensor's values in float64, a slice at a time: reads every page, and its temporaries stay small,
    so the allocator keeps no copy of a tensor that the memory command would count as the engine's own."""
    return float(sum(chunk.double().sum() for chunk in tensor.reshape(-1).split(CHUNK)))


def private_kib() -> int:
    rollup = Path("/proc/self/smaps_rollup").read_text().splitlines()
    return sum(int(line.split()[1]) for line in rollup if line.startswith(("Private_Clean", "Private_Dirty")))


def main() -> None:
    model_dir, socket_path, mode, device = sys.argv[1:5]
    torch.set_num_threads(1)
    before = private_kib()
    loaded = load_model(model_dir, LoadSpec(device=device), weight_cache=mode, socket_path=socket_path)
    tokenizer = load_tokenizer(loaded.checkpoint.path)
    print(json.dumps({"ready": True, "source": loaded.source, "private_kib_before": before}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "generate":
            ids = tokenizer.encode(PROMPT).ids
            reply = {"tokens": list(generate(loaded.model, ids, 12))}
        elif command == "checksum":
            reply = {"sums": {n: checksum(p) for n, p in loaded.model.state_dict().items()}}
        elif command == "digest":
            reply = {"digests": {n: tensor_digest(p) for n, p in loaded.model.state_dict().items()}}
        elif command == "memory":
            reply = {"private_kib": private_kib()}
        elif command == "fds":
            reply = {"fds": len(os.listdir("/proc/self/fd"))}
        elif command == "close":
            loaded.model = None
            if loaded.attachment is not None:
                loaded.attachment.close()
            reply = {"closed": True}
        elif command == "exit":
            return
        else:
            reply = {"error": f"unknown command {command!r}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
