import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms.leveling import _below, level_stages, stage_loads


def _sum_of_stage_maxima(stage, rank, seconds, num_ranks):
    return stage_loads(stage, rank, seconds, int(stage.max()) + 1, num_ranks).max(axis=1).sum()


def test_early_rank_waits_for_the_late_one():
    # Rank 0 could do all its work in stage 1; rank 1 only gets its data for stage 3. Stage-synchronous, the
    # earliest placement costs 2 + 2; leveled, rank 0 runs beside rank 1 in stage 3 and the sum is 2.
    earliest = np.array([1, 1, 3, 3])
    rank = np.array([0, 0, 1, 1])
    seconds = np.ones(4)
    stage = level_stages(earliest, rank, seconds, 2)
    assert stage.tolist() == [3, 3, 3, 3]
    assert _sum_of_stage_maxima(stage, rank, seconds, 2) == 2.0


def test_front_loaded_rank_spreads_to_the_level_of_the_other():
    # Rank 0 has 4 units available in stage 1; rank 1 has 2 in stage 1 and 2 in stage 2: leveled, both run 2 + 2.
    earliest = np.array([1, 1, 1, 1, 1, 2])
    rank = np.array([0, 0, 0, 0, 1, 1])
    seconds = np.array([1.0, 1.0, 1.0, 1.0, 2.0, 2.0])
    stage = level_stages(earliest, rank, seconds, 2)
    loads = stage_loads(stage, rank, seconds, 3, 2)
    assert loads[1].tolist() == [2.0, 2.0] and loads[2].tolist() == [2.0, 2.0]


def test_pinned_tiles_stay():
    earliest = np.array([0, 0, 2])
    rank = np.array([0, 0, 1])
    seconds = np.ones(3)
    movable = np.array([False, False, True])
    assert level_stages(earliest, rank, seconds, 2, movable).tolist() == [0, 0, 2]


@given(st.integers(1, 5), st.integers(1, 40), st.integers(0, 10_000))
def test_never_earlier_never_past_the_last_stage_and_no_stage_gets_busier(num_ranks, num_tiles, seed):
    rng = np.random.default_rng(seed)
    earliest = rng.integers(0, 6, size=num_tiles)
    rank = rng.integers(0, num_ranks, size=num_tiles)
    seconds = rng.uniform(0.1, 3.0, size=num_tiles)
    movable = rng.random(num_tiles) < 0.8
    stage = level_stages(earliest, rank, seconds, num_ranks, movable)
    assert (stage >= earliest).all()
    assert stage.max() == earliest.max()
    assert np.array_equal(stage[~movable], earliest[~movable])
    num_stages = int(earliest.max()) + 1
    before = stage_loads(earliest, rank, seconds, num_stages, num_ranks).max(axis=1)
    after = stage_loads(stage, rank, seconds, num_stages, num_ranks).max(axis=1)
    assert (after <= before + 1e-9).all()


def test_a_delay_that_would_hold_buffers_past_the_budget_is_not_made():
    # Rank 0: tile 0 reads buffer 0 (from stage 0) and could run in stage 1; tile 2 reads buffer 1, live in stages
    # 2-3. Rank 1's work is in stage 3. Delaying tile 0 to stage 3 keeps buffer 0 live beside buffer 1: 20 tokens.
    from fcp_compiler.algorithms.leveling import BufferLimit

    earliest = np.array([1, 3, 3])
    rank = np.array([0, 1, 0])
    seconds = np.array([1.0, 2.0, 1.0])

    def limit(budget):
        return BufferLimit(tile_buffer=np.array([0, -1, 1]), buffer_rank=np.array([0, 0]),
                           buffer_first=np.array([0, 2]), buffer_tokens=np.array([10, 10]),
                           buffer_hold=np.array([0, 0]), budget=budget)

    assert level_stages(earliest, rank, seconds, 2).tolist() == [3, 3, 3]
    assert level_stages(earliest, rank, seconds, 2, limit=limit(20)).tolist() == [3, 3, 3]
    assert level_stages(earliest, rank, seconds, 2, limit=limit(15)).tolist() == [1, 3, 3]


