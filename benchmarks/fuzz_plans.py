"""Mutation fuzzing of plan files through every reader.

Usage: python benchmarks/fuzz_plans.py [--mutants 10000] [--jobs 2] [--seed 0] [--timeout 20] [--replay 8]

Compiles plans of several sizes and kinds (plan and user layout, causal and full, offloaded tiles, relays) and
mutates each at random:
- bytes: a bit flipped, a byte set, the file cut short or extended (the sha256s must catch these);
- arrays: one element of a rank's or the global section's arrays set, nudged by one, swapped with another, dropped
  or duplicated, or a header field changed, and the plan re-sealed with valid sha256s, so that the structural
  checks and the validator are what stands between the mutant and the runtime;
- paired: a change that keeps both ends consistent: one rank's reshuffle runs regrouped across peers (send or
  receive side), one rank's received pulls listed in another order, one segment listed twice in a pull at both
  ends, or one pull moved to another round at its sender and its receiver.

Every mutant goes through `fcp validate`, `fcp inspect` (all ranks and one), `fcp simulate` and `fcp diff` in
process (cli.main), and through load_rank_program and load_rank_plan for every rank. A case passes when every
command exits 0, 1 or 2 (never 3, an internal error) and every library reader returns or raises FcpError. Each
case runs under a timeout (SIGALRM, a hang if it fires); the workers' peak RSS bounds every case's memory. A mutant
that `fcp validate` accepts must be identical in meaning to its source (`fcp diff --fail-on change` exits 0) or
replay exactly on gloo against the dense reference with messages matched by posting order (as NCCL matches
them), and dispatch() and undispatch() move exactly the plan's tokens: up to --replay such mutants are replayed,
the paired ones first (received pulls listed in another order are replayed even when identical in meaning).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cli import main as fcp  # noqa: E402
from fcp_compiler import compile_plan  # noqa: E402
from fcp_compiler.errors import FcpError  # noqa: E402
from fcp_compiler.format.inputs import PRESET_PROFILES  # noqa: E402
from fcp_compiler.format.plan_format import GLOBAL_ARRAYS, PlanReader, assemble, load_rank_program  # noqa: E402

SLOW_NETWORK = PRESET_PROFILES["h100"].model_copy(update={"network_gbps": 0.05, "nvlink_gbps": 0.05,
                                                          "gpus_per_node": 2})
SOURCES = {  # name: (lengths, gpus, compile options)
    "causal-4": ([700, 90, 1500, 33, 260, 1200, 64], 4, dict(block_size=256, coalesce=1)),
    "full-user-4": ([700, 90, 1500, 33, 260, 1200, 64], 4, dict(block_size=256, coalesce=3, mask="full",
                                                                layout="user")),
    "offloaded-8": ([2048, 100, 60], 8, dict(block_size=512, coalesce=2, mask="full")),
    "relayed-8": ([563, 209, 3467, 1669, 298, 1939], 8, dict(block_size=128, coalesce=2, zigzag="off",
                                                             profile=SLOW_NETWORK)),
    # Node fan-out with NVLink lanes: one pair may exchange two messages in a round.
    "fan-out-8": ([3000, 1200, 700, 300, 90], 8, dict(block_size=128, coalesce=2, gpus_per_node=2)),
}
# Mutants whose meaning is the source's but whose posting order per pair may differ: replayed like changed ones.
REPLAYED_WHEN_IDENTICAL = ("paired pull_recv order",)
HEADER_FIELDS = ("num_ranks", "block_size", "coalesce", "bwd_coalesce", "token_cap", "zigzag", "mask",
                 "num_sequences", "total_tokens", "num_blocks", "layout", "num_rounds", "num_fwd_rounds",
                 "num_bwd_rounds", "num_fwd_stages", "num_bwd_stages", "recv_buffer_tokens", "max_buffer_tokens",
                 "pipelined", "rounds_kind", "reshuffle_overlap", "nvlink_lanes", "nvlink_degree", "nic_degree",
                 "profile.gpus_per_node")


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def _mutate_bytes(data: bytes, rng) -> tuple[bytes, str]:
    data = bytearray(data)
    kind = rng.integers(4)
    at = int(rng.integers(len(data)))
    if kind == 0:
        data[at] ^= 1 << int(rng.integers(8))
        return bytes(data), "bit"
    if kind == 1:
        data[at] = int(rng.integers(256))
        return bytes(data), "byte"
    if kind == 2:
        return bytes(data[:at]), "cut"
    return bytes(data) + bytes(rng.integers(256, size=int(rng.integers(1, 64))).astype(np.uint8)), "extend"


def _mutate_array(values: np.ndarray, rng) -> np.ndarray:
    values = values.copy()
    if values.size == 0:
        return np.append(values, int(rng.integers(-2, 8)))
    at = int(rng.integers(values.size))
    kind = rng.integers(5)
    if kind == 0:
        values[at] = int(rng.integers(-2, max(int(values.max()), 1) + 3))
    elif kind == 1:
        values[at] += 1 if rng.integers(2) else -1
    elif kind == 2:
        other = int(rng.integers(values.size))
        values[[at, other]] = values[[other, at]]
    elif kind == 3:
        values = np.delete(values, at)
    else:
        values = np.insert(values, at, values[at])
    return values


def _mutate_header(fields: dict, rng) -> str:
    name = HEADER_FIELDS[int(rng.integers(len(HEADER_FIELDS)))]
    if name == "profile.gpus_per_node":  # the node size: which messages are NVLink and which NIC
        profile = dict(fields["profile"])
        size = int(profile["gpus_per_node"])
        profile["gpus_per_node"] = size + int(rng.choice([-1, 1, 2 - size]))
        fields["profile"] = profile
        return f"header {name}"
    value = fields[name]
    if isinstance(value, bool):
        fields[name] = not value
    elif name == "mask":
        fields[name] = "full" if str(getattr(value, "value", value)) == "causal" else "causal"
    elif name == "layout":
        fields[name] = "user" if str(getattr(value, "value", value)) == "plan" else "plan"
    elif name == "rounds_kind":
        fields[name] = "arbitrary" if value == "matching" else "matching"
    else:
        fields[name] = int(value) + int(rng.choice([-1, 1, int(rng.integers(-value, 2 * value + 2))]))
    return f"header {name}"


def _regroup_reshuffle(arrays: dict, side: str, rng) -> bool:
    """Reorder one rank's reshuffle runs across peers (each peer's runs kept in order): the runtime's
    all_to_all_single and dispatch() need them grouped by peer in ascending order. False: nothing to reorder."""
    peers = arrays[f"reshuffle_{side}_peer"]
    if np.unique(peers).size < 2:
        return False
    rank_of_peer = rng.permutation(int(peers.max()) + 1)
    order = np.lexsort((np.arange(peers.size), rank_of_peer[peers]))
    if (order == np.arange(peers.size)).all():
        order = np.lexsort((np.arange(peers.size), -peers))
    for name in ("peer", "offset", "length"):
        arrays[f"reshuffle_{side}_{name}"] = arrays[f"reshuffle_{side}_{name}"][order]
    return True


def _move_message(ranks: list[dict], rng) -> bool:
    """Move one pull to another forward round at both ends (sender's and receiver's rows agree, as a compiler bug
    that keeps the pair consistent would)."""
    senders = [rank for rank, arrays in enumerate(ranks) if arrays["pull_send_round"].size]
    if not senders:
        return False
    sender = senders[int(rng.integers(len(senders)))]
    send = ranks[sender]
    row = int(rng.integers(send["pull_send_round"].size))
    receiver, block, kind = (int(send[f"pull_send_{name}"][row]) for name in ("peer", "block", "kind"))
    recv = ranks[receiver]
    match = np.flatnonzero((recv["pull_recv_peer"] == sender) & (recv["pull_recv_block"] == block)
                           & (recv["pull_recv_kind"] == kind))
    if match.size != 1:
        return False
    new_round = int(rng.integers(0, int(send["pull_send_round"].max()) + 2))
    for arrays, name, at in ((send, "pull_send_round", row), (recv, "pull_recv_round", int(match[0]))):
        arrays[name] = arrays[name].copy()
        arrays[name][at] = new_round
    return True


def permute_received_pulls(arrays: dict, order: np.ndarray) -> None:
    """Reorder one rank's pull_recv rows (new row i is old row order[i]), every reference to them renumbered: the
    same plan in meaning, with this rank listing its received pulls in another order than their senders do."""
    counts = arrays["pull_recv_seg_count"]
    first = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    arrays["pull_recv_segs"] = np.concatenate([arrays["pull_recv_segs"][first[row]:first[row] + counts[row]]
                                               for row in order] or [arrays["pull_recv_segs"]])
    for name in ("round", "bwd_round", "kind", "block", "peer", "seg_count"):
        arrays[f"pull_recv_{name}"] = arrays[f"pull_recv_{name}"][order]
    new_row = np.empty(order.size, dtype=np.int64)
    new_row[order] = np.arange(order.size)
    source = arrays["pull_send_source"]
    arrays["pull_send_source"] = np.where(source >= 0, new_row[np.maximum(source, 0)], -1)
    for name in ("fwd_push_send_pull", "bwd_push_send_pull"):
        arrays[name] = new_row[arrays[name]]


def _reorder_received(ranks: list[dict], rng) -> bool:
    """Reverse one rank's pull_recv rows (both ends stay consistent; only the posting order per pair can change)."""
    receivers = [rank for rank, arrays in enumerate(ranks) if arrays["pull_recv_round"].size > 1]
    if not receivers:
        return False
    arrays = ranks[receivers[int(rng.integers(len(receivers)))]]
    permute_received_pulls(arrays, np.arange(arrays["pull_recv_round"].size)[::-1])
    return True


