"""The `fcp` command: parse, call the library, print."""

from __future__ import annotations

import json
import math
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

from fcp_compiler.errors import SHOWN_CHARS, FcpError, InvalidInputError, clipped, shown
from fcp_compiler.format.safe_io import check_outputs

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="fcp: compile batches of sequence lengths into per-rank flexible context parallel plans.")
trace_app = typer.Typer(no_args_is_help=True, help="Generate batches filled to exactly gpus x tokens-per-gpu tokens.")
app.add_typer(trace_app, name="trace")

_INTEGER = re.compile(r"[+-]?[0-9]{1,40}")
_DECIMAL = re.compile(r"[+-]?([0-9]{1,40}(\.[0-9]{0,40})?|\.[0-9]{1,40})([eE][+-]?[0-9]{1,4})?")


def _ascii_int(value: object) -> int:
    """An integer option: ASCII digits only (no 4096.0, no other scripts' digits)."""
    if isinstance(value, int):
        return value
    if not _INTEGER.fullmatch(str(value)):
        raise typer.BadParameter(f"{shown(str(value))} is not an integer (ASCII digits, like 4096)")
    return int(value)


def _on_off(flag: str, value: str | None) -> bool | None:
    """A switch given as on or off (None: not given)."""
    if value is None:
        return None
    if value not in ("on", "off"):
        raise InvalidInputError(f"{flag} {shown(value)} must be on or off")
    return value == "on"


def _finite_float(value: object) -> float:
    """A number option: ASCII decimal notation, finite."""
    if isinstance(value, float):
        return value
    if not _DECIMAL.fullmatch(str(value)) or not math.isfinite(float(value)):
        raise typer.BadParameter(f"{shown(str(value))} is not a finite decimal number (like 1.8 or 1e-3)")
    return float(value)


GPUS = typer.Option(..., "--gpus", help="number of ranks (GPUs), >= 1", parser=_ascii_int)
PROFILE = typer.Option("h100", "--profile", help="preset (h100, h200, a100, b200) or a profile JSON")