def _reference_level_stages(earliest, rank, seconds, num_ranks, movable, limit):
    """The greedy written plainly: per rank a list of unmoved tiles by earliest stage, a moved tile deleted."""
    import bisect

    from fcp_compiler.algorithms.leveling import MAX_SKIPS

    stage = earliest.astype(np.int64).copy()
    num_stages = int(stage.max()) + 1
    buffers = None
    if limit is not None:
        last = limit.buffer_first.astype(np.int64)
        for tile, buffer in enumerate(limit.tile_buffer.tolist()):
            if buffer >= 0:
                last[buffer] = max(last[buffer], stage[tile])
        buffers = _ReferenceBuffers(limit, last, num_ranks, num_stages)
    pending = [[t for t in np.lexsort((np.arange(stage.size), earliest, rank)).tolist() if movable[t] and rank[t] == r]
               for r in range(num_ranks)]
    firsts = [[int(earliest[t]) for t in tiles] for tiles in pending]
    load = stage_loads(stage, rank, seconds, num_stages, num_ranks).tolist()
    for target in range(num_stages - 1, 0, -1):
        level = max(load[target])
        for r in range(num_ranks):
            gap = level - load[target][r]
            if gap <= 0:
                continue
            idx, skips = bisect.bisect_left(firsts[r], target) - 1, 0
            while idx >= 0 and skips < MAX_SKIPS:
                tile = pending[r][idx]
                if seconds[tile] > gap or (buffers is not None and not buffers.extend(tile, target)):
                    skips, idx = skips + 1, idx - 1
                    continue
                gap -= seconds[tile]
                load[stage[tile]][r] -= seconds[tile]
                load[target][r] += seconds[tile]
                stage[tile] = target
                del pending[r][idx], firsts[r][idx]
                idx -= 1
    return stage


class _ReferenceBuffers:
    """Live tokens per rank and stage as lists, a tile's buffer checked and extended one at a time."""

    def __init__(self, limit, last, num_ranks, num_stages):
        from fcp_compiler.algorithms.liveness import live_tokens

        end = last + limit.buffer_hold
        self.live = live_tokens(limit.buffer_rank, limit.buffer_first, end, limit.buffer_tokens, num_ranks,
                                int(max(end.max(initial=0), num_stages)) + 2).tolist()
        self.last, self.limit = last.tolist(), limit

    def extend(self, tile, target):
        buffer = int(self.limit.tile_buffer[tile])
        if buffer < 0 or self.last[buffer] >= target:
            return True
        row = self.live[int(self.limit.buffer_rank[buffer])]
        hold, tokens = int(self.limit.buffer_hold[buffer]), int(self.limit.buffer_tokens[buffer])
        begin, end = self.last[buffer] + hold + 1, target + hold + 1
        if max(row[begin:end], default=0) + tokens > self.limit.budget:
            return False
        for stage in range(begin, end):
            row[stage] += tokens
        self.last[buffer] = target
        return True


@given(st.integers(1, 4), st.integers(1, 60), st.integers(0, 2**16), st.booleans(), st.sampled_from([0, 2, 10**6]))
def test_the_scan_over_unmoved_tiles_equals_the_plain_greedy(num_ranks, num_tiles, seed, with_budget, python_ranks):
    """Whichever way the ranks fill a stage (numpy steps over all of them, one rank at a time in Python, or numpy
    steps until PYTHON_RANKS are left), the stages are the plain greedy's."""
    from fcp_compiler.algorithms import leveling

    default, leveling.PYTHON_RANKS = leveling.PYTHON_RANKS, python_ranks
    try:
        _scan_equals_the_plain_greedy(num_ranks, num_tiles, seed, with_budget)
    finally:
        leveling.PYTHON_RANKS = default


