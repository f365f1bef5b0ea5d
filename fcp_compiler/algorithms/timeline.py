"""The timing model: one pass of a plan, rank by rank and stage by stage, on plain arrays (what `fcp simulate`, the
compiler's floor and the bound tests score every plan by).

Model (per rank: one compute stream, and a send and a receive link for each of NVLink and the NIC):
- Plan layout (the default): tokens were dispatched once per step, so attention starts with stage 0. User layout:
  the input reshuffle starts at time 0; tiles whose tokens stay on the rank run while it is in flight (when the
  plan allows the overlap), and stage 0 starts when both are done.
- A stage's messages (pulls of its rounds, pushes posted in it) launch together; a message starts when both ends
  have begun the stage, pays the per-message latency, and ends when the busier of its two link ends has drained:
  every message sharing a link end in the stage shares its bandwidth (NVLink within a node, the NIC across), so
  two senders into one receiver each get half its rate. Messages of different stages never share a link end,
  because a rank starts stage s + 1 only after its stage-s messages are done.
- The stage's tiles run on the compute stream from the stage start, at (1 - comm_sm_fraction) of full speed while
  the rank's messages are in flight; each kernel call pays one launch: the runtime makes one varlen call per stage
  for a full mask and up to two under a causal one (query segments with their diagonal, and those without), and
  one more per window a sliding window cuts a key segment with (`fcp_compiler.core.simulate.kernel_calls`).
- K,V prefetch (`flow_prefetch`, `prefetch_start`): stage-0 messages posted before the pass starts (its K,V pulls:
  forward once both ends have projected K and V, backward as the layer's backward starts) start when both ends
  have posted them; the linear work between the post and the pass's start runs slowed while they are in flight,
  and every stage-0 message drains as if all of the stage's messages on its link ends shared them from its start.
- The next stage starts when both the tiles and the messages of this one are done; in the user layout the output
  reshuffle starts when both ends have finished their last stage.
Backward is the same with 2.5x the tile work and the backward program's own rounds, stages and pushes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fcp_compiler.algorithms.keys import stable_argsort

# Trace tracks (Chrome trace thread ids) of each rank's process.
TRACKS = {("fwd", "compute"): 0, ("fwd", "send"): 1, ("fwd", "recv"): 2, ("bwd", "compute"): 3, ("bwd", "send"): 4,
          ("bwd", "recv"): 5}


@dataclass(frozen=True, slots=True, kw_only=True)
class PassInput:
    """One pass (forward or backward) as plain arrays."""

    num_ranks: int
    num_stages: int
    flow_src: np.ndarray
    flow_dst: np.ndarray
    flow_bytes: np.ndarray
    flow_stage: np.ndarray
    flow_name: list[str] | None
    tile_rank: np.ndarray
    tile_stage: np.ndarray
    tile_seconds: np.ndarray
    tile_early: np.ndarray  # bool: may run during the input reshuffle
    tile_name: list[str] | None
    reshuffle_in: tuple[np.ndarray, np.ndarray, np.ndarray]  # (src, dst, bytes)
    reshuffle_out: tuple[np.ndarray, np.ndarray, np.ndarray]
    stage_calls: np.ndarray | None = None  # kernel calls per (stage, rank); None: one per stage that runs tiles
    # bool [flows]: stage-0 messages both ends post before the pass starts (simulate_pass's prefetch_start); None:
    # none are
    flow_prefetch: np.ndarray | None = None
    # float [stages, ranks]: seconds of data movement outside the kernels on each rank's compute stream in each stage
    # (the runtime's copies, zeroings and landings, at HBM bandwidth); None: none
    stage_extra_s: np.ndarray | None = None
    # The tiles summed as the pass reads them (TileWork.of the tile_* arrays, which may then be empty unless the
    # pass is recorded: millions of tiles at small blocks); None: summed here
    tile_work: TileWork | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TileWork:
    """A pass's tiles as :func:`simulate_pass` reads them, each sum taken over the tiles in their order (so the
    same to the last bit however they are visited, a rank's tiles at a time): per stage and rank the tiles' seconds
    and how many there are, per rank the seconds of those that may run during the input reshuffle (in their stage's
    too) and of all of them."""

    stage_work: np.ndarray  # float [max(stages, 1), ranks]
    stage_tiles: np.ndarray  # int [max(stages, 1), ranks]
    early_work: np.ndarray  # float [ranks]
    compute: np.ndarray  # float [ranks]

    @classmethod
    def zeros(cls, num_stages: int, num_ranks: int) -> TileWork:
        """No tiles yet: :meth:`add` sums them a few ranks at a time."""
        rows = max(num_stages, 1)
        return cls(stage_work=np.zeros((rows, num_ranks)), stage_tiles=np.zeros((rows, num_ranks), dtype=np.int64),
                   early_work=np.zeros(num_ranks), compute=np.zeros(num_ranks))

    @classmethod
    def of(cls, data: PassInput) -> TileWork:
        """The sums of a pass's tile_* arrays."""
        work = cls.zeros(max(data.num_stages, int(data.tile_stage.max(initial=-1)) + 1), data.num_ranks)
        work.add(0, data.num_ranks, data.tile_rank, data.tile_stage, data.tile_seconds, data.tile_early)
        return work

    def add(self, low: int, high: int, rank: np.ndarray, stage: np.ndarray, seconds: np.ndarray,
            early: np.ndarray | None) -> None:
        """Every tile of ranks low..high-1, in order (their rank, stage, seconds, and whether each may run during
        the input reshuffle; None: none may)."""
        width, rows = high - low, self.stage_work.shape[0]
        local = np.subtract(rank, low, dtype=np.int64)
        bucket = np.multiply(stage, width, dtype=np.int64)
        bucket += local
        self.stage_work[:, low:high] = np.bincount(bucket, weights=seconds, minlength=rows * width).reshape(rows, -1)
        self.stage_tiles[:, low:high] = np.bincount(bucket, minlength=rows * width).reshape(rows, -1)
        self.compute[low:high] = np.bincount(local, weights=seconds, minlength=width)
        if early is not None:
            self.early_work[low:high] = np.bincount(local[early], weights=seconds[early], minlength=width)


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkModel:
    """Bandwidths (bytes/s), latency and launch cost (s), and how ranks map to nodes."""

    node_of_rank: np.ndarray
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    latency_s: float
    launch_s: float
    sm_fraction: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StageTimes:
    """When each rank's stages ran, float64 [S, N] (seconds from the pass's start): when the rank began the stage,
    when its tiles ended and when its messages ended (its start where it has none); and, per stage and rank, the
    rank at the other end of its last message to end (-1: none) and when that message started (both ends ready)."""

    start: np.ndarray
    compute_end: np.ndarray
    comm_end: np.ndarray
    last_peer: np.ndarray  # int64 [S, N]
    last_message_start: np.ndarray


