"""What the commands print: every number under a name is the stat of that name."""

import re

import pytest

from conftest import compile_valid
from fcp_compiler.tools.report import compile_summary, kept_candidate
from fcp_compiler.tools.traces import lognormal_batch


@pytest.fixture(scope="module")
def plan():
    lengths = lognormal_batch(16 * 16384, 2048, 1.8, 64, 131072, seed=3)
    return compile_valid(lengths, 16, block_size=1024, coalesce=4, gpus_per_node=4, model="llama3-8b")


def test_the_compile_line_names_each_time_once(plan):
    stats = plan.stats
    (line,) = [line for line in compile_summary(stats, None).splitlines() if line.startswith("  compile ")]
    head, passes = line.split(": ", 1)
    total, in_floor, schedules = re.fullmatch(r"  compile (\S+) s \((\S+) s of it in the floor\), (\d+) schedules",
                                              head).groups()
    assert total == f"{stats['compile_seconds']:.3f}" and in_floor == f"{stats['floor']['seconds']:.3f}"
    # Every finished plan ends with reshuffle, and was coalesced first.
    assert 1 < int(schedules) == stats["pass_calls"]["reshuffle"] <= stats["pass_calls"]["coalesce"]
    printed = dict(item.split(" ") for item in passes.split("  "))
    assert printed == {name: f"{seconds:.3f}" for name, seconds in stats["pass_seconds"].items()}
    # No pass is named like the floor's total: "floor" is said once, for what the floor cost in all.
    assert "floor" not in printed


def test_the_table_and_the_lines_print_the_stats(plan):
    stats = plan.stats
    lines = compile_summary(stats, None).splitlines()
    headers, values = lines[1].split(), lines[2].split()
    assert values == [str(stats["num_blocks"]), str(stats["num_tiles"]), str(stats["num_offloaded_tiles"]),
                      str(stats["num_transfers"]), str(stats["num_relayed_transfers"]), str(stats["max_degree"]),
                      str(stats["num_rounds"]), f"{stats['num_fwd_stages']}/{stats['num_bwd_stages']}",
                      f"{stats['compute_imbalance']:.2%}", f"{stats['comm_imbalance']:.2%}",
                      f"{stats['makespan_lower_bound_ratio']:.4f}", str(stats["max_tokens_per_rank"]),
                      str(stats["token_cap"])], headers
    rounds = next(line for line in lines if line.startswith("  rounds with pushes"))
    assert re.fullmatch(rf"  rounds with pushes: fwd {stats['num_fwd_rounds']} \(at least "
                        rf"{stats['fwd_exchange_degree']}\), bwd {stats['num_bwd_rounds']} \(at least "
                        rf"{stats['bwd_exchange_degree']}\); live buffers <= {stats['max_buffer_tokens']} tokens",
                        rounds)
    layer = next(line for line in lines if line.startswith("  layer ("))
    for name in ("fwd", "bwd"):
        assert (f"{name} {stats[f'layer_makespan_{name}_s'] * 1e3:.2f} ms (bound "
                f"{stats[f'layer_makespan_lower_bound_{name}_s'] * 1e3:.2f}, gap {stats[f'layer_gap_{name}']:.3f})"
                in layer)
    head = lines[0]
    assert f"coalesce {stats['coalesce']}/{stats['bwd_coalesce']}" in head and plan.header.coalesce == stats[
        "coalesce"] and plan.header.bwd_coalesce == stats["bwd_coalesce"]


def test_the_floor_line_names_the_plan_written(plan):
    stats = plan.stats
    floor_line = next(line for line in compile_summary(stats, None).splitlines() if line.startswith("  floor: "))
    kept = re.match(r"  floor: kept (.+?) of \d+ candidates? scheduled", floor_line).group(1)
    assert kept == kept_candidate(stats)
    # Its rounds a stage are the plan's, as the header states them (unless it was kept in smaller stages).
    if not kept.endswith("in smaller stages"):
        assert kept.endswith(f" c{plan.header.coalesce}/{plan.header.bwd_coalesce}")


def test_the_kept_candidate_is_the_one_the_memory_budget_kept():
    floor = {"winner": "layer direct c16/32"}
    assert kept_candidate({"floor": floor, "memory": {"refitted": False, "kept": None}}) == "layer direct c16/32"
    assert kept_candidate({"floor": floor, "memory": {"refitted": True, "kept": "magi direct c16/16"}}) == \
        "magi direct c16/16"
    assert kept_candidate({"floor": floor, "memory": {"refitted": True, "kept": "the winner, in smaller stages"}}) \
        == "layer direct c16/32 in smaller stages"


def test_the_memory_line_says_how_the_plan_kept_in_the_winners_place_was_finished():
    from fcp_compiler.tools.report import _memory_line

    memory = {"budget_bytes": 4 * 2**30, "refitted": True, "kept": "the winner, in smaller stages", "refits": 3,
              "unbudgeted_peak_bytes": 5 * 2**30, "met": True, "peak_bytes_fwd": 2**30, "peak_bytes_bwd": 3 * 2**30}

    def line(record):
        return _memory_line({"memory": {**memory, **({"backward_last_stage": record} if record else {})}})[0]

    assert "finished" not in line(None)
    both = {"kept": "out of last stage", "pulled_back": True, "within_budget_bytes": True}
    assert line(both).endswith("; finished as the floor's winner: pulled-K,V tiles out of the backward's last stage "
                               "and tiles pulled back)")
    assert line({**both, "within_budget_bytes": False}).endswith("faster, but over the budget: not kept)")
    assert line({"kept": "levelled", "pulled_back": True, "within_budget_bytes": True}).endswith(
        "; finished as the floor's winner: tiles pulled back)")
    assert line({"kept": "levelled", "pulled_back": False}).endswith("; finished as the floor's winner: no variant "
                                                                     "faster)")
    # No pulled-K,V tile in the backward's last stage to move: the record holds the pull-back alone.
    assert line({"pulled_back_s": 0.5, "pulled_back": True, "within_budget_bytes": True}).endswith(
        "; finished as the floor's winner: tiles pulled back)")