def _scan_equals_the_plain_greedy(num_ranks, num_tiles, seed, with_budget):
    from fcp_compiler.algorithms.leveling import BufferLimit

    rng = np.random.default_rng(seed)
    earliest = rng.integers(0, 6, size=num_tiles)
    rank = rng.integers(0, num_ranks, size=num_tiles)
    seconds = rng.choice([0.0, 0.5, 1.0, 1.5, 4.0], size=num_tiles)
    movable = rng.random(num_tiles) < 0.8
    limit = None
    if with_budget:
        # Buffers live on the rank of the tiles that read them (the pulls a rank receives).
        num_buffers = max(1, num_tiles // 3)
        buffer_rank = rng.integers(0, num_ranks, size=num_buffers)
        tile_buffer = rng.integers(-1, num_buffers, size=num_tiles)
        tile_buffer[(tile_buffer >= 0) & (buffer_rank[np.maximum(tile_buffer, 0)] != rank)] = -1
        limit = BufferLimit(tile_buffer=tile_buffer, buffer_rank=buffer_rank,
                            buffer_first=rng.integers(0, 3, size=num_buffers),
                            buffer_tokens=rng.integers(1, 5, size=num_buffers),
                            buffer_hold=rng.integers(0, 2, size=num_buffers), budget=int(rng.integers(4, 12)))
    got = level_stages(earliest, rank, seconds, num_ranks, movable=movable, limit=limit)
    want = _reference_level_stages(earliest, rank, seconds, num_ranks, movable, limit)
    assert np.array_equal(got, want)
    # What a caller prepared once (both passes of a plan share it) gives the same stages, under another hold.
    from dataclasses import replace

    from fcp_compiler.algorithms.leveling import prepare_levelling

    shared = prepare_levelling(earliest, rank, seconds, num_ranks, movable,
                               *((limit.tile_buffer, limit.buffer_first) if limit is not None else ()))
    assert np.array_equal(level_stages(earliest, rank, seconds, num_ranks, movable=movable, limit=limit,
                                       prepared=shared), want)
    if limit is not None:
        other = replace(limit, buffer_hold=1 - limit.buffer_hold)
        assert np.array_equal(level_stages(earliest, rank, seconds, num_ranks, movable=movable, limit=other,
                                           prepared=shared),
                              _reference_level_stages(earliest, rank, seconds, num_ranks, movable, other))


@given(st.lists(st.floats(min_value=0.0, max_value=1e3, allow_nan=False), min_size=1, max_size=50))
def test_the_scans_float32_bound_is_the_nearest_at_or_below(values):
    """_Scan keeps the least work before each position as a float32 bound (half the memory): never above the
    float64 value (a rank then stops only where nothing fits), the nearest float32 that is not."""
    exact = np.array(values)
    bound = _below(exact)
    assert bound.dtype == np.float32 and (bound.astype(np.float64) <= exact).all()
    up = np.nextafter(bound, np.float32(np.inf))
    assert (up.astype(np.float64) > exact).all()


def _pulled_back_by_rule(stage, earliest, rank, seconds, level):
    """pull_back's rule spelled out: stages from the first; each rank's delayed tiles, latest stage first then by
    index, each moved into the stage where it fits the room left (the rank's work there under the level), the room
    of a stage it leaves growing by its work."""
    stage = [int(s) for s in stage]
    num_ranks = int(max(rank)) + 1 if len(rank) else 0
    work = {(s, r): 0.0 for s in range(len(level)) for r in range(num_ranks)}
    for tile, (s, r) in enumerate(zip(stage, rank)):
        work[s, int(r)] += seconds[tile]
    for owner in range(num_ranks):
        for target in range(len(level)):
            candidates = sorted((tile for tile in range(len(stage)) if rank[tile] == owner
                                 and stage[tile] > earliest[tile]), key=lambda tile: (-stage[tile], tile))
            for tile in candidates:
                room = level[target] - work[target, owner]
                if room <= 0:
                    break
                if stage[tile] > target >= earliest[tile] and seconds[tile] <= room:
                    work[stage[tile], owner] -= seconds[tile]
                    work[target, owner] += seconds[tile]
                    stage[tile] = target
    return stage


@given(st.integers(1, 4), st.integers(0, 30), st.integers(0, 10_000))
def test_pulled_back_tiles_are_the_rule_spelled_out_and_only_move_earlier_into_room(num_ranks, num_tiles, seed):
    from fcp_compiler.algorithms.leveling import pull_back

    rng = np.random.default_rng(seed)
    num_stages = 5
    earliest = rng.integers(0, num_stages, num_tiles)
    stage = np.minimum(earliest + rng.integers(0, 3, num_tiles), num_stages - 1)
    rank = rng.integers(0, num_ranks, num_tiles)
    seconds = rng.choice([0.5, 1.0, 2.0], num_tiles)
    level = rng.choice([0.0, 1.0, 2.5, 4.0], num_stages)
    pulled = pull_back(stage, earliest, rank, seconds, level)
    assert pulled.tolist() == _pulled_back_by_rule(stage, earliest, rank, seconds, level)
    assert ((earliest <= pulled) & (pulled <= stage)).all()
    before = stage_loads(stage, rank, seconds, num_stages, num_ranks)
    after = stage_loads(pulled, rank, seconds, num_stages, num_ranks)
    gained = after > before + 1e-12
    assert (after[gained] <= np.broadcast_to(level[:, None], after.shape)[gained] + 1e-12).all()


def test_a_stage_with_room_under_its_messages_takes_the_tiles_levelling_delayed():
    from fcp_compiler.algorithms.leveling import pull_back

    # Rank 0's tiles could all run in stage 1, but levelling delayed two to stage 2 (rank 1 is busy there); stage 1
    # lasts 2 s of messages anyway: both come back, the third (3 s) does not fit.
    earliest, stage = np.array([1, 1, 1, 2]), np.array([2, 2, 2, 2])
    rank, seconds = np.array([0, 0, 0, 1]), np.array([1.0, 1.0, 3.0, 4.0])
    assert pull_back(stage, earliest, rank, seconds, np.array([0.0, 2.0, 4.0])).tolist() == [1, 1, 2, 2]


def test_stage_message_seconds_are_each_link_ends_bytes_over_its_class():
    from fcp_compiler.algorithms.leveling import stage_message_seconds

    # Rank 0 sends 100 B across nodes and 300 B inside its node in stage 0; rank 1 receives 300 B inside it.
    stage, src, dst = np.array([0, 0, 1]), np.array([0, 0, 2]), np.array([2, 1, 0])
    nbytes, across = np.array([100.0, 300.0, 50.0]), np.array([True, False, True])
    seconds = stage_message_seconds(stage, src, dst, nbytes, across, 2, 3, 10.0, 100.0)
    assert seconds.tolist() == [[10.0, 3.0, 10.0], [5.0, 0.0, 5.0]]
