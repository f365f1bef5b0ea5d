"""The tools over a plan of layer kinds (one plan for each kind, fcp_compiler.format.kinds): what `fcp inspect`,
`fcp simulate`, `fcp validate` and `fcp diff` show of its kinds, and the table `fcp compile` prints of them."""

from __future__ import annotations

from fcp_compiler.errors import InvalidInputError
from fcp_compiler.format.kinds import PlanKinds
from fcp_compiler.format.validate import PlanInvalidError, ValidationReport
from fcp_compiler.tools.diff import diff_plans, invalid_after
from fcp_compiler.tools.report import mask_text, table


def validation_lines(path, kinds: PlanKinds, reports: dict[str, ValidationReport]) -> str:
    """What `fcp validate` prints for a valid plan of layer kinds."""
    lines = [f"{path}: valid. {len(reports)} layer kinds over one layout (one dispatch), each kind's plan keeping "
             f"invariants 0-5 and its mask's windows:"]
    lines.append(table(["kind", "mask", "layers", "tiles", "pulls", "rounds", "live tokens", "GiB fwd/bwd"], [
        [kind.name, mask_text(kind.mask.model_dump(mode="json")), kind.num_layers, report.num_tiles,
         report.num_pulls, report.num_rounds, report.max_buffer_tokens,
         f"{report.max_buffer_bytes_fwd / 2**30:.2f}/{report.max_buffer_bytes_bwd / 2**30:.2f}"]
        for kind, report in zip(kinds.kinds, reports.values())]))
    return "\n".join(lines)


def inspect_kinds(path, kinds: PlanKinds) -> str:
    """What `fcp inspect` prints for a plan of layer kinds: its kinds, each one's schedule in a line (--kind NAME
    inspects one kind's plan as a plan of its own)."""
    rows = []
    for kind in kinds.kinds:
        header = kind.reader.header
        rows.append([kind.name + (" (primary)" if kind.name == kinds.header.primary else ""),
                     mask_text(kind.mask.model_dump(mode="json")), kind.num_layers, header.num_rounds,
                     f"{header.num_fwd_stages}/{header.num_bwd_stages}", f"{header.coalesce}/{header.bwd_coalesce}",
                     header.max_buffer_tokens, f"{max(header.max_buffer_bytes_fwd) / 2**30:.2f}/"
                                               f"{max(header.max_buffer_bytes_bwd) / 2**30:.2f}",
                     header.inputs_digest[:16]])
    first = kinds.kinds[0].reader.header
    return "\n".join([
        f"{path}: plan of {len(rows)} layer kinds over one layout: {first.num_ranks} ranks, "
        f"{first.total_tokens} tokens in {first.num_sequences} sequences, {first.num_blocks} blocks of "
        f"{first.block_size}, {first.layout.value} layout (fcp inspect --kind NAME for one kind's ranks)",
        table(["kind", "mask", "layers", "pull rounds", "stages fwd/bwd", "coalesce", "live tokens",
               "peak GiB fwd/bwd", "digest"], rows)])


def simulate_kinds(kinds: PlanKinds, profile=None, model: str | None = None,
                   kv_prefetch: bool | None = None) -> dict:
    """Every kind simulated, and the model's mix: {"kinds": [{name, mask, num_layers, figures}], "layer_mix_s"}."""
    from fcp_compiler.core.simulate import layer_seconds, simulate_plan

    rows = []
    for kind in kinds.kinds:
        figures = simulate_plan(kind.reader, profile, model=model, kv_prefetch=kv_prefetch).figures()
        rows.append({"name": kind.name, "mask": kind.mask.model_dump(mode="json"), "num_layers": kind.num_layers,
                     "figures": figures})
    mix = sum(row["num_layers"] * layer_seconds(row["figures"]) for row in rows)
    return {"kinds": rows, "layer_mix_s": mix}


def simulation_lines(result: dict) -> str:
    """What `fcp simulate` prints for a plan of layer kinds: each kind's passes, then the layer mix."""
    rows = [[row["name"], mask_text(row["mask"]), row["num_layers"],
             f"{row['figures']['makespan_fwd_s'] * 1e3:.2f}", f"{row['figures']['makespan_bwd_s'] * 1e3:.2f}",
             f"{row['figures']['layer_makespan_fwd_s'] * 1e3:.2f}",
             f"{row['figures']['layer_makespan_bwd_s'] * 1e3:.2f}", f"{row['figures']['normalized_layer_mfu']:.3f}"]
            for row in result["kinds"]]
    model = result["kinds"][0]["figures"]["model"]
    return "\n".join([
        table(["kind", "mask", "layers", "attention fwd ms", "attention bwd ms", "layer fwd ms", "layer bwd ms",
               "norm. layer MFU"], rows),
        f"  layer mix ({model}): {result['layer_mix_s'] * 1e3:.1f} ms a step, every kind's layers forward and "
        f"backward (fcp simulate --kind NAME for one kind's tables and trace)"])


def diff_kinds(a: PlanKinds, b: PlanKinds, tolerance: float) -> dict:
    """Each kind both plans have, diffed as two plans (fcp_compiler.tools.diff), and the kinds only one has:
    {"changed", "regressed", "kinds": {name: diff}, "only_a", "only_b"}.

    Raises:
        InvalidInputError: one plan of layer kinds and the other not (a plan of one kind has no kind to match by
            name), naming which is which.
    """
    from fcp_compiler.format.validate import validate_plan

    if a.kinds_file != b.kinds_file:
        kinds, plain = (a, b) if a.kinds_file else (b, a)
        raise InvalidInputError(f"{kinds.origin} ({'A' if kinds is a else 'B'}) is a plan of layer kinds "
                                f"{', '.join(kinds.names)} and {plain.origin} ({'A' if plain is a else 'B'}) a "
                                f"plan of one kind: fcp diff compares two plans of one kind, or two plans of layer "
                                f"kinds, kind by kind")

    readers_a = {kind.name: kind.reader for kind in a.kinds}
    readers_b = {kind.name: kind.reader for kind in b.kinds}
    result = {"kinds": {}, "only_a": [name for name in readers_a if name not in readers_b],
              "only_b": [name for name in readers_b if name not in readers_a]}
    for name in (name for name in readers_a if name in readers_b):
        first, second = readers_a[name], readers_b[name]
        validate_plan(first, background=True)
        try:
            validate_plan(second, background=True)
            result["kinds"][str(name)] = diff_plans(first, second, tolerance)
        except PlanInvalidError as error:
            result["kinds"][str(name)] = invalid_after(error)
    result["changed"] = bool(result["only_a"] or result["only_b"]) or \
        any(diff["changed"] for diff in result["kinds"].values())
    result["regressed"] = any(diff["regressed"] for diff in result["kinds"].values())
    return result


def diff_lines(result: dict, path_a, path_b) -> str:
    """What `fcp diff` prints for plans of layer kinds: each shared kind's diff, then the kinds only one plan has."""
    from fcp_compiler.tools.report import diff_summary

    lines = []
    for name, diff in result["kinds"].items():
        lines += [f"layer kind {name}:", diff_summary(diff, f"{path_a} [{name}]", f"{path_b} [{name}]")]
    for side, path in (("only_a", path_a), ("only_b", path_b)):
        if result[side]:
            lines.append(f"layer kinds only in {path}: {', '.join(map(str, result[side]))}")
    return "\n".join(lines)