def _write_json(path: Path, data: object) -> None:
    from fcp_compiler.format.safe_io import write_atomic

    write_atomic(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


MEMORY_BUDGET = typer.Option(None, "--memory-budget", help="GiB of device memory a rank's attention may peak at in "
                             "either pass; stages shrink until every rank fits, and a budget none meets is refused; "
                             "none: no budget [4 with a model: what Llama-3-70B leaves of an 80 GB H100 at 256 GPUs; "
                             "none with --model none]")
NODE_FAN_OUT = typer.Option(None, "--node-fan-out", help="on or off: a K,V block crosses into a node once and fans "
                            "out over NVLink [fcp tries both; magi on; ring, bytescale, wlbllm off]")
LAYER_MASKS = typer.Option(None, "--layer-masks", help="layer kinds, each with its mask for every sequence: "
                           "NAME=MASK,... e.g. full_attention=causal,sliding_attention=sliding_window:128; one "
                           "placement (one dispatch), one schedule a kind [the batch's 'layers']")
LAYER_MIX = typer.Option(None, "--layer-mix", help="layers of each kind in the model, NAME=COUNT,...: the placement "
                         "is chosen by the mix's time [the batch's 'layer_mix', else the --model preset's]")


@app.command("compile")
def compile_command(
    batch: Path = typer.Argument(..., help="batch JSON: {\"mask\": MASK, \"sequences\": [...]}, {\"masks\": [MASK, "
                                            "...], \"sequences\": [...]} or a list of lengths (causal); MASK is "
                                            "\"causal\", \"full\" or {\"kind\": \"sliding_window\", \"window\": W}"),
    gpus: int = GPUS,
    block_size: Optional[int] = typer.Option(None, "--block-size", help="tokens per block, a positive multiple of 64 "
                                                                        "[4096; not for ring, bytescale, wlbllm]",
                                            parser=_ascii_int),
    coalesce: int = typer.Option(16, "--coalesce", help="rounds merged into one stage", parser=_ascii_int),
    profile: str = PROFILE,
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node",
                                                help="GPUs sharing NVLink in a node, each with its own NIC [the "
                                                     "profile's: 8]", parser=_ascii_int),
    token_cap: Optional[int] = typer.Option(None, "--token-cap", help="most tokens per rank [mean + one block]",
                                            parser=_ascii_int),
    token_tolerance: Optional[float] = typer.Option(
        None, "--token-tolerance", help="keep ranks within this fraction of the mean tokens where blocks allow "
                                        "(plan layout's linear layers; costs some traffic) [0.05 with a model in "
                                        "the plan layout, else off]", parser=_finite_float),
    zigzag: str = typer.Option("auto", "--zigzag", help="auto, on or off"),
    layout: str = typer.Option("plan", "--layout",
                               help="plan: tokens dispatched once into the plan's layout; user: attention reshuffles"),
    planner: str = typer.Option("fcp", "--planner", help="fcp, or a baseline: ring, bytescale, wlbllm, magi"),
    node_fan_out: Optional[str] = NODE_FAN_OUT,
    no_floor: bool = typer.Option(False, "--no-floor", help="fcp: schedule its own placement only (direct unless "
                                  "--node-fan-out on), not the floor's candidates: to study it, not a faster compile "
                                  "(nothing guards its time)"),
    no_pipeline: bool = typer.Option(False, "--no-pipeline", help="ablation: every tile after the last pull"),
    arbitrary_rounds: bool = typer.Option(False, "--arbitrary-rounds",
                                          help="ablation: pulls in edge order, not matchings (fails validation)"),
    no_reshuffle_overlap: bool = typer.Option(False, "--no-reshuffle-overlap",
                                              help="ablation: no tiles during the reshuffle"),
    no_kv_prefetch: bool = typer.Option(False, "--no-kv-prefetch", help="schedule for a runtime that posts each "
                                        "pass's first-stage K,V pulls when attention starts, not early (forward: "
                                        "while Q is projected; fcp_runtime.prefetch_kv)"),
    mask: Optional[str] = typer.Option(None, "--mask", help="override the batch's mask(s): causal, full or "
                                                            "sliding_window:W (the W most recent keys) [the batch's]"),
    layer_masks: Optional[str] = LAYER_MASKS,
    layer_mix: Optional[str] = LAYER_MIX,
    q_heads: int = typer.Option(64, "--q-heads", help="attention query heads", parser=_ascii_int),
    kv_heads: int = typer.Option(8, "--kv-heads", help="key/value heads (grouped-query attention; divides --q-heads)",
                                 parser=_ascii_int),
    head_dim: int = typer.Option(128, "--head-dim", help="size of one head", parser=_ascii_int),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16, fp32 or fp64"),
    model: str = typer.Option("llama3-70b", "--model", help="the layer whose per-rank time (linear layers on a "
                                                            "rank's tokens + attention) placement balances: "
                                                            "llama3-8b, llama3-70b, gpt-oss-120b or none "
                                                            "(attention alone)"),
    memory_budget: Optional[str] = MEMORY_BUDGET,
    output: Optional[Path] = typer.Option(None, "-o", "--output",
                                          help="plan file [BATCH name with .fcp]; a folder for a .jsonl"),
    stats: Optional[Path] = typer.Option(None, "--stats", help="write the plan's figures as JSON [not written]"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print nothing on success"),
    jobs: Optional[int] = typer.Option(None, "--jobs", help="processes for a .jsonl of batches [all cores]",
                                       parser=_ascii_int),
) -> None:
    """Compile a batch into a plan file and print its summary; a .jsonl of batches compiles into a folder."""
    from fcp_compiler.core.options import CompileOptions
    from fcp_compiler.format.inputs import make_shape

    options = CompileOptions.of(gpus, block_size=block_size, coalesce=coalesce, token_cap=token_cap,
                                token_tolerance=token_tolerance, zigzag=zigzag, layout=layout,
                                shape=make_shape(q_heads, kv_heads, head_dim, dtype), profile=profile, mask=mask,
                                pipelined=not no_pipeline, matching_rounds=not arbitrary_rounds,
                                reshuffle_overlap=not no_reshuffle_overlap, kv_prefetch=not no_kv_prefetch,
                                planner=planner, model=model,
                                gpus_per_node=gpus_per_node, node_fan_out=_on_off("--node-fan-out", node_fan_out),
                                floor=not no_floor, memory_budget_gib=_memory_budget(memory_budget),
                                layer_masks=layer_masks, layer_mix=layer_mix)
    if batch.suffix == ".jsonl":
        if stats is not None:
            raise InvalidInputError(f"--stats {str(stats)!r} takes one batch; a .jsonl of batches prints its table "
                                    f"and each plan carries its own figures (fcp inspect)")
        _bulk(batch, output or Path(f"{batch.stem}_plans"), jobs, quiet, options)
        return
    if jobs is not None:
        raise InvalidInputError(f"--jobs {jobs} takes a .jsonl of batches; {str(batch)!r} is one batch")
    _compile_one(batch, output or Path(batch.with_suffix(".fcp").name), stats, quiet, options, profile)


def _compile_one(batch: Path, output: Path, stats: Path | None, quiet: bool, options, profile: str) -> None:
    """Compile one batch file; the plan (and --stats) written together, then the summary."""
    from fcp_compiler.core.pipeline import compile_plan
    from fcp_compiler.core.simulate import layer_stats
    from fcp_compiler.format.inputs import load_batch
    from fcp_compiler.format.safe_io import write_files_atomic
    from fcp_compiler.tools.report import compile_summary, floor_progress_line, memory_warning

    # Before compiling: a bad target costs nothing, and no output may overwrite an input or another output.
    check_outputs([("-o", output), ("--stats", stats)], [("BATCH", batch), ("--profile", _profile_file(profile))])
    # On a terminal, each floor candidate as it is scheduled (seconds each at hundreds of ranks).
    progress = (lambda row: typer.echo(floor_progress_line(row), err=True)) if not quiet and sys.stderr.isatty() \
        else None
    plan = compile_plan(load_batch(batch), options=options, progress=progress)
    # The simulated layer makespans and their gap to the bound, for whoever reads them (a quiet compile skips them).
    figures = {**plan.stats, **layer_stats(plan)} if (stats or not quiet) and "layer_makespan_fwd_s" not in plan.stats \
        else plan.stats
    # The plan and its figures land together or not at all.
    files = [(output, plan.to_bytes())]
    if stats:
        files.append((stats, (json.dumps(figures, indent=2, sort_keys=True) + "\n").encode()))
    write_files_atomic(files)
    if not quiet:
        typer.echo(compile_summary(figures, str(output)))
    if (warning := memory_warning(plan.stats)) is not None:  # even when quiet: the plan may not fit its GPUs
        typer.echo(warning, err=True)


def _memory_budget(value: str | None) -> float | None:
    """--memory-budget: GiB, or none (math.inf: no budget); None: the default."""
    if value is None:
        return None
    if value.strip().lower() == "none":
        return math.inf
    try:
        budget = float(value)
    except ValueError:
        budget = None
    if budget is None or not math.isfinite(budget):
        raise InvalidInputError(f"--memory-budget {shown(value)} must be a number of GiB (e.g. 4) or none")
    return budget


def _profile_file(profile: str | None) -> Path | None:
    """The profile's file, when --profile names one rather than a preset."""
    return Path(profile) if profile is not None and Path(profile).suffix == ".json" else None


def _bulk(batch: Path, out_dir: Path, jobs: Optional[int], quiet: bool, options) -> None:
    from fcp_compiler.tools.bulk import bulk_compile, read_jsonl
    from fcp_compiler.tools.parallel import request_stop
    from fcp_compiler.tools.report import bulk_summary, progress_bar

    if jobs is not None and jobs < 1:
        raise InvalidInputError(f"--jobs {jobs} must be >= 1")
    if out_dir.suffix == ".fcp" and not out_dir.is_dir():
        raise InvalidInputError(f"-o {str(out_dir)!r} names a plan file, but a .jsonl of batches compiles into a "
                                f"folder of plans: give a folder (e.g. -o {out_dir.stem}_plans/)")
    batches = read_jsonl(batch)

    counts = [0, len(batches)]

    def progress(done: int, total: int) -> None:
        counts[:] = [done, total]
        # A bar that redraws on a terminal; a single line at the end otherwise (logs, CI).
        if not quiet and (sys.stderr.isatty() or done == total):
            sys.stderr.write(progress_bar(done, total) + ("\n" if done == total else ""))
            sys.stderr.flush()

    def interrupt(signum, frame) -> None:
        request_stop(signum)  # noted too: an interrupt raised inside a finalizer is swallowed, the next step stops
        raise KeyboardInterrupt

    # SIGTERM (a scheduler stopping the job) ends the run as Ctrl-C does: with the line that says what is written.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {stop: signal.signal(stop, interrupt) for stop in (signal.SIGINT, signal.SIGTERM)} \
        if in_main_thread else {}
    try:
        summary = bulk_compile(batches, out_dir, options, jobs=jobs, progress=progress)
    except (KeyboardInterrupt, typer.Abort):
        typer.echo(f"\nfcp compile: stopped with {counts[0]} of {counts[1]} plans in {out_dir} (the same command "
                   f"resumes)", err=True)
        raise
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)
    if not quiet:
        typer.echo(bulk_summary(summary, out_dir))


