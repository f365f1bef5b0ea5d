"""Placing messages into congestion-free rounds around messages already placed."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.keys import stable_argsort


class _Slots:
    """Which rounds each end's send and receive slots are taken in: per end, the mask of rounds whose slots are all
    taken (a Python int), and, for an end of several slots, how many are taken in each round not yet full (a dict
    per end: taking a slot is one count, not a scan of one big-int mask a slot)."""

    def __init__(self, num_ends: int, capacity: np.ndarray | None, fixed_round: np.ndarray, fixed_src: np.ndarray,
                 fixed_dst: np.ndarray):
        slots = np.ones(num_ends, dtype=np.int64) if capacity is None else capacity
        self.one_slot = slots == 1  # per end
        self.capacity = slots.tolist()
        self.send_full, self.send = self._masks(fixed_src, fixed_round, slots)
        self.recv_full, self.recv = self._masks(fixed_dst, fixed_round, slots)

    @staticmethod
    def _masks(ends: np.ndarray, rounds: np.ndarray, slots: np.ndarray) -> tuple[list[int], list[dict[int, int]]]:
        """Per end, the bit mask of its full rounds (those with at least its slots of messages: fixed messages
        beyond an end's slots, the arbitrary rounds of an ablation, only fill it), and the message count of each
        round it uses but does not fill (empty for a one-slot end)."""
        width = int(rounds.max(initial=-1)) + 1
        num_ends = slots.size
        counts = np.bincount(ends * width + rounds, minlength=num_ends * width).reshape(num_ends, width) \
            if width else np.zeros((num_ends, 0), dtype=np.int64)
        packed = np.packbits(counts >= slots[:, None], axis=1, bitorder="little")
        data, row_bytes = packed.tobytes(), packed.shape[1]
        full = [int.from_bytes(data[end * row_bytes:(end + 1) * row_bytes], "little") for end in range(num_ends)]
        partial: list[dict[int, int]] = [{} for _ in range(num_ends)]
        several = np.flatnonzero(slots > 1)  # only an end of several slots has rounds it uses but does not fill
        counts = counts[several]
        row_idx, round_idx = np.nonzero((counts > 0) & (counts < slots[several, None]))  # by end, then round
        if row_idx.size:
            # One dict an end from its slice (millions of entries at thousands of ranks: half the time of one by
            # one), for the ends with any.
            starts = np.flatnonzero(np.diff(row_idx, prepend=-1))
            rounds, taken = round_idx.tolist(), counts[row_idx, round_idx].tolist()
            for end, low, high in zip(several[row_idx[starts]].tolist(), starts.tolist(),
                                      np.append(starts[1:], row_idx.size).tolist()):
                partial[end] = dict(zip(rounds[low:high], taken[low:high]))
        return full, partial

    def place(self, a: int, b: int, ready: int) -> int:
        """Take a's first free send slot and b's first free receive slot in the earliest round >= ready in which
        both have one; return that round. (Called once a message, hundreds of thousands of times a plan.)"""
        taken = (self.send_full[a] | self.recv_full[b]) >> ready
        rnd = ready + (taken ^ (taken + 1)).bit_length() - 1  # lowest clear bit at or after `ready`
        _take(self.send[a], self.send_full, self.capacity[a], a, rnd)
        _take(self.recv[b], self.recv_full, self.capacity[b], b, rnd)
        return rnd


def _take(counts: dict[int, int], full: list[int], capacity: int, end: int, rnd: int) -> None:
    """Take one of `end`'s slots in round `rnd` (not full): the last one taken marks the round full."""
    taken = counts.get(rnd, 0) + 1
    if taken < capacity:
        counts[rnd] = taken
    else:
        counts.pop(rnd, None)
        full[end] |= 1 << rnd


def place_messages(ready_round: np.ndarray, src: np.ndarray, dst: np.ndarray, num_ranks: int,
                   fixed_round: np.ndarray, fixed_src: np.ndarray, fixed_dst: np.ndarray,
                   capacity: np.ndarray | None = None) -> np.ndarray:
    """Give each new message the earliest round >= its ready round in which its sender has a free send slot and its
    receiver a free receive slot, around messages whose rounds are fixed.

    An end has capacity[end] slots a round (default 1: every round stays a matching of senders to receivers over
    all messages). Greedy list scheduling in order of ready round (ties by index): not optimal in rounds, but a
    message waits only for rounds whose endpoints are full. Free rounds are found with bit masks of full rounds
    (Python ints), one per end, and an end of several slots counts its messages per round, so each message costs
    O(R / 64) big-int operations: O((F + M) * R / 64) for F fixed and M new messages over R rounds.

    Args:
        ready_round, src, dst: int [M], the new messages.
        num_ranks: the number of ends (N, or 2N link ends).
        fixed_round, fixed_src, fixed_dst: int [F], messages already placed (within the capacity).
        capacity: int [num_ranks], slots per end and round (default all 1).
    Returns:
        int64 [M], the round of each new message.
    """
    if ready_round.size == 0:  # (the slots of the fixed messages cost milliseconds at hundreds of ranks)
        return np.zeros(0, dtype=np.int64)
    return _place_around(_Slots(num_ranks, capacity, fixed_round, fixed_src, fixed_dst), ready_round, src, dst)


def _place_around(slots: _Slots, ready_round: np.ndarray, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """:func:`place_messages` around the messages `slots` holds, which then holds these too."""
    order = stable_argsort(ready_round)
    placed = np.empty(ready_round.size, dtype=np.int64)
    one_slot = slots.one_slot[src[order]]
    if one_slot.any() and np.array_equal(one_slot, slots.one_slot[dst[order]]):
        # No message joins a one-slot end to an end of several (as with link ends: a message's two ends are of one
        # link class), so the messages between one-slot ends meet no other at either end: they are placed apart,
        # in a loop without slot counts, and the order within each kind is the greedy's order.
        single = order[one_slot]
        placed[single] = _place_single(slots, ready_round[single], src[single], dst[single])
        order = order[~one_slot]
    placed[order] = _place_in_order(slots, ready_round[order], src[order], dst[order])
    return placed


def _place_single(slots: _Slots, ready_round: np.ndarray, src: np.ndarray, dst: np.ndarray) -> list[int]:
    """:func:`_place_in_order` of messages between one-slot ends (each end's only slot taken marks its round full)."""
    send_full, recv_full = slots.send_full, slots.recv_full
    rounds = []
    for a, b, ready in zip(src.tolist(), dst.tolist(), ready_round.tolist()):
        taken = (send_full[a] | recv_full[b]) >> ready
        rnd = ready + (taken ^ (taken + 1)).bit_length() - 1
        bit = 1 << rnd
        send_full[a] |= bit
        recv_full[b] |= bit
        rounds.append(rnd)
    return rounds


def _place_in_order(slots: _Slots, ready_round: np.ndarray, src: np.ndarray, dst: np.ndarray) -> list[int]:
    """Each message, in the order given (by ready round), in the earliest round at or after its ready round with a
    free slot at both ends; returns their rounds."""
    send, recv, send_full, recv_full, slots_of = slots.send, slots.recv, slots.send_full, slots.recv_full, \
        slots.capacity
    rounds = []
    # _Slots.place written out: this loop runs once a message, millions of times over a floor's candidates.
    for a, b, ready in zip(src.tolist(), dst.tolist(), ready_round.tolist()):
        taken = (send_full[a] | recv_full[b]) >> ready
        rnd = ready + (taken ^ (taken + 1)).bit_length() - 1
        if slots_of[a] == 1:  # a one-slot end: its only slot taken, the round is full
            send_full[a] |= 1 << rnd
        else:
            _take(send[a], send_full, slots_of[a], a, rnd)
        if slots_of[b] == 1:
            recv_full[b] |= 1 << rnd
        else:
            _take(recv[b], recv_full, slots_of[b], b, rnd)
        rounds.append(rnd)
    return rounds


def spread_messages(ready_stage: np.ndarray, src: np.ndarray, dst: np.ndarray, work: np.ndarray,
                    stage_load: np.ndarray, rounds_per_stage: int, fixed_round: np.ndarray, fixed_src: np.ndarray,
                    fixed_dst: np.ndarray, capacity: np.ndarray | None = None,
                    load_rank: np.ndarray | None = None) -> np.ndarray:
    """Place messages that make work runnable on their receiver in the stage after theirs, so that the work does
    not bunch up: each in the earliest stage >= its ready stage where that work fits under the stage's busiest
    rank, else where it leaves its rank's load lowest (never past the last stage of `stage_load`), at the first round
    of that stage on with free slots at both ends (around the fixed messages, as :func:`place_messages`).

    Objective: the sum over stages of the busiest rank's work, as :func:`fcp_compiler.algorithms.leveling
    .level_stages`. Greedy, messages by ready stage, then by decreasing work, then index. O(M * S) for M messages
    over S stages.

    Args:
        ready_stage: int [M], the first stage each message may leave in.
        src, dst: int [M], its ends (as :func:`place_messages` counts them).
        work: float [M], the work it makes runnable on its receiver a stage later.
        stage_load: float [S, N], work already runnable per (stage, rank); updated in place.
        rounds_per_stage: c.
        fixed_round, fixed_src, fixed_dst, capacity: as :func:`place_messages`.
        load_rank: int [M], the rank whose load the work adds to (default dst).
    Returns:
        int64 [M], the round of each message.
    """
    num_stages = stage_load.shape[0]
    slots = _Slots(int(capacity.size) if capacity is not None else int(max(src.max(initial=0),
                                                                           dst.max(initial=0)) + 1),
                   capacity, fixed_round, fixed_src, fixed_dst)
    load = stage_load.tolist()
    level = [max(row) for row in load]
    rank = (dst if load_rank is None else load_rank).tolist()
    placed = [0] * ready_stage.size
    src_list, dst_list, work_list, ready_list = src.tolist(), dst.tolist(), work.tolist(), ready_stage.tolist()
    for message in np.lexsort((np.arange(ready_stage.size), -work, ready_stage)).tolist():
        r, w, ready = rank[message], work_list[message], ready_list[message]
        best, best_load = ready, None
        for stage in range(ready, num_stages - 1):
            after = load[stage + 1][r] + w
            if after <= level[stage + 1]:
                best = stage
                break
            if best_load is None or after < best_load:
                best, best_load = stage, after
        a, b = src_list[message], dst_list[message]
        rnd = slots.place(a, b, best * rounds_per_stage)
        placed[message] = rnd
        lands = min(rnd // rounds_per_stage + 1, num_stages - 1)
        load[lands][r] += w
        level[lands] = max(level[lands], load[lands][r])
    return np.asarray(placed, dtype=np.int64)


def push_ready_rounds(num_edges: int, tile_stage: np.ndarray, tile_kv_edge: np.ndarray, tile_q_edge: np.ndarray,
                      coalesce: int) -> np.ndarray:
    """Per pull edge, the first round of the stage after the last tile that reads it (when a push along it may
    leave); tiles name the K,V and Q pulls they read in tile_kv_edge and tile_q_edge (-1: local)."""
    ready_stage = np.zeros(num_edges, dtype=np.int64)
    for edge in (tile_kv_edge, tile_q_edge):
        reads = edge >= 0
        np.maximum.at(ready_stage, edge[reads], tile_stage[reads] + 1)
    return ready_stage * coalesce


def link_ends(src: np.ndarray, dst: np.ndarray, link: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Messages' ends as link ends (rank * 2 + class, class 1 the NIC across nodes, 0 NVLink inside one): rounds
    are congestion-free per link class, so :func:`place_messages` over 2N link ends, with
    :func:`link_capacity`, keeps every class's rounds within its slots."""
    return src * 2 + link, dst * 2 + link


def link_capacity(num_ranks: int, nvlink_lanes: int) -> np.ndarray:
    """Slots a round of each link end (rank * 2 + class): `nvlink_lanes` NVLink rounds fit in one round (an NVLink
    round is that much shorter), one NIC round."""
    return np.tile(np.array([nvlink_lanes, 1], dtype=np.int64), num_ranks)


def forward_push_rounds(edge_is_q: np.ndarray, edge_src: np.ndarray, edge_dst: np.ndarray, num_ranks: int,
                        pull_round: np.ndarray, tile_stage: np.ndarray, tile_kv_edge: np.ndarray,
                        tile_q_edge: np.ndarray, coalesce: int, link: np.ndarray,
                        nvlink_lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """Partial outputs pushed back along the Q pulls, each in the first round after its tiles in which both ends
    have a free slot in the pull's link class (around the pulls): (push_edge, push_round)."""
    push_edge = np.flatnonzero(edge_is_q)
    ready = push_ready_rounds(edge_src.size, tile_stage, tile_kv_edge, tile_q_edge, coalesce)[push_edge]
    capacity = link_capacity(num_ranks, nvlink_lanes)
    edge_src, edge_dst = link_ends(edge_src, edge_dst, link)
    push_round = place_messages(ready, edge_dst[push_edge], edge_src[push_edge], 2 * num_ranks, pull_round, edge_src,
                                edge_dst, capacity)
    return push_edge, push_round


def relay_heights(parent: np.ndarray) -> np.ndarray:
    """Per pull, 0 if nothing is relayed from it, else 1 + the largest height among the pulls relayed from it
    (parent[e] is the pull whose receiver re-sends e, -1 for a pull from the owner)."""
    height = np.zeros(parent.size, dtype=np.int64)
    child = np.flatnonzero(parent >= 0)
    while child.size:
        before = height.copy()
        np.maximum.at(height, parent[child], height[child] + 1)
        if np.array_equal(before, height):
            break
    return height


def backward_push_rounds(edge_src: np.ndarray, edge_dst: np.ndarray, edge_parent: np.ndarray, num_ranks: int,
                         pull_round: np.ndarray, tile_stage: np.ndarray, tile_kv_edge: np.ndarray,
                         tile_q_edge: np.ndarray, coalesce: int, link: np.ndarray,
                         nvlink_lanes: int) -> tuple[np.ndarray, np.ndarray]:
    """Every gradient pushed back along its pull: (push_edge, push_round), push_edge being every pull.

    A push takes the odd round 2r + 2d + 1 for its pull's round 2r and d = `coalesce` rounds a stage (two stages
    later: the reverse of a matching is a matching, so these rounds are too), or, where its tiles run later than
    that, the first free round after them. Every pulled block is then freed two or three stages after it arrives.
    A relay's own push waits for the pushes of the pulls it re-sent, which it sums into its partial gradient: pulls
    are placed by relay height, leaves first, each after the stage its children's pushes land in. Rounds are
    congestion-free per link class (`link`, per pull; `nvlink_lanes` NVLink slots a round)."""
    push_edge = np.arange(edge_src.size)
    capacity = link_capacity(num_ranks, nvlink_lanes)
    edge_src, edge_dst = link_ends(edge_src, edge_dst, link)
    num_ranks *= 2
    ready = push_ready_rounds(edge_src.size, tile_stage, tile_kv_edge, tile_q_edge, coalesce)
    mirror = pull_round + 2 * coalesce + 1
    push_round = mirror.copy()
    height = relay_heights(edge_parent)
    # A relay's push waits for its children's, which land after their own pull's stage: past its mirror round.
    fits = (mirror >= ready) & (height == 0)
    slots = None  # the pulls and every push placed so far, built once the first push needs placing
    for level in range(int(height.max(initial=0)) + 1):
        if level:
            children = np.flatnonzero(edge_parent >= 0)
            children = children[height[edge_parent[children]] == level]
            np.maximum.at(ready, edge_parent[children], (push_round[children] // coalesce + 1) * coalesce)
        late = np.flatnonzero((height == level) & ~fits)
        if late.size == 0:
            continue
        if slots is None:
            slots = _Slots(num_ranks, capacity, np.concatenate((pull_round, mirror[fits])),
                           np.concatenate((edge_src, edge_dst[fits])), np.concatenate((edge_dst, edge_src[fits])))
        push_round[late] = _place_around(slots, ready[late], edge_dst[late], edge_src[late])
    return push_edge, push_round