def duplicate_segment(ranks: list[dict], sender: int, row: int) -> bool:
    """List the first segment of one pull's explicit segment list twice, at its sender and its receiver alike.
    False: the row lists no segments (a whole block)."""
    send = ranks[sender]
    count = send["pull_send_seg_count"]
    if count[row] == 0:
        return False
    receiver, block, kind = (int(send[f"pull_send_{name}"][row]) for name in ("peer", "block", "kind"))
    recv = ranks[receiver]
    match = np.flatnonzero((recv["pull_recv_peer"] == sender) & (recv["pull_recv_block"] == block)
                           & (recv["pull_recv_kind"] == kind))
    for arrays, side, at in ((send, "send", row), (recv, "recv", int(match[0]))):
        counts = arrays[f"pull_{side}_seg_count"]
        start = int(counts[:at].sum())
        segs = arrays[f"pull_{side}_segs"]
        arrays[f"pull_{side}_segs"] = np.insert(segs, start + int(counts[at]), segs[start])
        arrays[f"pull_{side}_seg_count"] = counts + (np.arange(counts.size) == at)
    return True


def _duplicate_some_segment(ranks: list[dict], rng) -> bool:
    listed = [(rank, row) for rank, arrays in enumerate(ranks)
              for row in np.flatnonzero(arrays["pull_send_seg_count"] > 0).tolist()]
    if not listed:
        return False
    return duplicate_segment(ranks, *listed[int(rng.integers(len(listed)))])