@dataclass(slots=True, kw_only=True)
class PassResult:
    """Timeline of one pass: when each rank ends, how long its compute stream was busy, and trace events."""

    end: np.ndarray
    busy: np.ndarray
    compute: np.ndarray  # tile work at full speed per rank
    calls: np.ndarray | None = None  # kernel calls per (stage, rank), when the input states them
    reshuffle: float = 0.0  # seconds the input and output reshuffles take (their slowest rank each; user layout)
    events: list[dict] = field(default_factory=list)
    stages: StageTimes | None = None  # with simulate_pass(stage_times=True)

    @property
    def makespan(self) -> float:
        return float(self.end.max()) if self.end.size else 0.0


def _message_ends(t0, src, dst, nbytes, links: LinkModel, num_ranks: int) -> np.ndarray:
    """End time of each message of one group that launches together (shared link ends drain together)."""
    if src.size == 0:
        return np.zeros(0)
    inter = links.node_of_rank[src] != links.node_of_rank[dst]
    bandwidth = np.where(inter, links.inter_bytes_per_s, links.intra_bytes_per_s)
    out_key = src * 2 + inter
    in_key = dst * 2 + inter
    out_drain = np.bincount(out_key, weights=nbytes, minlength=2 * num_ranks)[out_key] / bandwidth
    in_drain = np.bincount(in_key, weights=nbytes, minlength=2 * num_ranks)[in_key] / bandwidth
    return t0 + links.latency_s + np.maximum(out_drain, in_drain)


def _slowest_message(src, dst, nbytes, links: LinkModel, num_ranks: int) -> float:
    """How long the slowest message of a group launched together takes (whenever it launches), 0 for none."""
    return float(_message_ends(np.zeros(src.size), src, dst, nbytes, links, num_ranks).max()) if src.size else 0.0


def _exchange(start, src, dst, nbytes, links: LinkModel, num_ranks: int):
    """One group of messages launched together, each when both its ends have reached `start`: (t0, ends) per
    message, each rank's comm_end (its start, or its last message's end) and whether it has any message."""
    return _launch(np.maximum(start[src], start[dst]), start, src, dst, nbytes, links, num_ranks)


