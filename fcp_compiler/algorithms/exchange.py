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