def _mutate_paired(ranks: list[dict], rng) -> str | None:
    """A mutation that keeps both ends of what it touches consistent, so that only the meaning can be wrong."""
    choice = rng.random()
    if choice < 0.4:
        rank, side = int(rng.integers(len(ranks))), ("send", "recv")[int(rng.integers(2))]
        return f"paired reshuffle_{side} peer order" if _regroup_reshuffle(ranks[rank], side, rng) else None
    if choice < 0.6:
        return "paired pull_recv order" if _reorder_received(ranks, rng) else None
    if choice < 0.8:
        return "paired duplicate segment" if _duplicate_some_segment(ranks, rng) else None
    return "paired pull round" if _move_message(ranks, rng) else None


def mutate(source: bytes, rng) -> tuple[bytes | None, str]:
    """One mutant of a plan's bytes and a label of what changed (None: the mutation built no plan)."""
    if rng.random() < 0.25:
        return _mutate_bytes(source, rng)
    reader = PlanReader(source)
    fields = reader.header.model_dump(exclude={"global_section", "rank_sections", "global_sha256", "rank_sha256"})
    tables = {name: getattr(reader.tables, name) for name in GLOBAL_ARRAYS}
    ranks = [dict(program.arrays) for program in reader.ranks()]
    choice = rng.random()
    if choice < 0.1:
        label = _mutate_paired(ranks, rng)
        if label is None:
            return None, "paired"
    elif choice < 0.25:
        label = _mutate_header(fields, rng)
    elif choice < 0.35:
        name = GLOBAL_ARRAYS[int(rng.integers(len(GLOBAL_ARRAYS)))]
        tables[name] = _mutate_array(tables[name], rng)
        label = f"global {name}"
    else:
        rank = int(rng.integers(len(ranks)))
        names = sorted(ranks[rank])
        name = names[int(rng.integers(len(names)))]
        ranks[rank][name] = _mutate_array(ranks[rank][name], rng)
        label = f"rank array {name}"
    try:
        return assemble(fields, tables, ranks), label
    except (ValueError, AssertionError, TypeError):  # pydantic refuses the header, or a value leaves int32
        return None, label