def _launch(t0, start, src, dst, nbytes, links: LinkModel, num_ranks: int):
    """Messages draining together, each from its own t0: (t0, ends), each rank's comm_end (its start, or its last
    message's end) and whether it has any message."""
    ends = _message_ends(t0, src, dst, nbytes, links, num_ranks)
    comm_end = start.copy()
    np.maximum.at(comm_end, src, ends)
    np.maximum.at(comm_end, dst, ends)
    has_comm = np.bincount(np.concatenate((src, dst)), minlength=num_ranks) > 0
    return t0, ends, comm_end, has_comm


def _compute_end(start, work, comm_end, has_comm, sm_fraction):
    """When a compute stream starting at `start` with `work` seconds ends, slowed while messages are in flight."""
    window = np.where(has_comm, np.maximum(comm_end - start, 0.0), 0.0)
    slow = 1.0 - sm_fraction
    within = work / slow <= window
    return np.where(within, start + work / slow, start + window + (work - window * slow))


@dataclass(frozen=True, slots=True, kw_only=True)
class _TraceRecorder:
    """Appends one pass's Chrome trace events: a message on its sender's and its receiver's tracks, tiles back to
    back over each rank's compute window."""

    events: list
    data: PassInput
    links: LinkModel
    time_offset: float
    label: str

    def messages(self, t0, ends, src, dst, names, stage_name) -> None:
        for i in range(src.size):
            ts, dur = (self.time_offset + t0[i]) * 1e6, (ends[i] - t0[i]) * 1e6
            name = f"{names[i]} {stage_name}" if names is not None else stage_name
            self.events.append({"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": int(src[i]),
                                "tid": TRACKS[(self.label, "send")], "args": {"to": int(dst[i])}})
            self.events.append({"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": int(dst[i]),
                                "tid": TRACKS[(self.label, "recv")], "args": {"from": int(src[i])}})

    def compute(self, rank_start, rank_end, mask, stage_name, moving=None) -> None:
        # Tiles of the stage back to back, stretched over the compute window (launch cost first, then the data the
        # runtime moves outside the kernels, `moving` seconds per rank).
        data, track = self.data, TRACKS[(self.label, "compute")]
        for rank in np.flatnonzero(rank_end > rank_start).tolist():
            tiles = np.flatnonzero(mask & (data.tile_rank == rank))
            span = rank_end[rank] - rank_start[rank]
            launch = self.links.launch_s if tiles.size and stage_name != "reshuffle" else 0.0
            moved = float(moving[rank]) if moving is not None else 0.0
            # The window past the launch is the tiles' and the data movement's, stretched alike (by messages' SMs).
            scale = (span - launch) / max(float(data.tile_seconds[tiles].sum()) + moved, 1e-30)
            t = rank_start[rank]
            for name, duration in ((f"launch {stage_name}", launch), (f"data movement {stage_name}", moved * scale)):
                if duration:
                    self.events.append({"name": name, "ph": "X", "ts": (self.time_offset + t) * 1e6,
                                        "dur": duration * 1e6, "pid": rank, "tid": track})
                    t += duration
            for tile in tiles.tolist():
                dur = float(data.tile_seconds[tile]) * scale
                name = data.tile_name[tile] if data.tile_name is not None else "tile"
                self.events.append({"name": f"{name} {stage_name}", "ph": "X", "ts": (self.time_offset + t) * 1e6,
                                    "dur": dur * 1e6, "pid": rank, "tid": track})
                t += dur


