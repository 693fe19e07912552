"""Every GPU check of the weight cache in one run on an H200 (CI has no GPU).

    python bench/gpu_suite.py --out DIR [--workdir /tmp/hw-gpu] [--skip STEP ...] [--only STEP ...]

A name given to --only or --skip also selects every step named NAME_*: ``--only engine`` runs the
engine section (engine_tests, engine_tiny, engine_medium, engine_xl, engine_xl_nographs,
engine_xl_invariant).

Steps, each a subprocess with its own time limit, so one failure or hang cannot sink the rest:
  tests     pytest of the CUDA-only tests (backends; daemon end to end with cuda-vmm and cuda-ipc,
            bf16 and block-FP8, SIGKILL of the daemon, restart)
  snapshot_read  bench/snapshot_read.py: ways to move a 16 GB tmpfs file onto the device (the loader's ring,
            deeper rings, registered windows, pageable copies), in GB/s
  backends  bench/gpu_backends_check.py: import times, read-only mapping, SIGKILL survival
  checkpoint  writes the 'xl' preset (~32 GB) to --workdir, generated on the GPU
  load      bench/load.py on that checkpoint: the off-mode pipeline onto the GPU
  attach    bench/attach.py: synthetic 1 / 10 / 80 GB arenas (>= 1000 tensors) with cuda-vmm,
            next to the off-mode load of the xl checkpoint
  attach_xl   a daemon serving the xl checkpoint from disk: off-mode load vs attach of the same weights
  engines   bench/gpu_engines.py on xl: memory of 1 primary + 3 standbys, daemon SIGKILL while serving
  engine_tests  pytest of tests/test_engine_cuda.py and tests/test_kvshare.py: decode CUDA graphs against
            eager steps, batched greedy against generate(), a standby reserving its KV cache and graphs; KV caches
            deposited in cuda-vmm memory, and a continuation from a hung and a killed primary's keys and values
  engine_tiny   bench/engine.py on the GPU (tiny model): promote time, health latency under load, tokens/s
  engine_medium, engine_xl  bench/engine.py on the medium and xl presets (written to --workdir if
            missing): batch-1 ms/token, batch_gain, first_after_promote_ratio, the standby's KV and
            CUDA graph bytes
  engine_xl_nographs  the same on xl with --no-cuda-graphs: the standby's memory without graphs
  engine_xl_invariant  the same on xl with --batch-invariant: what one decode shape and one prompt per prefill cost
  warmup_xl  bench/warmup.py on xl, twice on the same fresh Triton cache (cold, then as a later engine
            of the host finds it): start to ready by part (imports, context, load, eager prefills, each decode
            graph's first run and capture, prefill graphs, compile), the graphs captured, and decode ms per step at
            batch 1/2/4 and KV lengths 16/512/4096, split-KV against masked SDPA graphs (the result: the warm run)
  attach_ipc  the attach benchmark again with the cuda-ipc backend
  drill_medium, drill_xl  hotweights drill kill-primary hang-primary through the gateway, cuda-vmm, 8 rounds:
            medium at 20 requests/s, xl at 10 (reports in DIR/drill-medium, DIR/drill-xl)
  rollout_medium  bench/rollout.py on medium: a rolling restart and a model update under 10 requests/s, with a
            co-located batch engine (client_errors, answer_switches, batch_back_ms)
  rollout_xl  the same, the update moving the group from medium to xl
  drill_batch  hotweights drill preempt-batch kill-primary on medium at 20 requests/s (report in DIR/drill-batch)
  digest_tests  pytest of the CUDA tests of the arena digest, re-adoption and the loader
  teardown  bench/teardown.py: what a SIGKILLed engine's CUDA context teardown costs a live one, with and
            without the victim mapping a 32 GiB arena
  recover_xl  bench/recover.py on xl, its snapshot on /dev/shm (the disk cannot hold xl twice): re-adoption,
            snapshot from the page cache, disk fill, the digest's rate
  drill_daemon_xl  hotweights drill kill-daemon on xl at 10 requests/s: the controller's respawn from its spare
            daemon (respawn_ms), re-adopting, while the engines serve (report in DIR/drill-daemon-xl)
  drill_flapping_xl  hotweights drill flapping on xl at 10 requests/s: three primary kills a round, each as
            soon as a new primary serves, the replacements from the spare (report in DIR/drill-flapping-xl)
  launch_xl  bench/launch.py on xl: one standby's start to ready, forked from the stack's launcher against a fresh
            process, idle and beside 4 busy processes, with the engine's own breakdown (imports, context and attach,
            warm-up)
  redundancy_xl  bench/redundancy.py on xl at 10 requests/s, hotweights up's defaults (one spare): the primary
            SIGKILLed 10 times 10 s apart: time to full redundancy per fault, clients' extra latency, the primary's
            slowdown while engines warm up
  storm_xl  the same with a fault every 3 s, SIGKILL and SIGSTOP alternating
  gray_xl  bench/gray.py on xl at 10 requests/s, the defaults: the primary's inference loop stalled, slowed 20x, and
            made to answer wrong tokens (first success, switchover, fence), and the overload and long prompts that
            must cause no incident
  decode_step_xl  bench/decode_step.py on xl: a batch-1 decode step's device time by kernel against the HBM bound,
            each weight matrix's product through cuBLAS against a Triton GEMV, and one stream's ms a token through the
            engine's scheduler
  overload_medium  bench/overload.py on medium: admitted latency and refusals at 1x, 2x and 5x the measured capacity
  concurrency_xl  bench/concurrency.py on xl: two bursts of 64 concurrent greedy streams of 256 tokens through
            hotweights up with its defaults, the engines' KV pools and max_batch sized by the device (refused, errors,
            tokens/s against one stream alone: targets 0, 0 and at least 40x; fails unless met)
  migration_xl  bench/migration.py on xl: 64 greedy streams of 256 tokens in flight through the gateway at a SIGKILL
            and at a SIGSTOP of the primary (broken and mismatched streams, the largest gap at the cut)
  invariance_xl  bench/invariance.py on xl: which step shapes (prefill rows, decode batch size, KV length bucket,
            prefill against decode, a continuation's tokens prefilled against decoded at 40 and 300 tokens) change a
            sequence's logits, with the serving and the batch-invariant decoder
  migration_xl_invariant, storm_xl_invariant  migration_xl and storm_xl with batch-invariant engines
            (engine.batch_invariant: mismatched and wrong texts against what the padding costs)
  seeding_xl  bench/seeding.py on xl, cuda-vmm, loopback: a daemon filled from a peer daemon (through pinned buffers
            into device memory) against a raw TCP copy of as many bytes in the same run (seed_gbps, raw_gbps, ratio,
            digest_verified, disk_bytes_read), a primary engine of the source daemon serving 10 completions a second
            throughout (its p50 while a seeding runs over its p50 before: serving.slowdown), and device_link
Results go to DIR/gpu_suite.json and every step's output to DIR/steps.log; the drills' report folders
are packed into DIR/reports.tar (a few files to copy back from a remote GPU machine); the last stdout line is
one JSON object. Exits 1 if any step failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def steps(workdir: Path, out: Path) -> dict[str, tuple[list[str], int]]:
    """name -> (command, time limit in s), in the order they run."""
    xl, medium = (shlex.quote(str(p)) for p in (workdir / "xl", workdir / "medium"))
    hw = f"{shlex.quote(sys.executable)} -m hotweights"
    bench = f"{shlex.quote(sys.executable)} bench"
    synthetic = "--device cuda:0 --source synthetic --sizes-gb 1,10,80"
    pytest = f"{shlex.quote(sys.executable)} -m pytest -q -m cuda -p no:cacheprovider"
    engine_bench = f"{bench}/engine.py --device cuda:0 --cycles 20 --gen-tokens 256 --max-batch 4"
    # Twice on one fresh compile cache and kernel verdict (``standby.kernelcheck``): cold, then as a later engine of the
    # host finds them.
    fresh = f"c=$(mktemp -d -p {shlex.quote(str(workdir))})"
    caches = f"{fresh} && export TRITON_CACHE_DIR=$c/triton HOTWEIGHTS_HOME=$c/home"
    warmup = f"{caches} && for run in cold warm; do {bench}/warmup.py --model {xl} --steps 20 || exit 1; done"

    rollout = f"{bench}/rollout.py --device cuda:0 --rps 10"
    redundancy = f"{bench}/redundancy.py --model {xl} --device cuda:0 --rps 10 --keep-logs"
    # A Triton cache of its own, empty: the engines compile their kernels at once, as on a fresh machine, and a
    # continuation's text must not depend on which engine compiled what (``standby.fused``).
    cold = f"TRITON_CACHE_DIR=$(mktemp -d -p {shlex.quote(str(workdir))})"
    migration = f"{cold} {bench}/migration.py --model {xl} --device cuda:0 --streams 64 --max-tokens 256"

    def drill_at(name: str, path: str, rps: int, scenarios: str = "kill-primary hang-primary", rounds: int = 8) -> str:
        """``scenarios`` through the gateway, cuda-vmm, at ``rps`` requests/s, report in DIR/drill-NAME."""
        report = shlex.quote(str(out / f"drill-{name}"))
        return f"{hw} drill {scenarios} --rounds {rounds} --model {path} --device cuda:0 --rps {rps} --report {report}"

    drill_batch = drill_at("batch", medium, 20, "preempt-batch kill-primary", 4)

    def make(preset: str, path: str) -> str:
        """Write the preset's checkpoint unless an earlier step did."""
        return f"(test -f {path}/config.json || {hw} make-model {path} --preset {preset} --device cuda --force --quiet)"

    commands = {
        "tests": (f"{pytest} tests/test_cuda_backends.py tests/test_cache_cuda.py", 240),
        "snapshot_read": (f"{bench}/snapshot_read.py --device cuda:0 --gb 16", 300),
        "backends": (f"{bench}/gpu_backends_check.py", 180),
        "checkpoint": (f"{hw} make-model {xl} --preset xl --device cuda --force --quiet", 300),
        "load": (f"{make('xl', xl)} && {bench}/load.py --model {xl} --device cuda:0", 300),
        "attach": (f"{bench}/attach.py {synthetic} --repeats 10 --load-model {xl}", 400),
        "attach_xl": (f"{bench}/attach.py --device cuda:0 --models {xl} --repeats 10", 240),
        "engines": (f"{make('xl', xl)} && {bench}/gpu_engines.py --model {xl} --device cuda:0 --standbys 3", 420),
        "engine_tests": (f"{pytest} tests/test_engine_cuda.py tests/test_kvshare.py", 300),
        "engine_tiny": (f"{bench}/engine.py --device cuda:0 --cycles 50 --gen-tokens 500", 180),
        "engine_medium": (f"{make('medium', medium)} && {engine_bench} --model {medium}", 240),
        "engine_xl": (f"{make('xl', xl)} && {engine_bench} --model {xl}", 420),
        "engine_xl_nographs": (f"{make('xl', xl)} && {engine_bench} --model {xl} --no-cuda-graphs", 300),
        "engine_xl_invariant": (f"{make('xl', xl)} && {engine_bench} --model {xl} --batch-invariant", 420),
        "warmup_xl": (f"{make('xl', xl)} && {warmup}", 480),
        # Drill loads: medium at 20 requests/s, xl at 10 (batched decode serves them).
        "drill_medium": (f"{make('medium', medium)} && {drill_at('medium', medium, 20)}", 300),
        "drill_xl": (f"{make('xl', xl)} && {drill_at('xl', xl, 10)}", 420),
        "attach_ipc": (f"{bench}/attach.py {synthetic} --repeats 5 --backend cuda-ipc", 300),
        # Rollouts, model updates and a co-located batch engine on the GPU.
        "rollout_medium": (f"{make('medium', medium)} && {rollout} --model {medium} --preset medium", 420),
        "rollout_xl": (
            f"{make('medium', medium)} && {make('xl', xl)} && {rollout} --model {medium} --new-model {xl}",
            600,
        ),
        "drill_batch": (f"{make('medium', medium)} && {drill_batch}", 300),
        # Re-adoption and snapshots at the device's speed; what a kill costs the survivors.
        "digest_tests": (f"{pytest} tests/test_digest.py tests/test_recover.py tests/test_loader.py", 300),
        "teardown": (f"{bench}/teardown.py && {bench}/teardown.py --no-import", 120),
        "recover_xl": (f"{make('xl', xl)} && {bench}/recover.py --device cuda:0 --model {xl} --tmp /dev/shm", 500),
        "drill_daemon_xl": (f"{make('xl', xl)} && {drill_at('daemon-xl', xl, 10, 'kill-daemon', 4)}", 420),
        "drill_flapping_xl": (f"{make('xl', xl)} && {drill_at('flapping-xl', xl, 10, 'flapping', 3)}", 420),
        "launch_xl": (f"{make('xl', xl)} && {bench}/launch.py --model {xl} --device cuda:0 --trials 3 --load 4", 420),
        "redundancy_xl": (
            f"{make('xl', xl)} && {redundancy} {out / 'logs-redundancy-xl'} --faults 10 --interval 10 --signals kill",
            540,
        ),
        "storm_xl": (
            f"{make('xl', xl)} && {redundancy} {out / 'logs-storm-xl'} --faults 10 --interval 3 --signals kill,stop",
            540,
        ),
        "gray_xl": (
            f"{make('xl', xl)} && {bench}/gray.py --model {xl} --device cuda:0 --keep-logs {out / 'logs-gray-xl'}",
            540,
        ),
        "decode_step_xl": (f"{make('xl', xl)} && {bench}/decode_step.py --model {xl} --device cuda:0", 300),
        "overload_medium": (f"{make('medium', medium)} && {bench}/overload.py --device cuda:0 --model {medium}", 300),
        "concurrency_xl": (
            f"{make('xl', xl)} && {bench}/concurrency.py --model {xl} --device cuda:0 --streams 64 --max-tokens 256 "
            "--min-speedup 40 --exit-unmet",
            540,
        ),
        "migration_xl": (
            f"{make('xl', xl)} && {migration}",
            540,
        ),
        "invariance_xl": (f"{make('xl', xl)} && {bench}/invariance.py --model {xl} --device cuda:0", 300),
        "migration_xl_invariant": (
            f"{make('xl', xl)} && {migration} --batch-invariant",
            540,
        ),
        "seeding_xl": (
            f"{make('xl', xl)} && {bench}/seeding.py --device cuda:0 --model {xl} --backend cuda-vmm",
            600,
        ),
        "storm_xl_invariant": (
            f"{make('xl', xl)} && {redundancy} {out / 'logs-storm-xl-invariant'} --faults 10 --interval 3 "
            "--signals kill,stop --batch-invariant",
            540,
        ),
    }
    return {name: (["bash", "-c", command], limit) for name, (command, limit) in commands.items()}


