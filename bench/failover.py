"""Kill-to-first-successful-response over many failovers under steady load, through a load balancer.

    python bench/failover.py --lb gateway --rounds 20
    python bench/failover.py --lb haproxy --rounds 20 --device cuda:0 --model DIR

Runs ``hotweights drill kill-primary`` (its own stack: controller, daemon, 1 primary + 2 standbys,
the load balancer; torn down at the end) and reads its report: for each round, the time from the
SIGKILL of the primary to the first successful response to a request sent after it. The last stdout
line is one JSON object with ``p50_ms``, ``p99_ms``, ``max_ms``, ``client_errors`` and
``split_brain_samples``. Targets on CPU through the gateway: p50 <= 300 ms, p99 <= 1000 ms, no client
errors; no split-brain sample anywhere.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from hotweights.spawn import hotweights_command
from hotweights.stats import percentile

REPO = Path(__file__).resolve().parent.parent
TARGETS = {"p50_ms": 300.0, "p99_ms": 1000.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lb", choices=("gateway", "haproxy"), default="gateway")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--rps", type=float, default=10.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", help="checkpoint (default: the embedded tiny model)")
    args = parser.parse_args()
    report = Path(tempfile.mkdtemp(prefix="hw-failover-"))
    command = hotweights_command("drill", "kill-primary", "--lb", args.lb)
    command += ["--rounds", str(args.rounds), "--rps", str(args.rps), "--device", args.device, "--report", str(report)]
    if args.model:
        command += ["--model", args.model]
    drill = subprocess.run(command, cwd=REPO, check=False)
    rounds = json.loads((report / "report.json").read_text())["rounds"]
    times = [r["lb_convergence_ms"] for r in rounds if r.get("lb_convergence_ms") is not None]
    if not times:
        print(json.dumps({"error": f"no round measured a recovery; drill exit code {drill.returncode}"}))
        return 1
    result = {
        "lb": args.lb,
        "device": args.device,
        "rounds": len(rounds),
        "rps": args.rps,
        "p50_ms": round(percentile(times, 50), 1),
        "p99_ms": round(percentile(times, 99), 1),
        "max_ms": round(max(times), 1),
        "client_errors": sum(r["failed"] for r in rounds),
        "retried": sum(r.get("retried", 0) for r in rounds),  # the gateway's count; HAProxy reports none
        "split_brain_samples": sum(r["split_brain"] for r in rounds),
        "targets": TARGETS,
        "report": str(report),
    }
    result["met"] = {name: result[name] <= limit for name, limit in TARGETS.items()} | {
        "client_errors": result["client_errors"] == 0,
        "split_brain_samples": result["split_brain_samples"] == 0,
    }
    print(json.dumps(result))
    return 0 if drill.returncode == 0 else drill.returncode


if __name__ == "__main__":
    sys.exit(main())