def simulate_pass(data: PassInput, links: LinkModel, overlap_reshuffle: bool, record: bool = False,
                  time_offset: float = 0.0, label: str = "fwd", rank_start: np.ndarray | None = None,
                  stage_times: bool = False, prefetch_start: np.ndarray | None = None) -> PassResult:
    """Run one pass of the model above on plain arrays. O(messages + tiles + ranks x stages), vectorised.

    rank_start: when each rank may begin (its linear layers before attention); a message waits for both ends.
    stage_times: keep each stage's times on every rank (PassResult.stages, what :func:`critical_path` reads); a
    sort of each stage's messages, skipped where only the makespans are wanted (the floor's scoring).
    prefetch_start: when each rank posts the messages of data.flow_prefetch (before rank_start: the forward's
    stage-0 K,V pulls, posted once K and V are projected, while Q is); None: they wait for the stage like the rest.
    """
    n = data.num_ranks
    begin = np.zeros(n) if rank_start is None else np.asarray(rank_start, dtype=np.float64)
    prefetched = None
    if prefetch_start is not None and data.flow_prefetch is not None and data.flow_prefetch.any():
        prefetched, begin = _prefetch(data, links, np.minimum(prefetch_start, begin), begin)
    events: list[dict] = []
    tile_work = data.tile_work if data.tile_work is not None else TileWork.of(data)
    work_by = tile_work.stage_work.copy()
    early = data.tile_early if overlap_reshuffle else np.zeros(data.tile_rank.size, dtype=bool)
    early_work = tile_work.early_work if overlap_reshuffle else np.zeros(n)
    work_by[0] -= early_work
    has_tiles = tile_work.stage_tiles > 0
    busy = np.zeros(n)

    trace = _TraceRecorder(events=events, data=data, links=links, time_offset=time_offset, label=label)
    # Input reshuffle, with the tiles whose tokens stay local.
    src, dst, nbytes = data.reshuffle_in
    t0, ends, comm_end, has_comm = _exchange(begin, src, dst, nbytes, links, n)
    compute_end = _compute_end(begin, early_work, comm_end, has_comm, links.sm_fraction)
    busy += compute_end - begin
    if record:
        trace.messages(t0, ends, src, dst, None, "reshuffle in")
        trace.compute(begin, compute_end, early, "reshuffle")
    start = np.maximum(comm_end, compute_end)
    reshuffle_in = _slowest_message(src, dst, nbytes, links, n)

    order = stable_argsort(data.flow_stage)
    bounds = np.searchsorted(data.flow_stage[order], np.arange(data.num_stages + 1))
    times = _StageRecorder(data.num_stages, n) if stage_times else None
    for stage in range(data.num_stages):
        idx = order[bounds[stage]:bounds[stage + 1]]
        if stage == 0 and prefetched is not None:
            idx, t0, ends, comm_end, has_comm = _with_prefetched(data, links, start, idx, prefetched)
            src, dst = data.flow_src[idx], data.flow_dst[idx]
        else:
            src, dst, nbytes = data.flow_src[idx], data.flow_dst[idx], data.flow_bytes[idx]
            t0, ends, comm_end, has_comm = _exchange(start, src, dst, nbytes, links, n)
        launches = data.stage_calls[stage] if data.stage_calls is not None else has_tiles[stage]
        work = work_by[stage] + launches * links.launch_s
        if data.stage_extra_s is not None:
            work = work + data.stage_extra_s[stage]
        compute_end = _compute_end(start, work, comm_end, has_comm, links.sm_fraction)
        if times is not None:
            times.add(stage, start, compute_end, comm_end, src, dst, t0, ends)
        busy += compute_end - start
        if record:
            names = [data.flow_name[i] for i in idx.tolist()] if data.flow_name is not None else None
            trace.messages(t0, ends, src, dst, names, f"stage {stage}")
            trace.compute(start, compute_end, (data.tile_stage == stage) & ~early, f"stage {stage}",
                          data.stage_extra_s[stage] if data.stage_extra_s is not None else None)
        start = np.maximum(compute_end, comm_end)

    src, dst, nbytes = data.reshuffle_out
    t0, ends, end, _ = _exchange(start, src, dst, nbytes, links, n)
    if record:
        trace.messages(t0, ends, src, dst, None, "reshuffle out")
    compute = tile_work.compute.copy()
    reshuffle_out = _slowest_message(src, dst, nbytes, links, n)
    return PassResult(end=end, busy=busy, compute=compute, calls=data.stage_calls,
                      reshuffle=reshuffle_in + reshuffle_out, events=events,
                      stages=times.result() if times is not None else None)


def _prefetch(data: PassInput, links: LinkModel, post: np.ndarray, begin: np.ndarray):
    """The prefetched messages launched together, each when both ends have posted them (`post`), and when each
    rank then begins the pass: its work between `post` and `begin` (the Q projection) slowed while they are in
    flight (alone on the links until then). Returns ((message indices, their t0), the new begin)."""
    idx = np.flatnonzero(data.flow_prefetch)
    assert not data.flow_stage[idx].any(), "only stage-0 messages are prefetched"
    src, dst, nbytes = data.flow_src[idx], data.flow_dst[idx], data.flow_bytes[idx]
    t0, ends, comm_end, has_comm = _exchange(post, src, dst, nbytes, links, data.num_ranks)
    return (idx, t0), _compute_end(post, begin - post, comm_end, has_comm, links.sm_fraction)


