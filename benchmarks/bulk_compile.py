"""Bulk compile throughput: 200 paper-like batches at 64 GPUs, one process vs every core; and how fast Ctrl-C or
SIGTERM stops a running bulk compile with its workers (--stop-latency; the suite only checks that it stops).

Usage: python benchmarks/bulk_compile.py [--batches 200] [--gpus 64] [--stop-latency]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fcp_compiler import CompileOptions
from fcp_compiler.tools.bulk import bulk_compile
from fcp_compiler.format.inputs import parse_batch
from fcp_compiler.tools.traces import lognormal_batch


ROOT = Path(__file__).resolve().parents[1]


def _workers(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def stop_latency(gpus: int, stop: signal.Signals) -> float:
    """Seconds from `stop` to the exit of a bulk compile of 200 batches running on two workers, workers included."""
    with tempfile.TemporaryDirectory() as folder:
        steps = Path(folder) / "steps.jsonl"
        steps.write_text("\n".join(json.dumps(lognormal_batch(gpus * 32768, 4096, 1.8, 64, 524288, seed))
                                    for seed in range(200)) + "\n")
        process = subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "compile", str(steps), "--gpus", str(gpus),
                                    "-o", str(Path(folder) / "plans"), "--jobs", "2", "-q"],
                                   stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while len(_workers(process.pid)) < 2 and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        workers = _workers(process.pid)
        started = time.perf_counter()
        process.send_signal(stop)
        process.wait(timeout=60)
        while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.perf_counter() - started < 60:
            time.sleep(0.01)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--stop-latency", action="store_true", help="only the stop latency, median of 3 a signal")
    args = parser.parse_args()
    if args.stop_latency:
        for stop in (signal.SIGINT, signal.SIGTERM):
            seconds = [stop_latency(args.gpus, stop) for _ in range(3)]
            print(f"{stop.name}: a bulk compile and its workers stop in {statistics.median(seconds):.3f} s "
                  f"(median of 3; {', '.join(f'{s:.3f}' for s in seconds)})")
        return
    batches = [(f"seed {seed}", parse_batch(lognormal_batch(args.gpus * 32768, 4096, 1.8, 64, 524288, seed)))
               for seed in range(args.batches)]
    cores = os.cpu_count() or 1
    walls = {}
    for jobs in (1, cores):
        with tempfile.TemporaryDirectory() as folder:
            summary = bulk_compile(batches, Path(folder), CompileOptions.of(args.gpus), jobs=jobs)
            walls[jobs] = summary.wall_seconds
            print(f"jobs {jobs}: {summary.compiled} plans in {summary.wall_seconds:.2f} s "
                  f"({summary.wall_seconds / summary.compiled * 1e3:.0f} ms a plan wall, "
                  f"{summary.compile_seconds / summary.compiled * 1e3:.0f} ms compile each)")
    print(f"{cores} processes take {walls[cores] / walls[1]:.2f}x the single-process wall time")


if __name__ == "__main__":
    main()
