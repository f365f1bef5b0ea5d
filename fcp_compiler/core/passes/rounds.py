"""Pass 5: split the pulls into congestion-free rounds."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.edge_colouring import bipartite_edge_colouring
from fcp_compiler.core.ir import Rounds, Transfers


def arbitrary_rounds(transfers: Transfers) -> Rounds:
    """Ablation: pulls in edge order, each receiver taking one a round and senders unconstrained (not matchings:
    a sender may serve several receivers at once, so links congest). Plans built this way fail validation."""
    dst = transfers.edge_dst
    order = np.lexsort((np.arange(dst.size), dst))
    first = np.searchsorted(dst[order], dst[order])
    edge_round = np.empty(dst.size, dtype=np.int64)
    edge_round[order] = np.arange(dst.size) - first
    return Rounds(transfers=transfers, edge_round=edge_round, num_rounds=int(edge_round.max()) + 1 if dst.size else 0)


def schedule_rounds(transfers: Transfers) -> Rounds:
    """Colour the sender x receiver multigraph of pulls into exactly Delta matchings, one round each.

    In a round no rank sends more than one pull and none receives more than one (DESIGN section 3). Delta rounds
    is optimal (Konig). Rounds are then renumbered by decreasing size, ties by colour, so the busiest rounds come
    first and the pipeline fills early.

    Args:
        transfers: the pull edges.
    Returns:
        the Rounds, num_rounds == max_degree.
    """
    num_ranks = transfers.assignment.num_ranks
    colour = bipartite_edge_colouring(transfers.edge_src, transfers.edge_dst, num_ranks, num_ranks)
    num_rounds = int(colour.max()) + 1 if colour.size else 0
    sizes = np.bincount(colour, minlength=num_rounds)
    rank_of_colour = np.empty(num_rounds, dtype=np.int64)
    rank_of_colour[np.lexsort((np.arange(num_rounds), -sizes))] = np.arange(num_rounds)
    rounds = Rounds(transfers=transfers, edge_round=rank_of_colour[colour] if colour.size else colour,
                    num_rounds=num_rounds)
    assert rounds.num_rounds == rounds.max_degree, (rounds.num_rounds, rounds.max_degree)
    return rounds