@app.command("validate")
def validate_command(plan: Path = typer.Argument(..., help="plan file")) -> None:
    """Check every invariant of docs/DESIGN.md section 4; exit 1 naming the first one broken."""
    from fcp_compiler.format.kinds import PlanKinds
    from fcp_compiler.format.validate import PlanInvalidError
    from fcp_compiler.format.validate_kinds import validate_kinds
    from fcp_compiler.tools.kinds import validation_lines
    from fcp_compiler.tools.report import validation_summary

    try:
        reports = validate_kinds(str(plan), background=True)
    except PlanInvalidError as error:
        typer.echo(f"fcp: invalid plan {plan}: {error}", err=True)
        raise typer.Exit(1)
    if None in reports:  # a plan of one kind
        typer.echo(validation_summary(plan, reports[None]))
    else:
        typer.echo(validation_lines(plan, PlanKinds(str(plan)), reports))


@app.command("inspect")
def inspect_command(
    plan: Path = typer.Argument(..., help="plan file"),
    rank: Optional[int] = typer.Option(None, "--rank", help="show one rank's program stage by stage [every rank's "
                                                                   "figures]",
                                       parser=_ascii_int),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of tables"),
    memory: bool = typer.Option(False, "--memory", help="add each rank's device memory peak per pass, in GiB, as "
                                                        "the header states it (fcp validate recomputes it)"),
    kind: Optional[str] = typer.Option(None, "--kind", help="one of the plan's layer kinds, inspected as a plan of its "
                                                            "own [the kinds' table]"),
) -> None:
    """Show a plan's parameters and per-rank figures, or one rank's program (a plan of layer kinds: its kinds)."""
    from fcp_compiler.tools.kinds import inspect_kinds
    from fcp_compiler.tools.report import add_memory_columns, inspect_summary, rank_program_text, rank_rows

    kinds = _plan_kinds(plan, kind)
    if kinds.kinds_file and kind is None:
        if rank is not None or as_json or memory:
            raise InvalidInputError(f"{plan} is a plan of layer kinds {', '.join(kinds.names)}: give --kind NAME "
                                    f"with --rank, --json or --memory")
        typer.echo(inspect_kinds(plan, kinds))
        return
    reader = kinds.kind(kind).reader if kind is not None else kinds.kinds[0].reader
    header = reader.header
    if rank is not None:
        program = reader.rank(rank)
        if as_json:
            from fcp_compiler.format.memory import rank_peak_bytes

            typer.echo(json.dumps({"rank": rank, **{k: v.tolist() for k, v in program.arrays.items()},
                                   "peak_bytes": rank_peak_bytes(program)}))
        else:
            typer.echo(rank_program_text(program))
        return
    rows = rank_rows(reader)
    if memory:
        add_memory_columns(reader, rows)
    if as_json:
        shown = header.model_dump(mode="json", exclude={"rank_sections", "rank_sha256"})
        typer.echo(json.dumps({"header": shown, "ranks": rows}))
        return
    typer.echo(inspect_summary(plan, header, rows))


