"""Bulk compile: a JSONL file of batches (one training step a line) into a folder of plans, on every core.

Resumable: a plan file is named by its step and inputs digest; a step whose file exists, reads back with every
sha256 intact and carries that digest is skipped, and a damaged one (cut short, empty, corrupt) is compiled again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fcp_compiler.core.options import CompileOptions
from fcp_compiler.errors import FcpError, InfeasibleError, InvalidInputError
from fcp_compiler.format.inputs import BatchSpec, parse_batch
from fcp_compiler.format.safe_io import parse_json, read_input_bytes
from fcp_compiler.tools.parallel import map_on_cores


@dataclass(frozen=True, slots=True, kw_only=True)
class BulkSummary:
    """What a bulk compile did."""

    total: int
    compiled: int
    skipped: int
    wall_seconds: float
    compile_seconds: float  # summed over the plans compiled now
    worst_compute_imbalance: float | None  # None: nothing was compiled (every plan was there already)
    worst_comm_imbalance: float | None


def read_jsonl(path: Path) -> list[BatchSpec]:
    """Parse every line of a JSONL batch file; each batch's `origin` is its file:line.

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
        origin = f"{path}:{number}"
        batches.append((origin, parse_batch(parse_json(line, origin), origin=origin)))
    if not batches:
        raise InvalidInputError(f"batch file {str(path)!r} holds no batches")
    return batches


def _plan_name(step: int, digest: str) -> str:
    return f"step-{step:06d}-{digest[:16]}.fcp"


def _compile_one(job):
    step, origin, batch, options, out_dir = job
    from fcp_compiler.core.pipeline import compile_plan

    try:
        plan = compile_plan(batch, options=options)
    except FcpError as error:  # named by its line, raised in the parent
        return step, f"{origin}: {error}", error.__class__.__name__
    plan.write(Path(out_dir) / _plan_name(step, plan.header.inputs_digest))
    stats = plan.stats
    return step, stats["compile_seconds"], stats["compute_imbalance"], stats["comm_imbalance"]


def _intact(path: Path, digest: str) -> bool:
    """Whether a plan file exists, reads back with every sha256 intact, and carries `digest`."""
    from fcp_compiler.format.plan_format import PlanReader

    if not path.exists():
        return False
    try:
        reader = PlanReader(str(path))
        reader.ranks()
    except FcpError:
        return False
    return reader.header.inputs_digest == digest


def bulk_compile(batches: list[tuple[str, BatchSpec]], out_dir: Path, options: CompileOptions,
                 jobs: int | None = None, progress: Callable[[int, int], None] | None = None) -> BulkSummary:
    """Compile every (origin, batch) into out_dir with the same options, skipping those already there intact, with
    `jobs` processes (default: all cores). Nothing is created when a batch is refused.

    Raises:
        InvalidInputError: bad options (checked before any work), or a batch the compiler refuses (named by its
            origin, file:line); InfeasibleError: a batch no plan can hold (named likewise).
    """
    from fcp_compiler.core.pipeline import plan_digest

    start = time.perf_counter()
    todo = []
    for step, (origin, batch) in enumerate(batches):
        try:
            digest = plan_digest(batch, options=options)
        except FcpError as error:
            raise error.__class__(f"{origin}: {error}") from None
        if not _intact(out_dir / _plan_name(step, digest), digest):
            todo.append((step, origin, batch, options, str(out_dir)))
    out_dir.mkdir(parents=True, exist_ok=True)
    # A run stopped mid-write leaves its temporary file (write_atomic's ".step-....fcp.XXXX"); a resume clears them.
    for stale in out_dir.glob(".step-*.fcp.*"):
        if stale.is_file() and not stale.is_symlink():
            stale.unlink()
    results = []
    done = len(batches) - len(todo)
    if progress:
        progress(done, len(batches))
    for result in map_on_cores(_compile_one, todo, jobs):
        if isinstance(result[1], str):
            raise (InfeasibleError if result[2] == "InfeasibleError" else InvalidInputError)(result[1])
        results.append(result)
        done += 1
        if progress:
            progress(done, len(batches))
    return BulkSummary(total=len(batches), compiled=len(results), skipped=len(batches) - len(todo),
                       wall_seconds=time.perf_counter() - start,
                       compile_seconds=sum(r[1] for r in results),
                       worst_compute_imbalance=max((r[2] for r in results), default=None),
                       worst_comm_imbalance=max((r[3] for r in results), default=None))