def run_step(command: list[str], env: dict[str, str], limit: int, log: Path) -> tuple[int, str]:
    """(exit code, stdout); past ``limit`` the step's whole process group is killed (rc 124). Its stderr goes
    to ``log`` as it comes (so a run cut short keeps how far each step got), its stdout after it ends. Whatever
    the step left running in its group (an engine, a daemon) is killed when it ends."""
    with log.open("a") as errors:
        errors.write(f"$ {' '.join(command)}\n--- stderr\n")
        errors.flush()
        step = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=errors, text=True, start_new_session=True
        )
        try:
            stdout, _ = step.communicate(timeout=limit)
            rc = step.returncode
        except subprocess.TimeoutExpired:
            os.killpg(step.pid, signal.SIGKILL)
            stdout, _ = step.communicate()
            rc = 124
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(step.pid, signal.SIGKILL)
        errors.write(f"--- stdout\n{stdout}\n")
    return rc, stdout


def selected(name: str, names: list[str]) -> bool:
    """Whether ``names`` (of --only or --skip) names this step or a section it belongs to (``NAME_*``)."""
    return any(name == n or name.startswith(f"{n}_") for n in names)


def last_json(text: str) -> object:
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def pack_reports(out: Path) -> None:
    """Move every report folder under ``out`` into ``out/reports.tar``."""
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    if not folders:
        return
    with tarfile.open(out / "reports.tar", "w") as tar:
        for folder in folders:
            tar.add(folder, arcname=folder.name)
    for folder in folders:
        shutil.rmtree(folder)