@dataclass
class Outcome:
    cases: int = 0
    skipped: int = 0
    accepted: list = field(default_factory=list)  # (source, mutant path, label) accepted by validate
    bugs: list = field(default_factory=list)  # (label, where, error)
    hangs: list = field(default_factory=list)
    peak_rss_mb: float = 0.0
    rss_growth_mb: float = 0.0  # the peak above the worker's resident memory when it started
    kinds: dict = field(default_factory=dict)


def _run_cli(args: list[str]) -> int:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        code = fcp(args)
    if code not in (0, 1, 2):
        raise RuntimeError(f"fcp {' '.join(args[:1])} exited {code}: {err.getvalue().strip()[:200]}")
    return code


def _readers(source_path: str, path: str, data: bytes) -> int:
    """Every reader on one mutant; returns validate's exit code. Raises on a bug."""
    code = _run_cli(["validate", path])
    for args in (["inspect", path], ["inspect", path, "--rank", "0"], ["simulate", path],
                 ["diff", source_path, path]):
        _run_cli(args)
    from fcp_runtime.plan import load_rank_plan

    for load in (load_rank_program, load_rank_plan):
        for rank in range(8):
            try:
                load(data, rank)
            except FcpError:
                pass
    return code


def run_chunk(job) -> Outcome:
    """Fuzz `count` mutants of the sources with one seed (a worker)."""
    seed, count, timeout, sources, folder = job
    rng = np.random.default_rng(seed)
    outcome = Outcome()
    # A forked worker starts with its parent's resident memory as its high-water mark: what the cases themselves
    # allocate is the growth above that.
    start_mb = _resident_mb()
    signal.signal(signal.SIGALRM, _alarm)
    names = sorted(sources)
    case = 0
    while outcome.cases < count:  # `count` mutants that built a plan
        case += 1
        name = names[int(rng.integers(len(names)))]
        data, label = mutate(sources[name], rng)
        kind = " ".join(label.split()[:2]) if label.startswith("paired") else label.split()[0]
        outcome.kinds[kind] = outcome.kinds.get(kind, 0) + 1
        if data is None:
            outcome.skipped += 1
            continue
        path = os.path.join(folder, f"mutant-{seed}-{case}.fcp")
        Path(path).write_bytes(data)
        signal.alarm(timeout)
        try:
            code = _readers(os.path.join(folder, f"{name}.fcp"), path, data)
            if code == 0:
                outcome.accepted.append((name, path, label))
            else:
                os.unlink(path)
        except Hang:
            outcome.hangs.append((name, label))
        except Exception as error:  # noqa: BLE001 - every other exception is a bug this run reports
            outcome.bugs.append((name, label, f"{error.__class__.__name__}: {str(error)[:200]}"))
        finally:
            signal.alarm(0)
        outcome.cases += 1
    outcome.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    outcome.rss_growth_mb = max(0.0, outcome.peak_rss_mb - start_mb)
    return outcome


