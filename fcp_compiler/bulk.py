"""Bulk compile: a JSONL file of batches (one training step a line) into a folder of plans, on every core.

Resumable: a plan file is named by its step and inputs digest, and a step whose file exists is skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fcp_compiler.errors import InvalidInputError
from fcp_compiler.inputs import BatchSpec, parse_batch
from fcp_compiler.parallel import map_on_cores
from fcp_compiler.safe_io import parse_json, read_input_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class BulkSummary:
    """What a bulk compile did."""

    total: int
    compiled: int
    skipped: int
    wall_seconds: float
    compile_seconds: float  # summed over the plans compiled now
    worst_compute_imbalance: float
    worst_comm_imbalance: float


def read_jsonl(path: Path) -> list[BatchSpec]:
    """Parse every line of a JSONL batch file.

    Raises:
        InvalidInputError: naming the file and line of the first bad batch.
    """
    data = read_input_bytes(path, "batch")
    batches = []
    for number, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidInputError(f"{path}:{number}: not UTF-8 text (byte {raw[error.start]:#04x})") from None
        if not line.strip():
            continue
        batches.append(parse_batch(parse_json(line, f"{path}:{number}"), origin=f"{path}:{number}"))
    if not batches:
        raise InvalidInputError(f"batch file {str(path)!r} holds no batches")
    return batches


def _plan_name(step: int, digest: str) -> str:
    return f"step-{step:06d}-{digest[:16]}.fcp"


def _compile_one(job):
    step, batch, gpus, options, out_dir = job
    from fcp_compiler.pipeline import compile_plan

    plan = compile_plan(batch, gpus, **options)
    plan.write(Path(out_dir) / _plan_name(step, plan.header.inputs_digest))
    stats = plan.stats
    return step, stats["compile_seconds"], stats["compute_imbalance"], stats["comm_imbalance"]


def bulk_compile(batches: list[BatchSpec], out_dir: Path, gpus: int, jobs: int | None = None,
                 progress: Callable[[int, int], None] | None = None, **options) -> BulkSummary:
    """Compile every batch into out_dir, skipping those already there, with `jobs` processes (default: all cores).

    Raises:
        InvalidInputError: bad options (checked on the first batch before any work).
    """
    from fcp_compiler.pipeline import plan_digest

    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = []
    for step, batch in enumerate(batches):
        if not (out_dir / _plan_name(step, plan_digest(batch, gpus, **options))).exists():
            todo.append((step, batch, gpus, options, str(out_dir)))
    results = []
    done = len(batches) - len(todo)
    if progress:
        progress(done, len(batches))
    for result in map_on_cores(_compile_one, todo, jobs):
        results.append(result)
        done += 1
        if progress:
            progress(done, len(batches))
    return BulkSummary(total=len(batches), compiled=len(results), skipped=len(batches) - len(todo),
                       wall_seconds=time.perf_counter() - start,
                       compile_seconds=sum(r[1] for r in results),
                       worst_compute_imbalance=max((r[2] for r in results), default=0.0),
                       worst_comm_imbalance=max((r[3] for r in results), default=0.0))
