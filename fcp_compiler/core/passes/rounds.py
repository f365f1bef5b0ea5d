"""Pass 5: split the pulls into congestion-free rounds."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.edge_colouring import bipartite_edge_colouring
from fcp_compiler.algorithms.fan_out import nvlink_lanes
from fcp_compiler.algorithms.keys import lexsort_ints
from fcp_compiler.core.ir import Rounds, Transfers


def arbitrary_rounds(transfers: Transfers) -> Rounds:
    """Ablation: pulls in edge order, each receiver taking one a round and senders unconstrained (not matchings:
    a sender may serve several receivers at once, so links congest). Plans built this way fail validation."""
    dst = transfers.edge_dst
    order = lexsort_ints((np.arange(dst.size), dst))
    first = np.searchsorted(dst[order], dst[order])
    edge_round = np.empty(dst.size, dtype=np.int64)
    edge_round[order] = np.arange(dst.size) - first
    return Rounds(transfers=transfers, edge_round=edge_round, num_rounds=int(edge_round.max()) + 1 if dst.size else 0)


def schedule_rounds(transfers: Transfers) -> Rounds:
    """Colour the pulls each sender sends from its own block into congestion-free rounds, each link class apart.

    Rounds are congestion-free per link class (docs/DESIGN.md section 3): in a round no rank sends more than one NIC
    message (to another node) or receives more than one, the two classes run at the same time, and NVLink, that
    many times faster, fits `nvlink_lanes` of its rounds (each a matching) in one. Each class's sender x receiver
    multigraph is coloured into exactly its Delta matchings (Konig: optimal). Colours are numbered by decreasing
    size, ties by colour, so the busiest come first and the pipeline fills early; coalesce orders them into
    rounds. Pulls re-sent by a rank that receives the block first (node fan-out) wait for it: coalesce places them
    (edge_round -1 here).

    Args:
        transfers: the pull edges.
    Returns:
        the Rounds, num_rounds == max(NIC Delta, ceil(NVLink Delta / lanes)) of the pulls from owners.
    """
    num_ranks = transfers.assignment.num_ranks
    profile = transfers.assignment.tiles.profile
    edge_round = np.full(transfers.num_edges, -1, dtype=np.int64)
    link = transfers.edge_link
    from_owner = transfers.edge_parent < 0
    for cls in (0, 1):
        idx = np.flatnonzero(from_owner & (link == cls))
        colour = bipartite_edge_colouring(transfers.edge_src[idx], transfers.edge_dst[idx], num_ranks, num_ranks)
        num_colours = int(colour.max()) + 1 if colour.size else 0
        sizes = np.bincount(colour, minlength=num_colours)
        rank_of_colour = np.empty(num_colours, dtype=np.int64)
        rank_of_colour[np.lexsort((np.arange(num_colours), -sizes))] = np.arange(num_colours)
        edge_round[idx] = rank_of_colour[colour] if colour.size else colour
    lanes = nvlink_lanes(profile.nvlink_gbps, profile.network_gbps)
    nvlink, nic = (int(edge_round[link == cls].max(initial=-1)) + 1 for cls in (0, 1))
    rounds = Rounds(transfers=transfers, edge_round=edge_round, num_rounds=max(nic, -(-nvlink // lanes)),
                    nvlink_lanes=lanes)
    assert (nvlink, nic) == rounds.owner_degrees, ((nvlink, nic), rounds.owner_degrees)
    return rounds