def _plan_kinds(plan: Path, kind: str | None):
    """A plan file's layer kinds (a plan of one kind is one, unnamed); --kind must name one of the plan's kinds."""
    from fcp_compiler.format.kinds import PlanKinds

    kinds = PlanKinds(str(plan))
    if kind is not None and (not kinds.kinds_file or kind not in kinds.names):
        have = f"its kinds: {', '.join(kinds.names)}" if kinds.kinds_file else "it is a plan of one kind"
        raise InvalidInputError(f"--kind {shown(kind)} is not a layer kind of {plan} ({have})")
    return kinds


def _one_kind(batch, command: str):
    """A batch for a study of one mask (compare, sweep, ablate): one with layer kinds is refused by name."""
    if batch.layers is not None:
        raise InvalidInputError(f"fcp {command} studies one mask; the batch names layer kinds "
                                f"({', '.join(batch.layers)}): compile them with fcp compile (fcp simulate shows "
                                f"each kind and the mix), or give the batch one mask")
    return batch


def _file_head(source: Path, size: int) -> bytes:
    """The first `size` bytes of a regular file (a FIFO or device is refused before it can block)."""
    from fcp_compiler.format.safe_io import open_regular_file

    handle, _ = open_regular_file(str(source), "input")
    with handle:
        return handle.read(size)


def _plan_or_batch(source: Path, gpus: Optional[int], profile: Optional[str], model: Optional[str] = None):
    """A plan file as it is (any fcp format: the reader names an old one), or a batch JSON compiled for --gpus
    (placed for `model`, default llama3-70b)."""
    from fcp_compiler.core.pipeline import compile_plan
    from fcp_compiler.format.inputs import load_batch
    from fcp_compiler.format.kinds import PlanKinds
    from fcp_compiler.format.plan_format import KINDS_MAGIC, MAGIC, PlanReader

    head = _file_head(source, 64)
    if head.startswith(MAGIC[:7]) or head.startswith(KINDS_MAGIC):  # this format's magic, the legacy, a kinds file
        reader = PlanKinds(str(source)) if head.startswith(KINDS_MAGIC) else PlanReader(str(source))
        if gpus is not None:  # a plan is simulated at the ranks it was compiled for: --gpus would be ignored
            ranks = reader.kinds[0].reader.header.num_ranks if isinstance(reader, PlanKinds) else \
                reader.header.num_ranks
            raise InvalidInputError(f"--gpus {gpus} is for a batch; {source} is a plan for {ranks} ranks (compile "
                                    f"the batch again for another count)")
        return reader
    if gpus is None:
        if head.lstrip()[:1] in (b"{", b"["):
            raise InvalidInputError(f"{source} is a batch, not a plan: give --gpus to compile it")
        raise InvalidInputError(f"{source} is neither an fcp plan nor a batch JSON (it starts with {head[:8]!r}); "
                                f"give a plan file, or a batch JSON with --gpus")
    data = compile_plan(load_batch(source), gpus, profile=profile or "h100",
                        **({"model": model} if model is not None else {})).to_bytes()
    return PlanKinds(data) if data.startswith(KINDS_MAGIC) else data


