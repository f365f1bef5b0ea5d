"""A certified lower bound on the layer makespan of one pass (forward or backward), from the batch alone.

The model (docs/DESIGN.md section 3, the simulator's): every rank runs the linear layers on the tokens it holds and the
attention tiles it is given on one compute stream; a tile computes the visible pairs between query rows and key rows
present on its rank, either held there or received; a rank receives over NVLink (inside its node) and its NIC
(across nodes) at their bandwidths. The bound holds for every placement within the token cap, every tile placement
(offloaded tiles included), every schedule, relay tree or fan-out, so it never depends on a plan.

Terms (seconds):

- compute: (sum over sequences of each visible pair at the fastest it can run + all tokens' linear time) / N. A
  pair runs in a kernel call of one query segment of s (at most L_s tokens, and at most the plan's longest segment of
  s where the caller gives it) over keys of s that end with that segment, so it reaches at most the best efficiency
  of a tile that large (:func:`efficiency_cap`, :func:`pair_efficiency`); launches and the SMs given to
  communication only add time.
- largest unit: the work that cannot be split between ranks. In this model a tile can be one segment pair and a
  segment a single token, so the only indivisible units are one token's linear layers and one visible pair (which
  may run on another rank than the token's holder): the term is kept for completeness and never binds on a real
  batch (at N above the batch's work it would).
- communication: a group of ranks (a rank, or a node) that computes S visible pairs of sequence s while holding x of
  its tokens works inside (held + received query rows) x (held + received key rows). Its held rows give at most
  f_s(x) pairs (:func:`held_pairs`); a received key row adds at most min(x, w_s) pairs with held queries, a received
  query row at most min(x, w_s) with held keys, and q received queries meet k received keys in at most q k pairs
  (w_s: the most keys a query sees, L_s or the window). So the excess E = S - f_s(x) satisfies
  E <= (q + k) m + q k with m = min(X, w_s), X the most tokens of s the group can hold, and its received bytes
  beta = q b_q + k b_kv obey E <= beta m / b_kv + beta^2 / (4 b_q b_kv), i.e. beta >= phi(E) =
  2 b_q (sqrt(m^2 + E b_kv / b_q) - m) (:func:`bytes_for_excess`). phi is concave with phi(0) = 0, and a group
  computes at most P_max = g T / c_s pairs of s in time T, so a sequence whose excess is spread over groups in
  pieces of at most P_max receives at least E_s phi(P_max) / P_max bytes in all. The held pairs of all groups
  together are at most F_s(T): as many groups as possible holding X_eff tokens (the most whose pairs still fit the
  group's time), f_s being convex. Summed over sequences, the bytes must fit every group's receive bandwidth for
  T: at rank level N (NVLink + NIC) T (NVLink alone on one node), at node level (2 nodes or more) N x NIC x T.
  The bound is the least T (bisection) at which both the compute and this condition hold.

Where it is weak: every term is an average over ranks (or nodes), so hot spots forced by a placement (a block many
ranks read from one sender, a node that holds a long sequence's early blocks) are not charged; with NVLink at
450 GB/s and a 50 GB/s NIC per GPU, the communication a batch needs at all is rarely the binding term, and the gap of
a plan that is communication bound measures its own exposed traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.visibility import visible_pairs

BISECTION_STEPS = 60
# Chunks of a sequence's positions S (its longest segment) wide before they double (pair_efficiency): past them a
# chunk's cap is at most one doubling of k looser.
LINEAR_CHUNKS = 32
PART_SEQUENCES = 1 << 16  # sequences pair_efficiency takes at a time


@dataclass(frozen=True, slots=True, kw_only=True)
class PassCosts:
    """What one pass costs per unit, as plain numbers (the caller derives them from shape, model and profile).

    pair_seconds: per sequence, the least time one visible pair can take (work per pair / (peak x efficiency cap)).
    attention_seconds: per sequence, the least time all its visible pairs take together (default: visible pairs x
        pair_seconds; :func:`pair_efficiency` gives a larger one where the query segments are short).
    linear_seconds_per_token: the linear layers' time per token held (0 for attention alone).
    q_row_bytes, kv_row_bytes: bytes a received query row (with what the pass sends with it) and a received key/value
        row cost.
    """

    pair_seconds: np.ndarray
    linear_seconds_per_token: float
    q_row_bytes: float
    kv_row_bytes: float
    attention_seconds: np.ndarray | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    """Ranks, how they group into nodes, the token cap and each link class's bandwidth per GPU (bytes/s)."""

    num_ranks: int
    gpus_per_node: int
    token_cap: int
    nvlink_bytes_per_s: float
    nic_bytes_per_s: float

    @property
    def num_nodes(self) -> int:
        return -(-self.num_ranks // self.gpus_per_node)


def held_pairs(tokens: np.ndarray, lengths: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """The most visible pairs among `tokens` tokens of each sequence, elementwise (f_s above).

    Causal (window = length): the i-th held token in position order sees at most i held tokens, so x (x + 1) / 2.
    Window W: at most min(i, W) each, so x (x + 1) / 2 up to W and W (W + 1) / 2 + (x - W) W past it. Full (window 0):
    x^2. Convex in x in every case.
    """
    x = np.asarray(tokens, dtype=np.float64)
    window = np.where(windows > 0, np.minimum(windows, lengths), lengths).astype(np.float64)
    within = x * (x + 1) / 2
    past = window * (window + 1) / 2 + (x - window) * window
    return np.where(windows > 0, np.where(x <= window, within, past), x * x)


def _held_tokens_for(pairs_budget: np.ndarray, lengths: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """The real x at which the held pairs f_s(x) reach `pairs_budget` (f_s's inverse, at most the length); held
    tokens past it give a group no more pairs of its own than its time allows."""
    budget = np.asarray(pairs_budget, dtype=np.float64)
    window = np.where(windows > 0, np.minimum(windows, lengths), lengths).astype(np.float64)
    quadratic = (np.sqrt(1 + 8 * budget) - 1) / 2  # x (x + 1) / 2 = budget
    linear = window + (budget - window * (window + 1) / 2) / np.maximum(window, 1)
    causal_like = np.where(quadratic <= window, quadratic, linear)
    x = np.where(windows > 0, causal_like, np.sqrt(budget))
    return np.minimum(x, lengths)


def bytes_for_excess(excess: np.ndarray, reach: np.ndarray, q_row_bytes: float, kv_row_bytes: float) -> np.ndarray:
    """phi(E): the fewest bytes a group must receive to compute `excess` pairs beyond those of its held rows.

    Objective: minimise beta = q b_q + k b_kv subject to (q + k) m + q k >= E (m = `reach`). With q k <=
    beta^2 / (4 b_q b_kv) and q + k <= beta / b_kv (b_kv <= b_q is not assumed: the cheaper row is used), the
    constraint needs beta^2 / (4 b_q b_kv) + beta m / b_min >= E, whose root is returned. O(1) per element.
    """
    excess = np.maximum(np.asarray(excess, dtype=np.float64), 0.0)
    cheaper = min(q_row_bytes, kv_row_bytes)
    a = 1.0 / (4.0 * q_row_bytes * kv_row_bytes)
    b = np.asarray(reach, dtype=np.float64) / cheaper
    return (np.sqrt(b * b + 4 * a * excess) - b) / (2 * a)


def efficiency_cap(tokens: np.ndarray, curve_tokens: np.ndarray, curve_efficiency: np.ndarray) -> np.ndarray:
    """The best efficiency any tile of at most `tokens` query and key tokens reaches on the curve, elementwise.

    The curve is the cost model's (linear in log2 of the tile's geometric mean size between points, proportional
    below the first, flat above the last); its maximum over [1, tokens] is at `tokens` itself or at a curve point
    below it, so the running maximum of the points is compared with the value at `tokens`.
    """
    tokens = np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)
    at = np.interp(np.log2(tokens), np.log2(curve_tokens), curve_efficiency)
    at = np.where(tokens < curve_tokens[0], curve_efficiency[0] * tokens / curve_tokens[0], at)
    running = np.maximum.accumulate(curve_efficiency)
    below = np.searchsorted(curve_tokens, tokens, side="right") - 1
    best_point = np.where(below >= 0, running[np.maximum(below, 0)], 0.0)
    return np.maximum(at, best_point)


@dataclass(frozen=True, slots=True, kw_only=True)
class PairEfficiency:
    """What the efficiency cap allows each sequence's visible pairs (:func:`pair_efficiency`): `weighted_pairs`, the
    sum over its visible pairs of 1 / the best efficiency each can reach (its pairs' least time, in units of one
    pair's work at peak), and `best`, the best efficiency any of them reaches."""

    weighted_pairs: np.ndarray
    best: np.ndarray


def pair_efficiency(lengths: np.ndarray, windows: np.ndarray, max_segment: np.ndarray, curve_tokens: np.ndarray,
                    curve_efficiency: np.ndarray) -> PairEfficiency:
    """The best efficiency each visible pair of each sequence can reach, given its longest query segment.

    A pair runs in a kernel call of one query segment over key segments of its sequence, at the efficiency of a tile
    of sqrt(q x k) tokens: q the segment's tokens, at most the sequence's longest segment S (and its length L); k
    the tokens of the key segments the call holds. Causal or windowed, every key segment a call holds ends at or
    before its query segment's end, below p + S for a query at position p, so k < p + S; under a window w < L the
    key segments meet the segment's window [start - w + 1, end) and at most one reaches below it (by under S), so
    k <= w + 2 S; full, k <= L. The positions of a sequence are taken in chunks, each capped at its last position
    (valid for all of them): S wide for the first LINEAR_CHUNKS chunks, doubling after. Summed pairs per chunk are
    exact (:func:`fcp_compiler.algorithms.visibility.visible_pairs`). O(sum over sequences of LINEAR_CHUNKS +
    log2(L / S)), vectorised.

    Args:
        lengths, windows: per sequence (window: causal = its length, full = 0, else the sliding window).
        max_segment: per sequence, its longest query segment's tokens (at least 1; the length where unknown).
        curve_tokens, curve_efficiency: the efficiency curve (:func:`efficiency_cap`).
    Returns:
        the PairEfficiency.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    windows = np.asarray(windows, dtype=np.int64)
    segment = np.clip(np.asarray(max_segment, dtype=np.int64), 1, np.maximum(lengths, 1))
    weighted = np.zeros(lengths.size)
    # A part of the sequences at a time (bounded temporaries whatever their number): one chunk where a segment can be
    # the whole sequence, the rest a chunk column each.
    for low in range(0, lengths.size, PART_SEQUENCES):
        part = np.arange(low, min(low + PART_SEQUENCES, lengths.size))
        for mine, whole in ((part[segment[part] >= lengths[part]], True), (part[segment[part] < lengths[part]], False)):
            if mine.size:
                widths = np.array([0.0, 1.0]) if whole else _chunk_widths(float((lengths[mine] / segment[mine]).max()))
                weighted[mine] = _weighted_pairs(lengths[mine], windows[mine], segment[mine], widths, curve_tokens,
                                                 curve_efficiency)
    best = efficiency_cap(np.sqrt(segment * _most_keys(lengths - 1 + segment, lengths, windows, segment)),
                          curve_tokens, curve_efficiency)
    return PairEfficiency(weighted_pairs=weighted, best=best)


def _chunk_widths(most_segments: float) -> np.ndarray:
    """Chunk edges in segments (:func:`pair_efficiency`): 0 to LINEAR_CHUNKS one apart, then doubling, until they
    pass `most_segments` (a sequence's length over its longest segment)."""
    doublings = max(int(np.ceil(np.log2(max(most_segments / LINEAR_CHUNKS, 1.0)))), 0)
    linear = np.arange(min(LINEAR_CHUNKS, int(np.ceil(most_segments))) + 1, dtype=np.float64)
    return np.concatenate((linear, LINEAR_CHUNKS * 2.0 ** np.arange(1, doublings + 1)))


def _weighted_pairs(lengths: np.ndarray, windows: np.ndarray, segment: np.ndarray, widths: np.ndarray,
                    curve_tokens: np.ndarray, curve_efficiency: np.ndarray) -> np.ndarray:
    """:func:`pair_efficiency`'s weighted pairs of these sequences over chunks at `widths` segments (edges past a
    sequence's length are its length)."""
    edges = np.minimum(segment[:, None] * widths[None, :], lengths[:, None]).astype(np.int64)
    low, high = edges[:, :-1], edges[:, 1:]
    length, window = (np.broadcast_to(values[:, None], low.shape) for values in (lengths, windows))
    pairs = visible_pairs(low, high, 0, length, window).astype(np.float64)
    keys = _most_keys(high - 1 + segment[:, None], length, window, segment[:, None])
    cap = efficiency_cap(np.sqrt(segment[:, None] * keys), curve_tokens, curve_efficiency)
    return np.where(pairs > 0, pairs / cap, 0.0).sum(axis=1)


def _most_keys(below: np.ndarray, lengths: np.ndarray, windows: np.ndarray, segment: np.ndarray) -> np.ndarray:
    """The most key tokens a call can hold (:func:`pair_efficiency`): under `below` causal (and w + 2 S under a
    window), the whole length full, never past it. float64, elementwise."""
    causal = np.minimum(below, np.where(windows < lengths, windows + 2 * segment, lengths))
    return np.minimum(np.where(windows > 0, causal, lengths), lengths).astype(np.float64)


def _needed_bytes(time_s: float, group_size: int, group_token_cap: int, visible: np.ndarray, lengths: np.ndarray,
                  windows: np.ndarray, costs: PassCosts) -> float:
    """Least bytes all groups of `group_size` ranks together must receive so that each finishes in `time_s`."""
    budget_pairs = group_size * time_s / costs.pair_seconds  # pairs of s one group computes at most
    # The most tokens of s a group can hold: its cap, the sequence, and what its linear layers finish in time.
    most_held = np.minimum(float(group_token_cap), lengths.astype(np.float64))
    if costs.linear_seconds_per_token > 0:
        most_held = np.minimum(most_held, group_size * time_s / costs.linear_seconds_per_token)
    # Held pairs past the group's time count for nothing, so a group gains its own pairs from at most `held`
    # tokens; f_s convex: the most held pairs in all come from as many groups as possible at `held`.
    held = np.minimum(_held_tokens_for(budget_pairs, lengths, windows), most_held)
    full_groups = np.where(held > 0, np.floor(lengths / np.maximum(held, 1e-300)), 0.0)
    free = full_groups * held_pairs(held, lengths, windows) + held_pairs(lengths - full_groups * held, lengths,
                                                                         windows)
    excess = np.maximum(visible - free, 0.0)
    seen = np.where(windows > 0, np.minimum(windows, lengths), lengths)
    reach = np.minimum(most_held, seen)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_pair = bytes_for_excess(budget_pairs, reach, costs.q_row_bytes, costs.kv_row_bytes) / budget_pairs
    per_pair = np.where(budget_pairs > 0, per_pair, np.inf)
    return float(np.sum(np.where(excess > 0, excess * per_pair, 0.0)))


def _communication_fits(time_s: float, visible, lengths, windows, costs: PassCosts, machine: Machine) -> bool:
    rank_bandwidth = machine.nvlink_bytes_per_s + (machine.nic_bytes_per_s if machine.num_nodes > 1 else 0.0)
    if _needed_bytes(time_s, 1, machine.token_cap, visible, lengths, windows, costs) > \
            machine.num_ranks * rank_bandwidth * time_s:
        return False
    if machine.num_nodes > 1:
        group = machine.gpus_per_node
        needed = _needed_bytes(time_s, group, group * machine.token_cap, visible, lengths, windows, costs)
        if needed > machine.num_ranks * machine.nic_bytes_per_s * time_s:
            return False
    return True


def layer_lower_bound(lengths: np.ndarray, windows: np.ndarray, visible: np.ndarray, costs: PassCosts,
                      machine: Machine) -> dict[str, float]:
    """Certified lower bound on one pass's layer makespan (the slowest rank's linear layers plus attention).

    Objective: the least T at which N ranks could cover every visible pair, each within T of compute and within
    T of receive bandwidth (module docstring: the terms and why each is valid for every plan). Bisection on T over
    the communication condition, which only gets easier as T grows. O(S x BISECTION_STEPS) for S sequences.

    Args:
        lengths, windows: per sequence (window: causal = its length, full = 0, else the sliding window).
        visible: visible pairs per sequence.
        costs: the pass's unit costs.
        machine: ranks, nodes, token cap, bandwidths.
    Returns:
        {"bound_s", "compute_s", "largest_unit_s", "communication_s", "binding"}: the bound, each term (the
        communication term is the least T at which that condition alone holds, 0 when it holds at any T > 0), and
        the name of the term that sets the bound.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    windows = np.asarray(windows, dtype=np.int64)
    visible = np.asarray(visible, dtype=np.float64)
    total_tokens = float(lengths.sum())
    attention = visible * costs.pair_seconds if costs.attention_seconds is None else costs.attention_seconds
    work = float(np.sum(attention)) + total_tokens * costs.linear_seconds_per_token
    compute = work / machine.num_ranks
    # A token's linear layers and a pair it takes part in may run on different ranks: each is its own unit.
    largest_unit = max(costs.linear_seconds_per_token, float(costs.pair_seconds[visible > 0].max())
                       if (visible > 0).any() else 0.0)
    communication = _communication_time(lengths, windows, visible, costs, machine, max(compute, largest_unit))
    terms = {"compute_s": compute, "largest_unit_s": largest_unit, "communication_s": communication}
    binding = max(terms, key=terms.get)
    return {"bound_s": terms[binding], **terms, "binding": binding.removesuffix("_s")}


def _communication_time(lengths, windows, visible, costs: PassCosts, machine: Machine, floor_s: float) -> float:
    """The least T >= `floor_s` at which the communication condition holds, or 0 when it holds at `floor_s`
    already (then it does not bind)."""
    if floor_s <= 0 or _communication_fits(floor_s, visible, lengths, windows, costs, machine):
        return 0.0
    low, high = floor_s, floor_s * 2
    while not _communication_fits(high, visible, lengths, windows, costs, machine):
        low, high = high, high * 2
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        if _communication_fits(middle, visible, lengths, windows, costs, machine):
            high = middle
        else:
            low = middle
    return low  # the condition fails at `low`: every T below it is infeasible
