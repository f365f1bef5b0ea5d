"""Layer kinds (core/kinds.py, format/kinds.py): a batch names kinds with their masks; one placement serves every
kind (one layout, one dispatch) and each kind has its own schedule, pulling only the blocks its mask reads. The
plan of layer kinds validates, replays exactly at world 8 and 16 in both layouts, and the bad forms are refused in
one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fcp_compiler.core.pipeline import compile_plan
from fcp_compiler.core.ir import TransferKind
from fcp_compiler.errors import InvalidInputError, PlanFormatError
from fcp_compiler.format.inputs import BatchSpec, parse_batch, parse_layer_masks, parse_layer_mix
from fcp_compiler.format.kinds import PlanKinds
from fcp_compiler.format.plan_format import PlanReader
from fcp_compiler.format.validate import PlanInvalidError
from fcp_compiler.format.validate_kinds import validate_kinds

LENGTHS = [1900, 700, 333, 1200, 64, 90, 517, 250]
KINDS = {"full_attention": "causal", "sliding_attention": {"kind": "sliding_window", "window": 96}}


def _spec(lengths=LENGTHS, layers=KINDS, mix=None) -> BatchSpec:
    return BatchSpec(sequences=list(lengths), layers=layers,
                     layer_mix=mix or {name: 2 for name in layers})


def _windows(mask, lengths) -> list[int]:
    return [parse_layer_masks({"k": mask})["k"].window_for(length) for length in lengths]


def _needed(kind_plan) -> None:
    """Every K,V pull of a kind's plan feeds a tile of its receiver, or one its re-sends feed: a kind pulls only
    the blocks its own mask reads."""
    transfers = kind_plan.ir.transfers
    tiles = transfers.assignment.tiles
    read = set(zip(transfers.assignment.tile_rank.tolist(), tiles.tile_kv_block.tolist()))
    parents = set(transfers.edge_parent[transfers.edge_parent >= 0].tolist())
    for edge in np.flatnonzero(transfers.edge_kind == TransferKind.KV):
        key = (int(transfers.edge_dst[edge]), int(transfers.edge_block[edge]))
        assert key in read or int(edge) in parents, f"pull {edge} of block {key[1]} to rank {key[0]} feeds nothing"


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_one_placement_one_schedule_per_kind_and_the_plan_validates(layout):
    plan = compile_plan(_spec(), 8, block_size=128, layout=layout)
    assert [kind.name for kind in plan.kinds] == list(KINDS)
    reports = validate_kinds(plan.data)
    assert set(reports) == set(KINDS)
    full, sliding = plan.kind("full_attention").plan, plan.kind("sliding_attention").plan
    # One layout: every block on the same rank, the same blocks.
    assert np.array_equal(full.ir.transfers.assignment.block_rank, sliding.ir.transfers.assignment.block_rank)
    assert full.header.num_blocks == sliding.header.num_blocks
    # Each kind's tiles are its own mask's: the window reads far fewer blocks, and its plan pulls far less.
    assert sliding.ir.tiles.num_tiles < full.ir.tiles.num_tiles
    assert 0 < sliding.stats["total_comm_bytes"] < full.stats["total_comm_bytes"] / 2
    for kind in plan.kinds:
        _needed(kind.plan)
        assert list(PlanReader(kind.plan.data).tables.seq_window) == _windows(KINDS[kind.name], LENGTHS)
    rows = {row["name"]: row for row in plan.stats["layer_kinds"]}
    assert plan.stats["layer_mix_s"] == pytest.approx(sum(2 * row["layer_seconds"] for row in rows.values()))
    assert plan.stats["primary_kind"] == "full_attention"


def test_a_kinds_compile_is_deterministic_and_its_digest_names_the_kinds():
    first, again = compile_plan(_spec(), 8, block_size=128), compile_plan(_spec(), 8, block_size=128)
    assert first.data == again.data
    other_mix = compile_plan(_spec(mix={"full_attention": 1, "sliding_attention": 5}), 8, block_size=128)
    digests = {kind.name: kind.plan.header.inputs_digest for kind in first.kinds}
    assert len(set(digests.values())) == 2  # each kind's plan is its own
    assert other_mix.kind("full_attention").plan.header.inputs_digest != digests["full_attention"]


def test_the_floor_scores_every_candidate_by_the_layer_mix():
    plan = compile_plan(_spec(), 8, block_size=128)
    scored = [row for row in plan.stats["floor"]["candidates"] if row["layer_makespan_fwd_s"] is not None]
    assert scored and all(row["other_kinds_s"] > 0 for row in scored)
    # The mix's sliding layers weigh the kept placement in: the winner is the least mix time among those that fit.
    budget = plan.stats["floor"]["memory_budget_tokens"]
    fitting = [row for row in scored if row["max_buffer_tokens"] <= budget]
    best = min(fitting, key=lambda row: row["layer_makespan_fwd_s"] + row["layer_makespan_bwd_s"]
               + row["other_kinds_s"])
    assert plan.stats["floor"]["winner"] == best["name"]


def test_a_shared_layout_pairs_chunks_only_where_every_kind_pays_for_it():
    long = [8192, 300, 200]
    causal_alone = compile_plan(long, 4, block_size=512, floor=False)
    kinds = compile_plan(_spec(long), 4, block_size=512, floor=False)
    assert causal_alone.stats["zigzag"] and not kinds.stats["zigzag"]
    wide = _spec(long, layers={"full_attention": "causal",
                               "sliding_attention": {"kind": "sliding_window", "window": 4096}})
    assert compile_plan(wide, 4, block_size=512, floor=False).stats["zigzag"]


@pytest.mark.parametrize("world,layout", [(8, "plan"), (8, "user"), (16, "plan"), (16, "user")])
def test_every_kind_replays_exactly_in_fp64(world, layout):
    from runtime_harness import compare_kinds_with_reference, run_ranks

    lengths = [1500, 640, 333, 64, 910, 200, 77, 1024]
    layers = {"global": "causal", "local": {"kind": "sliding_window", "window": 200}, "bidir": "full"}
    plan = compile_plan(_spec(lengths, layers), world, block_size=128, layout=layout, model="none")
    validate_kinds(plan.data)
    windows = {name: _windows(mask, lengths) for name, mask in layers.items()}
    results = run_ranks(world, compare_kinds_with_reference(plan.data, lengths, windows, layout), timeout=300)
    assert all(result == sorted(layers) for result in results)


def test_a_plan_of_layer_kinds_picks_the_kind_by_name_or_mask_and_refuses_the_rest():
    from fcp_runtime import KindsRankPlan, load_rank_plan
    from fcp_runtime.plan import resolve_kind

    plan = compile_plan(_spec(), 8, block_size=128)
    rank_plan = load_rank_plan(plan.data, 2)
    assert isinstance(rank_plan, KindsRankPlan)
    assert resolve_kind(rank_plan, "sliding_attention") is rank_plan.kinds["sliding_attention"]
    assert resolve_kind(rank_plan, mask=(True, 96)) is rank_plan.kinds["sliding_attention"]
    assert resolve_kind(rank_plan, mask=(True, None)) is rank_plan.kinds["full_attention"]
    assert rank_plan.plan_tokens == rank_plan.kinds["sliding_attention"].plan_tokens
    with pytest.raises(ValueError, match="'local' is not in the plan; its kinds: full_attention, sliding_attention"):
        resolve_kind(rank_plan, "local")
    with pytest.raises(ValueError, match="no layer kind of the plan has the layer's mask sliding window 128"):
        resolve_kind(rank_plan, mask=(True, 128))
    with pytest.raises(ValueError, match="name the layer's"):
        resolve_kind(rank_plan)
    single = load_rank_plan(compile_plan(LENGTHS, 8, block_size=128).data, 0)
    with pytest.raises(ValueError, match="holds one schedule for every layer"):
        resolve_kind(single, "full_attention")


def test_a_plain_plan_reader_names_the_kinds_file_and_kinds_with_other_layouts_are_invalid():
    plan = compile_plan(_spec(), 8, block_size=128)
    with pytest.raises(PlanFormatError, match="holds a plan for each of several layer kinds"):
        PlanReader(plan.data)
    # Two kinds' plans from two different placements, put in one file, are refused: one layout serves all.
    from fcp_compiler.format.kinds import encode_kinds

    # Both from FCP's own placement (one token cap), each for its own mask.
    own_full = compile_plan(_spec(), 8, block_size=128, floor=False, node_fan_out=False).kind("full_attention").plan
    other = compile_plan(BatchSpec(sequences=LENGTHS, mask={"kind": "sliding_window", "window": 96}), 8,
                         block_size=128, floor=False, node_fan_out=False)
    mixed = encode_kinds([("full_attention", {"kind": "causal"}, 2, own_full.data),
                          ("sliding_attention", {"kind": "sliding_window", "window": 96}, 2, other.data)],
                         "full_attention")
    assert not np.array_equal(PlanReader(other.data).rank(0).arrays["blocks"],
                              PlanReader(own_full.data).rank(0).arrays["blocks"])
    with pytest.raises(PlanInvalidError, match="invariant 7"):
        validate_kinds(mixed)
    # A kind whose plan has another mask than the header says is refused too.
    full = plan.kind("full_attention").plan
    swapped = encode_kinds([("full_attention", {"kind": "causal"}, 2, plan.kind("sliding_attention").plan.data),
                            ("sliding_attention", {"kind": "sliding_window", "window": 96}, 2, full.data)],
                           "full_attention")
    with pytest.raises(PlanInvalidError, match="invariant 7.*kind 'full_attention' has mask"):
        validate_kinds(swapped)


def test_a_corrupt_kinds_header_is_refused_in_one_line():
    data = bytearray(compile_plan(_spec(), 8, block_size=128).data)
    data[60] ^= 1
    with pytest.raises(PlanFormatError, match="sha256"):
        PlanKinds(bytes(data))
    with pytest.raises(PlanFormatError, match="ends inside"):
        PlanKinds(bytes(data[:20]))


@pytest.mark.parametrize("batch,message", [
    ({"sequences": [10], "layers": {}}, "layers names 0 kinds"),
    ({"sequences": [10], "layers": {"9x": "causal"}}, "layer kind name '9x'"),
    ({"sequences": [10], "layers": {"a": "causal", "b": "causal"}}, "layer kinds 'a' and 'b' have one mask"),
    ({"sequences": [10], "mask": "full", "layers": {"a": "causal"}}, "give either 'layers'"),
    ({"sequences": [10], "layer_mix": {"a": 1}}, "give 'layers' too"),
    ({"sequences": [10], "layers": {"a": "causal"}, "layer_mix": {"b": 1}}, "'a' has no count"),
    ({"sequences": [10], "layers": {"a": "causal"}, "layer_mix": {"a": -1}}, "a=-1 must be a layer count"),
    ({"sequences": [10], "layers": {"a": "causal"}, "layer_mix": {"a": 0}}, "every count of the layer mix is 0"),
    ({"sequences": [10], "layers": {"a": "causal"}, "layer_mix": {"a": "2"}}, "layer_mix.a: Input should be a valid "
                                                                              "integer"),
    ({"sequences": [10], "layers": {"a": "causal"}, "layer_mix": {"a": True}}, "layer_mix.a"),
])
def test_bad_layer_kinds_in_a_batch_are_refused_with_one_line(batch, message):
    with pytest.raises(InvalidInputError, match=message):
        parse_batch(batch)


def test_layer_masks_and_mix_flags_parse_and_refuse_bad_forms():
    assert parse_layer_masks("g=causal,l=sliding_window:128")["l"].window == 128
    assert parse_layer_mix("g=3, l=1") == {"g": 3, "l": 1}
    for value, message in (("g", "each entry must be NAME=VALUE"), ("g=causal,g=full", "named twice"),
                           ("g=sliding_window:x", "the window must be a positive integer")):
        with pytest.raises(InvalidInputError, match=message):
            parse_layer_masks(value)
    with pytest.raises(InvalidInputError, match="a layer count must be an integer"):
        parse_layer_mix("g=two")
    # Kinds without a mix, and a mix without kinds.
    with pytest.raises(InvalidInputError, match="have no layer mix.*--layer-mix g=COUNT,l=COUNT"):
        compile_plan(LENGTHS, 8, block_size=128, layer_masks="g=causal,l=sliding_window:96")
    with pytest.raises(InvalidInputError, match="the batch names none"):
        compile_plan(LENGTHS, 8, block_size=128, layer_mix="g=1")
    with pytest.raises(InvalidInputError, match="--planner ring compiles one mask"):
        compile_plan(_spec(), 8, planner="ring")


def test_a_model_preset_gives_the_mix_of_its_kinds():
    layers = {"sliding_attention": {"kind": "sliding_window", "window": 128}, "full_attention": "causal"}
    plan = compile_plan(BatchSpec(sequences=LENGTHS, layers=layers), 8, block_size=128, model="gpt-oss-120b")
    assert {row["name"]: row["num_layers"] for row in plan.stats["layer_kinds"]} == \
        {"sliding_attention": 18, "full_attention": 18}


def test_the_cli_compiles_validates_inspects_simulates_and_diffs_a_plan_of_layer_kinds(tmp_path, capsys):
    from conftest import run_cli

    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps(LENGTHS))
    out = tmp_path / "batch.fcp"
    code, text, err = run_cli(capsys, "compile", batch, "--gpus", 8, "--block-size", 128, "--layer-masks",
                              "global=causal,local=sliding_window:96", "--layer-mix", "global=1,local=3", "-o", out)
    assert code == 0, err
    assert "layer kinds" in text and "local" in text and "sliding_window:96" in text, text
    code, text, err = run_cli(capsys, "validate", out)
    assert code == 0 and "2 layer kinds" in text, text + err
    code, text, err = run_cli(capsys, "inspect", out)
    assert code == 0 and "local" in text and "global" in text, text + err
    code, text, err = run_cli(capsys, "simulate", out)
    assert code == 0 and "layer mix" in text, text + err
    other = tmp_path / "other.fcp"
    assert run_cli(capsys, "compile", batch, "--gpus", 8, "--block-size", 128, "--layer-masks",
                   "global=causal,local=sliding_window:64", "--layer-mix", "global=1,local=3", "-o", other)[0] == 0
    code, text, err = run_cli(capsys, "diff", out, other)
    assert "local" in text and "global" in text, text + err
    code, text, err = run_cli(capsys, "compile", batch, "--gpus", 8, "--layer-masks", "global=causal,local=window:9",
                              "-o", tmp_path / "bad.fcp")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "local=" in err, err
    assert not (tmp_path / "bad.fcp").exists()


def test_a_plan_of_layer_kinds_compiles_from_a_batch_file_and_in_bulk(tmp_path, capsys):
    from conftest import run_cli

    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"layers": KINDS, "layer_mix": {"full_attention": 1, "sliding_attention": 1},
                                 "sequences": LENGTHS}))
    code, text, err = run_cli(capsys, "compile", batch, "--gpus", 8, "--block-size", 128, "-o", tmp_path / "a.fcp")
    assert code == 0 and "sliding_attention" in text, err
    assert set(validate_kinds(tmp_path / "a.fcp")) == set(KINDS)
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps(LENGTHS) + "\n" + json.dumps(LENGTHS[:5]) + "\n")
    code, text, err = run_cli(capsys, "compile", steps, "--gpus", 4, "--block-size", 128, "--layer-masks",
                              "g=causal,l=sliding_window:50", "--layer-mix", "g=1,l=1", "-o", tmp_path / "plans",
                              "--jobs", 1)
    assert code == 0, err
    plans = sorted((tmp_path / "plans").glob("*.fcp"))
    assert len(plans) == 2 and all(PlanKinds(path).names == ["g", "l"] for path in plans)


def test_compile_options_take_a_shape_as_its_json_and_refuse_a_bad_one():
    from fcp_compiler.core.options import CompileOptions

    assert CompileOptions.of(8, shape={"q_heads": 8, "kv_heads": 2, "head_dim": 64}).shape.kv_heads == 2
    with pytest.raises(InvalidInputError, match="shape .*q_heads 6 is not a multiple of kv_heads 4"):
        CompileOptions.of(8, shape={"q_heads": 6, "kv_heads": 4})


def test_prefetch_kv_takes_the_kind_and_a_plan_of_layer_kinds_replays_with_it():
    from runtime_harness import run_ranks

    lengths = [700, 300, 120, 900]
    plan = compile_plan(_spec(lengths), 4, block_size=128)

    def task(rank, world):
        import torch

        from fcp_runtime import fcp_attn_func, load_rank_plan, prefetch_kv

        rank_plan = load_rank_plan(plan.data, rank)
        generator = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(rank_plan.plan_tokens, heads, 8, generator=generator, dtype=torch.float64)
                   for heads in (4, 2, 2))
        outs = {}
        for name in KINDS:
            prefetched = prefetch_kv(k, v, rank_plan, kind=name)
            outs[name] = fcp_attn_func(q, k, v, rank_plan, kind=name, prefetched=prefetched)
            torch.testing.assert_close(outs[name], fcp_attn_func(q, k, v, rank_plan, kind=name), rtol=0, atol=0)
        return float((outs["full_attention"] - outs["sliding_attention"]).abs().max())

    assert max(run_ranks(4, task)) > 1e-3  # the kinds compute different attention


def test_a_kinds_rank_plan_answers_for_its_layout_and_names_a_kind_for_the_rest():
    from fcp_runtime import load_rank_plan

    rank_plan = load_rank_plan(compile_plan(_spec(), 8, block_size=128).data, 5)
    assert rank_plan.rank == 5 and rank_plan.num_ranks == 8 and rank_plan.position_ids.numel() == rank_plan.plan_tokens
    with pytest.raises(AttributeError, match="take plan.kind\\(NAME\\).forward"):
        rank_plan.forward


@pytest.mark.parametrize("command", ["compare", "sweep", "ablate"])
def test_studies_of_one_mask_refuse_a_batch_of_layer_kinds_in_one_line(tmp_path, capsys, command):
    from conftest import run_cli

    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"layers": KINDS, "layer_mix": {"full_attention": 1, "sliding_attention": 1},
                                 "sequences": LENGTHS}))
    code, _, err = run_cli(capsys, command, batch, "--gpus", 8)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"fcp {command} studies one mask" in err, err


def _forged(header: bytes, body: bytes = b"") -> bytes:
    import hashlib
    import struct

    return b"FCPKINDS" + struct.pack("<I", len(header)) + hashlib.sha256(header).digest() + header + body


@pytest.mark.parametrize("header,message", [
    (b"[" * 30000 + b"]" * 30000, "bad kinds header"),  # nested past the JSON parser's depth
    (b"\xff\xfe", "bad kinds header"),
    (b'{"format": 1, "primary": "a", "kinds": []}', "bad kinds header"),
    (b'{"format": 2, "primary": "a", "kinds": [{"name": "a", "mask": {"kind": "causal"}, "num_layers": 1, '
     b'"offset": 0, "length": 10}]}', "kinds format 2"),
    (b'{"format": 1, "primary": "a", "kinds": [{"name": "a", "mask": {"kind": "causal"}, "num_layers": 1, '
     b'"offset": 0, "length": 4294967296}]}', "lies outside"),
    # json.loads keeps a repeated key's last value silently: which primary, which offset, is the file's to say once.
    (b'{"format": 1, "primary": "b", "primary": "a", "kinds": [{"name": "a", "mask": {"kind": "causal"}, '
     b'"num_layers": 1, "offset": 0, "length": 16}]}', "bad kinds header: key 'primary' appears more than once"),
    (b'{"format": 1, "primary": "a", "kinds": [{"name": "a", "mask": {"kind": "causal"}, "num_layers": 1, '
     b'"offset": 0, "offset": 0, "length": 16}]}', "bad kinds header: key 'offset' appears more than once"),
    (b'{"format": 1, "primary": "a", "kinds": [{"name": "9a", "mask": {"kind": "causal"}, "num_layers": 1, '
     b'"offset": 0, "length": 16}]}', "bad kinds header field 'kinds.0.name': String should match pattern .*"
                                      "\\(got '9a'\\)"),
])
def test_a_forged_kinds_header_is_refused_in_one_line(header, message):
    with pytest.raises(PlanFormatError, match=message) as caught:
        PlanKinds(_forged(header, b"\0" * 16))
    assert "\n" not in str(caught.value) and "Value error" not in str(caught.value)


@pytest.mark.parametrize("field, value, shown", [("shape.dtype", "fp32", "'fp32', kind 'full_attention' 'bf16'"),
                                                 ("shape.q_heads", 32, "32, kind 'full_attention' 64"),
                                                 ("model", "llama3-8b", "'llama3-8b', kind 'full_attention' "
                                                                        "'llama3-70b'"),
                                                 ("zigzag", True, "True, kind 'full_attention' False")])
def test_kinds_of_other_attention_shapes_are_refused_on_load_and_by_validate(tmp_path, capsys, field, value, shown):
    """The runtime reads the attention shape of a plan of layer kinds from one kind for all: kinds whose shapes
    differ are refused wherever the file is read (PlanKinds: fcp validate, the runtime's loader), naming the field
    and both values (issue 65, N9)."""
    from conftest import run_cli
    from fcp_compiler.format.kinds import encode_kinds
    from fcp_compiler.format.plan_format import rebuild_plan

    plan = compile_plan(_spec(), 8, block_size=128)
    sliding = PlanReader(plan.kind("sliding_attention").plan.data)
    name, _, part = field.partition(".")
    changed = {**getattr(sliding.header, name).model_dump(mode="json"), part: value} if part else value
    forged = encode_kinds([("full_attention", {"kind": "causal"}, 2, plan.kind("full_attention").plan.data),
                           ("sliding_attention", {"kind": "sliding_window", "window": 96}, 2,
                            rebuild_plan(sliding, **{name: changed}))], "full_attention")
    message = f"layer kind 'sliding_attention' has {field} {shown}: a plan's layer kinds share one"
    with pytest.raises(PlanFormatError, match=message):
        PlanKinds(forged)
    with pytest.raises(PlanFormatError, match=message):
        validate_kinds(forged)
    from fcp_runtime import load_rank_plan

    with pytest.raises(PlanFormatError, match=message):
        load_rank_plan(forged, 0)
    path = tmp_path / "forged.fcp"
    path.write_bytes(forged)
    code, _, err = run_cli(capsys, "validate", path)
    assert code == 2 and err.count("\n") == 1 and message in err, err