def _resident_mb() -> float:
    """This process's resident memory now (Linux; elsewhere its high-water mark so far)."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def replay_exactly(path: str) -> None:
    """Replay a plan on gloo against the dense reference, messages matched by posting order, and dispatch() and
    undispatch() (raises on a mismatch)."""
    import torch
    from runtime_harness import compare_with_reference, dispatch_round_trip, run_ranks

    reader = PlanReader(path)
    header = reader.header
    lengths = reader.tables.seq_lengths.tolist()
    data = Path(path).read_bytes()
    windows = reader.tables.seq_window.tolist()
    # Every message with tag 0: gloo matches a pair's messages by posting order, as NCCL does.
    run_ranks(header.num_ranks, compare_with_reference(data, lengths, windows, 2, 1, torch.float64,
                                                       header.layout.value, order_matching=True))
    run_ranks(header.num_ranks, dispatch_round_trip(data, sum(lengths)))


def compile_sources(folder: str) -> dict[str, bytes]:
    sources = {}
    for name, (lengths, gpus, options) in SOURCES.items():
        # FCP's own placement: the sources must carry the mechanisms they name (relays, fan-out, offloads), not
        # whichever candidate the floor would keep.
        sources[name] = compile_plan(lengths, gpus, **{"floor": False, **options}).to_bytes()
        Path(folder, f"{name}.fcp").write_bytes(sources[name])
    return sources


def fuzz(num_mutants: int, jobs: int, seed: int, timeout: int, replay: int, folder: str) -> dict:
    """Run the campaign; returns its figures (see the module docstring)."""
    sources = compile_sources(folder)
    chunk = -(-num_mutants // jobs)
    work = [(seed * 1000 + j, min(chunk, num_mutants - j * chunk), timeout, sources, folder) for j in range(jobs)]
    with get_context("fork").Pool(jobs) as pool:
        outcomes = pool.map(run_chunk, work)
    accepted = [item for o in outcomes for item in o.accepted]
    changed = []
    for name, path, label in accepted:
        with contextlib.redirect_stdout(io.StringIO()):
            if fcp(["diff", os.path.join(folder, f"{name}.fcp"), path, "--fail-on", "change"]) != 0 \
                    or label in REPLAYED_WHEN_IDENTICAL:
                changed.append((name, path, label))
    replayed, mismatched = 0, []
    changed.sort(key=lambda item: not item[2].startswith("paired"))  # stable: paired mutants replay first
    for name, path, label in changed[:replay]:
        try:
            replay_exactly(path)
            replayed += 1
        except Exception as error:  # noqa: BLE001
            mismatched.append((name, label, f"{error.__class__.__name__}: {str(error)[:200]}"))
    kinds: dict = {}
    for o in outcomes:
        for key, value in o.kinds.items():
            kinds[key] = kinds.get(key, 0) + value
    accepted_paired: dict = {}
    for _, _, label in accepted:
        if label.startswith("paired"):
            accepted_paired[label] = accepted_paired.get(label, 0) + 1
    return {"mutants": sum(o.cases for o in outcomes), "not_built": sum(o.skipped for o in outcomes),
            "kinds": kinds, "accepted_paired": accepted_paired, "accepted": len(accepted),
            "accepted_identical": len(accepted) - len(changed),
            "accepted_changed": len(changed), "replayed_exactly": replayed, "replay_mismatches": mismatched,
            "bugs": [b for o in outcomes for b in o.bugs], "hangs": [h for o in outcomes for h in o.hangs],
            "peak_rss_mb": max(o.peak_rss_mb for o in outcomes),
            "rss_growth_mb": max(o.rss_growth_mb for o in outcomes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=10000)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=20, help="seconds a case may take before it counts as a hang")
    parser.add_argument("--replay", type=int, default=8, help="accepted, changed mutants to replay on gloo")
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        figures = fuzz(args.mutants, args.jobs, args.seed, args.timeout, args.replay, folder)
    print(f"{figures['mutants']} mutants ({figures['not_built']} more mutations built no plan) in "
          f"{time.perf_counter() - start:.0f} s, by kind {figures['kinds']}")
    print(f"accepted by validate: {figures['accepted']} ({figures['accepted_identical']} identical in meaning to "
          f"their source, {figures['accepted_changed']} changed; {figures['replayed_exactly']} of those replayed "
          f"exactly on gloo, {len(figures['replay_mismatches'])} mismatches)")
    print(f"paired mutants accepted, by kind: {figures['accepted_paired']}")
    print(f"internal errors or tracebacks: {len(figures['bugs'])}; hangs: {len(figures['hangs'])}; "
          f"peak RSS of a worker: {figures['peak_rss_mb']:.0f} MB ({figures['rss_growth_mb']:.0f} MB above its start)")
    for bug in figures["bugs"][:20] + figures["replay_mismatches"][:10]:
        print("  BUG", *bug)
    for hang in figures["hangs"][:10]:
        print("  HANG", *hang)
    sys.exit(1 if figures["bugs"] or figures["hangs"] or figures["replay_mismatches"] else 0)


if __name__ == "__main__":
    main()
