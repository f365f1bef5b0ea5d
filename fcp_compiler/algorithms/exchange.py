"""Placing messages into congestion-free rounds around messages already placed."""

from __future__ import annotations

import numpy as np


def place_messages(ready_round: np.ndarray, src: np.ndarray, dst: np.ndarray, num_ranks: int,
                   fixed_round: np.ndarray, fixed_src: np.ndarray, fixed_dst: np.ndarray) -> np.ndarray:
    """Give each new message the earliest round >= its ready round in which its sender sends nothing else and its
    receiver receives nothing else, around messages whose rounds are fixed.

    Every round then stays a matching of senders to receivers over all messages. Greedy list scheduling in order of
    ready round (ties by index): not optimal in rounds, but a message waits only for rounds whose endpoints are
    taken. Free rounds are found with per-rank bit masks (Python ints), so each message costs O(1) big-int
    operations: O((F + M) * R / 64) for F fixed and M new messages over R rounds.

    Args:
        ready_round, src, dst: int [M], the new messages.
        num_ranks: N.
        fixed_round, fixed_src, fixed_dst: int [F], messages already placed (each round a matching).
    Returns:
        int64 [M], the round of each new message.
    """
    send_busy = [0] * num_ranks
    recv_busy = [0] * num_ranks
    for rnd, a, b in zip(fixed_round.tolist(), fixed_src.tolist(), fixed_dst.tolist()):
        bit = 1 << rnd
        send_busy[a] |= bit
        recv_busy[b] |= bit
    placed = [0] * ready_round.size
    ready_list, src_list, dst_list = ready_round.tolist(), src.tolist(), dst.tolist()
    for message in np.lexsort((np.arange(ready_round.size), ready_round)).tolist():
        a, b, ready = src_list[message], dst_list[message], ready_list[message]
        taken = (send_busy[a] | recv_busy[b]) >> ready
        rnd = ready + (~taken & (taken + 1)).bit_length() - 1  # lowest clear bit at or after `ready`
        bit = 1 << rnd
        send_busy[a] |= bit
        recv_busy[b] |= bit
        placed[message] = rnd
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


def forward_push_rounds(edge_is_q: np.ndarray, edge_src: np.ndarray, edge_dst: np.ndarray, num_ranks: int,
                        pull_round: np.ndarray, tile_stage: np.ndarray, tile_kv_edge: np.ndarray,
                        tile_q_edge: np.ndarray, coalesce: int) -> tuple[np.ndarray, np.ndarray]:
    """Partial outputs pushed back along the Q pulls, each in the first round after its tiles in which both ends
    are free (around the pulls): (push_edge, push_round)."""
    push_edge = np.flatnonzero(edge_is_q)
    ready = push_ready_rounds(edge_src.size, tile_stage, tile_kv_edge, tile_q_edge, coalesce)[push_edge]
    push_round = place_messages(ready, edge_dst[push_edge], edge_src[push_edge], num_ranks, pull_round, edge_src,
                                edge_dst)
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
                         tile_q_edge: np.ndarray, coalesce: int) -> tuple[np.ndarray, np.ndarray]:
    """Every gradient pushed back along its pull: (push_edge, push_round), push_edge being every pull.

    A push takes the odd round 2r + 2d + 1 for its pull's round 2r and d = `coalesce` rounds a stage (two stages
    later: the reverse of a matching is a matching, so these rounds are too), or, where its tiles run later than
    that, the first free round after them. Every pulled block is then freed two or three stages after it arrives.
    A relay's own push waits for the pushes of the pulls it re-sent, which it sums into its partial gradient: pulls
    are placed by relay height, leaves first, each after the stage its children's pushes land in."""
    push_edge = np.arange(edge_src.size)
    ready = push_ready_rounds(edge_src.size, tile_stage, tile_kv_edge, tile_q_edge, coalesce)
    mirror = pull_round + 2 * coalesce + 1
    push_round = mirror.copy()
    height = relay_heights(edge_parent)
    # A relay's push waits for its children's, which land after their own pull's stage: past its mirror round.
    fits = (mirror >= ready) & (height == 0)
    fixed_round, fixed_src, fixed_dst = [pull_round, mirror[fits]], [edge_src, edge_dst[fits]], \
        [edge_dst, edge_src[fits]]
    for level in range(int(height.max(initial=0)) + 1):
        if level:
            children = np.flatnonzero(edge_parent >= 0)
            children = children[height[edge_parent[children]] == level]
            np.maximum.at(ready, edge_parent[children], (push_round[children] // coalesce + 1) * coalesce)
        late = np.flatnonzero((height == level) & ~fits)
        push_round[late] = place_messages(ready[late], edge_dst[late], edge_src[late], num_ranks,
                                          np.concatenate(fixed_round), np.concatenate(fixed_src),
                                          np.concatenate(fixed_dst))
        fixed_round.append(push_round[late])
        fixed_src.append(edge_dst[late])
        fixed_dst.append(edge_src[late])
    return push_edge, push_round