@app.command("simulate")
def simulate_command(
    source: Path = typer.Argument(..., help="plan file, or batch JSON (then give --gpus)"),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="ranks, when SOURCE is a batch [required then]",
                                      parser=_ascii_int),
    profile: Optional[str] = typer.Option(None, "--profile", help="hardware to simulate on [the plan's]"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the figures as JSON [not written]"),
    trace: Optional[Path] = typer.Option(None, "--trace", help="write a Chrome trace (open it in Perfetto) [not "
                                                                                "written]"),
    model: Optional[str] = typer.Option(None, "--model",
                                        help="the layer around attention: llama3-8b, llama3-70b or none "
                                             "[the plan's]"),
    kv_prefetch: Optional[str] = typer.Option(None, "--kv-prefetch", help="on or off: the runtime posts each pass's "
                                              "first-stage K,V pulls early (forward: while Q is projected; "
                                              "fcp_runtime.prefetch_kv; plan layout) [as the plan was compiled]"),
    kind: Optional[str] = typer.Option(None, "--kind", help="one of the plan's layer kinds, simulated as a plan of its "
                                                            "own (its tables, --json and --trace) [every kind and the "
                                                            "layer mix]"),
) -> None:
    """Simulate a plan on a hardware profile: makespans, attention MFU, exposed communication (a plan of layer
    kinds: each kind and the model's mix)."""
    from fcp_compiler.format.inputs import load_profile
    from fcp_compiler.format.kinds import PlanKinds
    from fcp_compiler.format.validate import validate_plan
    from fcp_compiler.format.models import load_model
    from fcp_compiler.tools.report import simulation_summary
    from fcp_compiler.core.simulate import simulate_plan, write_trace

    if model is not None:
        load_model(model)  # a bad name fails before any work
    prefetch = _on_off("--kv-prefetch", kv_prefetch)
    check_outputs([("--json", json_out), ("--trace", trace)],
                  [("SOURCE", source), ("--profile", _profile_file(profile))])
    data = _plan_or_batch(source, gpus, profile, model)
    if isinstance(data, PlanKinds):
        if kind is None:
            _simulate_kinds(data, profile, model, prefetch, json_out, trace)
            return
        if kind not in data.names:
            raise InvalidInputError(f"--kind {shown(kind)} is not a layer kind of {source} (its kinds: "
                                    f"{', '.join(data.names)})")
        data = data.kind(kind).reader
    elif kind is not None:
        raise InvalidInputError(f"--kind {shown(kind)} names a layer kind; {source} is a plan of one kind")
    if not isinstance(data, bytes):
        # The simulator trusts the invariants: an invalid plan exits 1 naming the broken one.
        validate_plan(data, background=True)
    simulation = simulate_plan(data, load_profile(profile) if profile else None, record=trace is not None,
                               model=model, kv_prefetch=prefetch)
    figures = simulation.figures()
    if json_out:
        _write_json(json_out, figures)
    if trace:
        write_trace(simulation, trace)
    typer.echo(simulation_summary(figures, trace))


def _simulate_kinds(kinds, profile: Optional[str], model: Optional[str], prefetch: Optional[bool],
                    json_out: Optional[Path], trace: Optional[Path]) -> None:
    """`fcp simulate` of a plan of layer kinds: every kind validated and simulated, and the layer mix."""
    from fcp_compiler.format.inputs import load_profile
    from fcp_compiler.format.validate_kinds import validate_kinds
    from fcp_compiler.tools.kinds import simulate_kinds, simulation_lines

    if trace is not None:
        raise InvalidInputError(f"--trace {str(trace)!r} records one schedule: give --kind NAME (the plan's kinds: "
                                f"{', '.join(kinds.names)})")
    validate_kinds(kinds, background=True)  # the simulator trusts the invariants: an invalid plan exits 1
    result = simulate_kinds(kinds, load_profile(profile) if profile else None, model, prefetch)
    if json_out:
        _write_json(json_out, result)
    typer.echo(simulation_lines(result))