def write_summary(out: Path, results: dict[str, dict]) -> dict:
    """Write DIR/gpu_suite.json for the steps run so far and return it."""
    summary = {"ok": all(r["rc"] == 0 for r in results.values()), "date": time.strftime("%Y-%m-%d"), **results}
    (out / "gpu_suite.json").write_text(json.dumps(summary, indent=2))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hw-gpu"))
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--only", nargs="*", default=[])
    args = parser.parse_args()
    # SIGTERM (``timeout``) unwinds like SIGINT: the running step's group is killed, the reports packed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    results: dict[str, dict] = {}
    try:
        for name, (command, limit) in steps(args.workdir, args.out).items():
            if selected(name, args.skip) or (args.only and not selected(name, args.only)):
                continue
            start = time.perf_counter()
            log = args.out / "steps.log"  # one file: the device returns at most 8
            with log.open("a") as header:
                header.write(f"=== {name}\n")
            rc, stdout = run_step(command, env, limit, log)
            if name.endswith("tests") and rc == 0 and "skipped" in stdout:
                rc = 3  # on the GPU every CUDA test must run
            seconds = round(time.perf_counter() - start, 1)
            results[name] = {"rc": rc, "seconds": seconds, "result": last_json(stdout)}
            print(f"{name:12s} rc={rc} {seconds:7.1f} s  {json.dumps(results[name]['result'])[:300]}", flush=True)
            write_summary(args.out, results)  # after every step: a run cut short keeps what it measured
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
        pack_reports(args.out)
    summary = write_summary(args.out, results)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
