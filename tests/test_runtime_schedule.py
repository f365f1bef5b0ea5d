"""The runtime runs the schedule the plan states: messages overlap tiles, no tile reads a buffer before its wait, no
result is pushed before the tiles that make it, and live buffers stay within the header's max_buffer_tokens."""

import pytest

torch = pytest.importorskip("torch")

from conftest import compile_own  # noqa: E402
from fcp_compiler.format.inputs import PRESET_PROFILES  # noqa: E402
from runtime_harness import run_ranks  # noqa: E402

CASES = [
    ("causal-4", [3000, 700, 90, 1500, 260, 1200], 4, 256, 2, "causal"),
    ("causal-8", [2600, 1300, 100, 650, 40, 900, 2000], 8, 128, 2, "causal"),
    ("offloaded-full-8", [2048, 100, 60], 8, 512, 2, "full"),
    ("relayed-6", [752, 2962, 580, 999], 6, 128, 2, "causal"),  # on a slow network: relays hold blocks longer
]
SLOW_NETWORK = PRESET_PROFILES["h100"].model_copy(update={"network_gbps": 0.05, "nvlink_gbps": 0.05,
                                                          "gpus_per_node": 2})


def _record(plan_bytes, lengths, prefetch: bool = False):
    def task(rank, world):
        from fcp_runtime import fcp_attn_func, load_rank_plan, prefetch_kv, recording

        plan = load_rank_plan(plan_bytes, rank)
        generator = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(plan.plan_tokens, heads, 8, generator=generator, dtype=torch.float64,
                               requires_grad=True) for heads in (2, 1, 1))
        with recording() as events:
            prefetched = prefetch_kv(k, v, plan) if prefetch else None
            out = fcp_attn_func(q, k, v, plan, prefetched=prefetched)
            (prefetched.backward_starts_at(out) if prefetch else out).sum().backward()
        arrival = {name: [p.round // plan.coalesce if name == "fwd" else p.bwd_round // plan.bwd_coalesce
                          for p in plan.pull_recv]
                   for name in ("fwd", "bwd")}
        return events, arrival
    return task


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_event_order_proves_overlap_and_data_before_use_and_buffers_within_the_header(case):
    _check_events(case, prefetch=False)


def test_prefetched_pulls_are_posted_before_attention_and_their_buffers_counted_from_then():
    """The prefetched messages go out before each pass's first post; the tiles that read them still wait for
    stage 0's wait, and their buffers count toward the same peak the header states."""
    _check_events(CASES[1], prefetch=True)


def _check_events(case, prefetch: bool) -> None:
    name, lengths, gpus, block, coalesce, mask = case
    profile = SLOW_NETWORK if name.startswith("relayed") else "h100"
    # The relayed and offloaded cases were chosen to relay and offload with attention alone as the objective.
    model = "none" if name.startswith(("relayed", "offloaded")) else "llama3-70b"
    plan = compile_own(lengths, gpus, block_size=block, coalesce=coalesce, mask=mask, profile=profile, model=model)
    assert (plan.stats["num_relayed_transfers"] > 0) == name.startswith("relayed")
    results = run_ranks(gpus, _record(plan.to_bytes(), lengths, prefetch))
    overlapped, peaks, prefetched = 0, [], 0
    for events, arrival in results:
        if prefetch:  # each pass's prefetch, and the allocations of what it receives, come before its first post
            for pass_name in ("fwd", "bwd"):
                first_post = next(idx for idx, event in enumerate(events) if event[:2] == ("post", pass_name))
                assert [event[:2] for event in events[:first_post]].count(("prefetch", pass_name)) == 1
                prefetched += next(event[3] for event in events if event[:2] == ("prefetch", pass_name))
        waited = set()  # (pass, stage) whose wait has happened
        posted_with_messages = None
        last_tile_stage = {}  # (pass, pull row) -> stage of the latest tile that read it
        live = peak = 0
        for event in events:
            kind, name, stage = event[0], event[1], event[2]
            if kind == "post":
                posted_with_messages = (name, stage) if event[3] else None
                for row in event[4]:  # pushes leave after every tile that fed them
                    assert last_tile_stage.get((name, row), -1) < stage, event
            elif kind == "tile":
                for row in event[4]:
                    assert (name, arrival[name][row]) in waited, f"tile read pull {row} before its wait: {event}"
                    last_tile_stage[(name, row)] = stage
                if posted_with_messages == (name, stage):
                    overlapped += 1
            elif kind == "wait":
                waited.add((name, stage))
                posted_with_messages = None
            elif kind != "prefetch":
                live += event[3] if kind == "alloc" else -event[3]
                assert live == event[4]
                peak = max(peak, live)
        assert live == 0  # every buffer freed by the end
        peaks.append(peak)
    assert overlapped > 0  # tiles ran while their stage's messages were in flight
    assert prefetched > 0 or not prefetch
    # The runtime's live buffers follow the header's rule: never above it, and the busiest rank reaches it.
    assert max(peaks) == plan.header.max_buffer_tokens > 0