def _with_prefetched(data: PassInput, links: LinkModel, start: np.ndarray, idx: np.ndarray, prefetched: tuple):
    """Stage 0's exchange with the prefetched messages already in flight: the others launch at the stage start as
    usual; every message, prefetched or not, drains as if all of the stage's messages on its link ends shared them
    from its own start (so none ends later than had none been prefetched, and none earlier than its link ends can
    carry). Returns (every stage-0 message, its t0, its end, comm_end, has_comm)."""
    early_idx, early_t0 = prefetched
    idx = idx[~data.flow_prefetch[idx]]
    both = np.concatenate((early_idx, idx))
    src, dst, nbytes = data.flow_src[both], data.flow_dst[both], data.flow_bytes[both]
    t0 = np.concatenate((early_t0, np.maximum(start[data.flow_src[idx]], start[data.flow_dst[idx]])))
    return (both, *_launch(t0, start, src, dst, nbytes, links, data.num_ranks))


def last_of_most(groups: np.ndarray, values: np.ndarray) -> np.ndarray:
    """For each distinct group, the position of its largest value (of equals, the last listed), in group order:
    what np.lexsort((values, groups)) gives at the end of each group's run, with one integer sort and linear scans.
    O(n log n) in the sort, O(n) after it."""
    if groups.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = stable_argsort(groups)
    sorted_groups = groups[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_groups[1:] != sorted_groups[:-1])))
    sorted_values = values[order]
    most = np.maximum.reduceat(sorted_values, starts)
    group_of = np.repeat(np.arange(starts.size), np.diff(np.append(starts, groups.size)))
    position = np.where(sorted_values == most[group_of], np.arange(groups.size), -1)
    return order[np.maximum.reduceat(position, starts)]


class _StageRecorder:
    """Fills a StageTimes stage by stage."""

    def __init__(self, num_stages: int, num_ranks: int):
        self.start, self.compute_end, self.comm_end, self.last_message_start = (
            np.zeros((num_stages, num_ranks)) for _ in range(4))
        self.last_peer = np.full((num_stages, num_ranks), -1, dtype=np.int64)

    def add(self, stage, start, compute_end, comm_end, src, dst, t0, ends) -> None:
        self.start[stage], self.compute_end[stage], self.comm_end[stage] = start, compute_end, comm_end
        # Each rank's last message to end (of equals, the last listed): the last of its run once sorted by (rank,
        # end), so that every rank is written once.
        ranks, peers = np.concatenate((src, dst)), np.concatenate((dst, src))
        last = last_of_most(ranks, np.concatenate((ends, ends)))
        self.last_peer[stage, ranks[last]] = peers[last]
        self.last_message_start[stage, ranks[last]] = np.concatenate((t0, t0))[last]

    def result(self) -> StageTimes:
        return StageTimes(start=self.start, compute_end=self.compute_end, comm_end=self.comm_end,
                          last_peer=self.last_peer, last_message_start=self.last_message_start)


def critical_path(stages: StageTimes) -> dict:
    """Why a pass's stages end when they do: walking back from the rank that ends its last stage latest, each stage
    of the rank on the path ended on its tiles (computing) or on its last message (messages). A message that
    started after the rank had begun the stage waited for its partner to begin it, so the path goes on from that
    partner, which began the stage then (the rank's wait is off the path: its partner was busy). O(S) steps.

    Returns:
        {"computing_s", "messages_s": the path's seconds in each, adding up to its span, from its first rank's start
        of stage 0 to the pass's last stage end; "ranks": the path's ranks, last first (a new one where the path
        went on from a late partner)}.
    """
    computing = messages = 0.0
    if stages.start.size == 0:
        return {"computing_s": computing, "messages_s": messages, "ranks": []}
    stage_end = np.maximum(stages.compute_end, stages.comm_end)
    rank = int(np.argmax(stage_end[-1]))
    ranks = [rank]
    for stage in range(stages.start.shape[0] - 1, -1, -1):
        began, ended = float(stages.start[stage, rank]), float(stage_end[stage, rank])
        if stages.compute_end[stage, rank] >= stages.comm_end[stage, rank]:
            computing += ended - began
            continue
        message_start = float(stages.last_message_start[stage, rank])
        if message_start > began:  # its partner began the stage later: the path goes on from there
            rank = int(stages.last_peer[stage, rank])
            ranks.append(rank)
            began = message_start
        messages += ended - began
    return {"computing_s": computing, "messages_s": messages, "ranks": ranks}