@app.command("ablate")
def ablate_command(
    batch: Path = typer.Argument(..., help="batch JSON"),
    gpus: int = GPUS,
    profile: str = PROFILE,
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the steps as JSON [not written]"),
) -> None:
    """The seed's Table 2: each technique switched on in turn, normalized MFU beside the seed's."""
    from fcp_compiler.core.options import CompileOptions
    from fcp_compiler.format.inputs import load_batch
    from fcp_compiler.tools.ablation import run_ablation
    from fcp_compiler.tools.report import ablation_table

    check_outputs([("--json", json_out)], [("BATCH", batch), ("--profile", _profile_file(profile))])
    # The seed's Table 2 measures attention: each step is placed for attention alone, as the seed's system was.
    steps = run_ablation(_one_kind(load_batch(batch), "ablate"), CompileOptions.of(gpus, profile=profile,
                                                                                    model="none"))
    if json_out:
        _write_json(json_out, {"gpus": gpus, "batch": str(batch), "steps": steps})
    typer.echo(ablation_table(steps))


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InvalidInputError(f"{flag} {shown(text)} must be a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise InvalidInputError(f"{flag} {shown(text)} must list positive integers")
    return values


@app.command("compare")
def compare_command(
    batch: Optional[Path] = typer.Argument(None, help="batch JSON (or give --trace-spec)"),
    gpus: str = typer.Option("16,32,64,128,256", "--gpus", help="comma-separated scales"),
    trace_spec: Optional[str] = typer.Option(
        None, "--trace-spec", help="lognormal:MEDIAN:SIGMA:MAXLEN[:SEED] or file:PATH:TAIL_FRACTION[:SEED]: a batch "
                                   "per scale"),
    tokens_per_gpu: int = typer.Option(32768, "--tokens-per-gpu", help="with --trace-spec (weak scaling)",
                                       parser=_ascii_int),
    methods: str = typer.Option("fcp,ring,bytescale,wlbllm,magi", "--methods",
                                help="comma-separated planners (fcp-user: FCP in the user layout)"),
    profile: str = PROFILE,
    model: str = typer.Option("llama3-70b", "--model", help="the layer around attention: llama3-8b, llama3-70b or "
                                                            "none"),
    jobs: Optional[int] = typer.Option(None, "--jobs", help="processes [all cores]", parser=_ascii_int),
    fit_memory: bool = typer.Option(False, "--fit-memory", help="hold every planner to FCP's live-buffer budget (4 x "
                                    "coalesce x block size tokens) and its default device memory budget (smaller "
                                    "stages where needed), so that all compare at equal memory"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write every row as JSON [not written]"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="figure of imbalance and MFU vs GPUs (.png/.pdf/.svg; "
                                                             "needs matplotlib) [not drawn]"),
) -> None:
    """FCP beside the baselines at each scale, ranked by layer makespan: gap to the bound, balance, traffic, MFU."""
    from fcp_compiler.core.baselines import Planner
    from fcp_compiler.core.options import CompileOptions
    from fcp_compiler.format.inputs import load_batch
    from fcp_compiler.tools.compare import compare
    from fcp_compiler.tools.report import compare_rows
    from fcp_compiler.tools.traces import parse_trace_spec

    scales = _int_list(gpus, "--gpus")
    check_outputs([("--json", json_out), ("--plot", plot)], [("BATCH", batch), ("--profile", _profile_file(profile))])
    if plot:
        from fcp_compiler.tools.plots import check_plot_path, compare_figure

        check_plot_path(plot)
    try:
        chosen = [Planner(m.strip()) for m in methods.split(",")]
    except ValueError:
        raise InvalidInputError(f"--methods {shown(methods)}: each must be one of "
                                f"{', '.join(p.value for p in Planner)}") from None
    if (batch is None) == (trace_spec is None):
        raise InvalidInputError("give either BATCH or --trace-spec")
    if trace_spec:
        batch_for = parse_trace_spec(trace_spec, tokens_per_gpu)
    else:
        fixed = _one_kind(load_batch(batch), "compare")
        batch_for = lambda n: fixed  # noqa: E731
    if jobs is not None and jobs < 1:
        raise InvalidInputError(f"--jobs {jobs} must be >= 1")
    rows = compare(batch_for, scales, chosen, progress=lambda line: typer.echo(line, err=True), jobs=jobs,
                   options=CompileOptions.of(1, profile=profile, model=model, fit_memory=fit_memory))
    if json_out:
        _write_json(json_out, {"results": rows})
    if plot:
        compare_figure(rows, plot, trace_spec or str(batch))
    typer.echo(compare_rows(rows))


@app.command("sweep")
def sweep_command(
    batch: Path = typer.Argument(..., help="batch JSON"),
    gpus: int = GPUS,
    block_size: str = typer.Option("1024,2048,4096,8192", "--block-size", help="comma-separated block sizes"),
    profile: str = PROFILE,
    json_out: Optional[Path] = typer.Option(None, "--json", help="write every row as JSON [not written]"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="normalized MFU vs block size (.png/.pdf/.svg; needs "
                                                             "matplotlib) [not drawn]"),
) -> None:
    """FCP at several block sizes: balance and simulated normalized MFU."""
    from fcp_compiler.core.options import CompileOptions
    from fcp_compiler.format.inputs import load_batch
    from fcp_compiler.tools.compare import sweep_block_sizes
    from fcp_compiler.tools.report import sweep_table

    sizes = _int_list(block_size, "--block-size")
    check_outputs([("--json", json_out), ("--plot", plot)], [("BATCH", batch), ("--profile", _profile_file(profile))])
    if plot:
        from fcp_compiler.tools.plots import check_plot_path, sweep_figure

        check_plot_path(plot)
    rows = sweep_block_sizes(_one_kind(load_batch(batch), "sweep"), CompileOptions.of(gpus, profile=profile),
                             sizes)
    if json_out:
        _write_json(json_out, {"gpus": gpus, "results": rows})
    if plot:
        sweep_figure(rows, plot, f"FCP normalized MFU vs block size ({batch}, {gpus} GPUs)")
    typer.echo(sweep_table(rows))


@app.command("diff")
def diff_command(
    plan_a: Path = typer.Argument(..., help="the plan before"),
    plan_b: Path = typer.Argument(..., help="the plan after"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the diff as JSON [not written]"),
    fail_on: Optional[str] = typer.Option(None, "--fail-on", help="change or regression: exit 1 when it holds "
                                                                      "[never: exit 0]"),
    tolerance: float = typer.Option(0.005, "--tolerance", help="relative growth of a pass's simulated layer time "
                                    "allowed before it is a regression [0.005: 0.5%]", parser=_finite_float),
) -> None:
    """Semantic diff of two plans: parameters, inputs, moved blocks, rounds, balance, traffic, simulated time.

    A regression is a pass's simulated layer time grown by more than --tolerance, device memory that crossed the
    budget, or a plan B that no longer validates; every other figure is reported as a change."""
    from fcp_compiler.format.kinds import PlanKinds
    from fcp_compiler.format.validate import PlanInvalidError, validate_plan
    from fcp_compiler.tools.diff import diff_plans, invalid_after
    from fcp_compiler.tools.kinds import diff_kinds, diff_lines
    from fcp_compiler.tools.report import diff_summary

    if fail_on not in (None, "change", "regression"):
        raise InvalidInputError(f"--fail-on {shown(fail_on)} must be change or regression")
    if not math.isfinite(tolerance) or tolerance < 0:
        raise InvalidInputError(f"--tolerance {tolerance} must be a finite number >= 0")
    check_outputs([("--json", json_out)], [("A", plan_a), ("B", plan_b)])
    kinds = [PlanKinds(str(plan_a)), PlanKinds(str(plan_b))]
    if kinds[0].kinds_file or kinds[1].kinds_file:  # layer kinds matched by name, each diffed as two plans
        result = diff_kinds(*kinds, tolerance)
        if json_out:
            _write_json(json_out, result)
        typer.echo(diff_lines(result, plan_a, plan_b))
        if (fail_on == "change" and result["changed"]) or (fail_on == "regression" and result["regressed"]):
            raise typer.Exit(1)
        return
    readers = [plan_kinds.kinds[0].reader for plan_kinds in kinds]  # each a plan of one kind: its reader
    # The diff simulates both: each must keep the invariants the simulator trusts. A that does not validate is an
    # error; B that stopped validating is the diff's answer.
    validate_plan(readers[0], background=True)
    try:
        validate_plan(readers[1], background=True)
        result = diff_plans(*readers, tolerance)
    except PlanInvalidError as error:
        result = invalid_after(error)
    if json_out:
        _write_json(json_out, result)
    typer.echo(diff_summary(result, plan_a, plan_b))
    if (fail_on == "change" and result["changed"]) or (fail_on == "regression" and result["regressed"]):
        raise typer.Exit(1)


@app.command("schemas")
def schemas_command(
    folder: Path = typer.Option(Path("schemas"), "--out", help="folder of the JSON Schema files"),
    check: bool = typer.Option(False, "--check", help="exit 1 if the files differ from the models"),
) -> None:
    """Write (or check) the JSON Schema of the batch, hardware profile, attention shape and plan header."""
    from fcp_compiler.format.schemas import schema_documents
    from fcp_compiler.format.safe_io import write_atomic

    stale = []
    for name, text in schema_documents().items():
        path = folder / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not check:
            write_atomic(path, text.encode())
    if check and stale:
        typer.echo(f"fcp: stale schemas in {folder}: {', '.join(stale)} (run: fcp schemas)", err=True)
        raise typer.Exit(1)
    typer.echo(f"{folder}: wrote {', '.join(stale)}" if stale else f"{folder}: up to date")


def _trace_total(gpus: int, tokens_per_gpu: int, seed: int, mask: str, output: Path,
                 source: tuple[str, Path] | None = None) -> int:
    """The batch's tokens, once the options are checked: a batch `fcp compile` would take, a seed numpy takes, and
    an output that is not the input."""
    from fcp_compiler.format.inputs import MAX_BATCH_TOKENS, parse_mask
    from fcp_compiler.format.plan_format import MAX_RANKS
    if not 1 <= gpus <= MAX_RANKS or tokens_per_gpu < 1 or gpus * tokens_per_gpu > MAX_BATCH_TOKENS:
        raise InvalidInputError(f"--gpus {gpus} x --tokens-per-gpu {tokens_per_gpu} must be a batch fcp compile takes: "
                                f"1 to {MAX_RANKS} GPUs, at least 1 token each, at most {MAX_BATCH_TOKENS} tokens")
    if seed < 0:
        raise InvalidInputError(f"--seed {seed} must be >= 0")
    parse_mask(mask)
    check_outputs([("-o", output)], [source] if source else [])
    return gpus * tokens_per_gpu


def _write_batch(lengths: list[int], mask: str, output: Path, quiet: bool) -> None:
    from fcp_compiler.format.inputs import parse_mask
    from fcp_compiler.format.safe_io import write_atomic

    spec = parse_mask(mask)
    as_json = spec.kind.value if spec.window is None else {"kind": spec.kind.value, "window": spec.window}
    write_atomic(output, (json.dumps({"mask": as_json, "sequences": lengths}) + "\n").encode())
    if not quiet:
        typer.echo(f"wrote {output}: {len(lengths)} sequences, {sum(lengths)} tokens, longest {max(lengths)}")


TOKENS_PER_GPU = typer.Option(32768, "--tokens-per-gpu", help="the batch holds exactly gpus x this many tokens",
                              parser=_ascii_int)
SEED = typer.Option(0, "--seed", help="random seed (the same seed gives the same batch)", parser=_ascii_int)
OUTPUT = typer.Option(..., "-o", "--output", help="batch JSON to write")
MASK = typer.Option("causal", "--mask", help="causal, full or sliding_window:W")
QUIET = typer.Option(False, "--quiet", "-q", help="print nothing on success")


@trace_app.command("lognormal")
def trace_lognormal(gpus: int = GPUS, tokens_per_gpu: int = TOKENS_PER_GPU,
                    median: float = typer.Option(4096.0, "--median", help="median length", parser=_finite_float),
                    sigma: float = typer.Option(1.8, "--sigma", help="sigma of log length", parser=_finite_float),
                    min_len: int = typer.Option(64, "--min-len", help="shortest length", parser=_ascii_int),
                    max_len: int = typer.Option(524288, "--max-len", help="longest length", parser=_ascii_int),
                    seed: int = SEED, mask: str = MASK, output: Path = OUTPUT, quiet: bool = QUIET) -> None:
    """Lognormal lengths by median and sigma, clipped to [min-len, max-len]."""
    from fcp_compiler.tools.traces import lognormal_batch

    total = _trace_total(gpus, tokens_per_gpu, seed, mask, output)
    _write_batch(lognormal_batch(total, median, sigma, min_len, max_len, seed), mask, output, quiet)


@trace_app.command("histogram")
def trace_histogram(histogram: Path = typer.Argument(..., help="CSV of bins: '[low, high]',count or low,high,count"),
                    gpus: int = GPUS, tokens_per_gpu: int = TOKENS_PER_GPU, seed: int = SEED, mask: str = MASK,
                    output: Path = OUTPUT, quiet: bool = QUIET) -> None:
    """Lengths from a histogram: a bin by its count, then log-uniform inside it."""
    from fcp_compiler.tools.traces import histogram_batch, read_histogram_csv

    total = _trace_total(gpus, tokens_per_gpu, seed, mask, output, ("HISTOGRAM", histogram))
    edges, counts = read_histogram_csv(histogram)
    _write_batch(histogram_batch(edges, counts, total, seed), mask, output, quiet)


@trace_app.command("file")
def trace_file(lengths_file: Path = typer.Argument(..., help="JSON list, or one length a line"),
               gpus: int = GPUS, tokens_per_gpu: int = TOKENS_PER_GPU, seed: int = SEED,
               max_len: Optional[int] = typer.Option(None, "--max-len", help="clip lengths to this [no clip]",
                                                     parser=_ascii_int),
               mask: str = MASK, output: Path = OUTPUT, quiet: bool = QUIET) -> None:
    """Lengths drawn with replacement from a file of observed lengths."""
    from fcp_compiler.tools.traces import empirical_batch, read_lengths_file

    total = _trace_total(gpus, tokens_per_gpu, seed, mask, output, ("LENGTHS_FILE", lengths_file))
    _write_batch(empirical_batch(read_lengths_file(lengths_file), total, seed, max_len), mask, output, quiet)


def _offending_value(argv: list[str], error: Exception) -> str | None:
    """A bad option's value as the message shows it (cut to a sane length), found after its flag on the command
    line; None where there is none."""
    options = getattr(getattr(error, "param", None), "opts", None) or []
    for flag in options:
        for idx, token in enumerate(argv):
            if token == flag and idx + 1 < len(argv):
                return shown(argv[idx + 1])
            if token.startswith(flag + "="):
                return shown(token.split("=", 1)[1])
    return None


def _clip_arguments(message: str, argv: list[str]) -> str:
    """Click's own usage messages (an unknown option or command, an extra argument) quote the argument whole: each
    long one is cut as :func:`~fcp_compiler.errors.clipped` cuts."""
    parts = {part for token in argv for part in (token, token.split("=", 1)[-1]) if len(part) > SHOWN_CHARS}
    for part in sorted(parts, key=len, reverse=True):
        message = message.replace(part, clipped(part))
    return message


def main(argv: list[str] | None = None) -> int:
    """Entry point: one-line errors, exit 2 on bad input, 1 on an invalid plan."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        result = app(args=argv, standalone_mode=False, prog_name="fcp")
        if result == 130:  # Ctrl-C or SIGTERM: typer returns click's abort as this exit status
            typer.echo("fcp: interrupted", err=True)
        if isinstance(result, int):
            return result
    except typer.Exit as done:
        return done.exit_code
    except typer.Abort:
        typer.echo("fcp: aborted", err=True)
        return 130
    except typer.TyperException as error:  # a usage error: bad flag, value or missing argument
        message, got = _clip_arguments(error.format_message(), argv), _offending_value(argv, error)
        # A bare `fcp` or group: its help, and exit 2. Typer raises its vendored click's NoArgsIsHelpError (a private
        # module, typer._click), so the class is known by name.
        if type(error).__name__ == "NoArgsIsHelpError":
            typer.echo(message)
            return 2
        if not message:  # a bare `fcp` (or a group without its command): the help above says what to give
            return 2
        # One prefix for every error, usage or input: "fcp: error:" (the message names the option).
        typer.echo(f"fcp: error: {message}{'' if got is None or got in message else f' (got {got})'}", err=True)
        return 2
    except FcpError as error:
        from fcp_compiler.format.validate import PlanInvalidError

        if isinstance(error, PlanInvalidError):
            typer.echo(f"fcp: invalid plan: {error}", err=True)
            return 1
        typer.echo(f"fcp: error: {error}", err=True)
        return 2
    except OSError as error:  # a file no check above foresaw (outputs and inputs have their own messages): the
        # error does not say whether it was read or written, so the message does not claim either
        where = "" if error.filename is None else f" {shown(error.filename)}"
        typer.echo(f"fcp: error: cannot access{where}: {error.strerror or error}", err=True)
        return 2
    except MemoryError:
        typer.echo("fcp: error: out of memory (the inputs ask for more than this machine has)", err=True)
        return 2
    except KeyboardInterrupt:
        typer.echo("fcp: interrupted", err=True)
        return 130
    except Exception as error:  # noqa: BLE001 - a bug: still one line, and an exit code of its own
        typer.echo(f"fcp: internal error (a bug, please report it): {error.__class__.__name__}: {error}", err=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
