"""The fcp command: outputs, exit codes and one-line errors, no partial files."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli as run
from fcp_compiler.format.plan_format import PlanReader, rebuild_plan

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "traces" / "small_8gpu.json"


def test_compile_writes_plan_and_stats_and_validate_passes(tmp_path, capsys):
    plan, stats = tmp_path / "p.fcp", tmp_path / "s.json"
    code, out, _ = run(capsys, "compile", SMALL, "--gpus", 8, "-o", plan, "--stats", stats)
    assert code == 0 and "compute imb" in out and plan.exists()
    figures = json.loads(stats.read_text())
    assert figures["plan_sha256"] and figures["num_rounds"] >= figures["nic_degree"]
    # The layer of the default model, simulated, beside its certified bound: printed and in the stats.
    assert "layer (llama3-70b)" in out and figures["model"] == "llama3-70b"
    for key in ("fwd", "bwd"):
        assert figures[f"layer_gap_{key}"] == pytest.approx(figures[f"layer_makespan_{key}_s"]
                                                            / figures[f"layer_makespan_lower_bound_{key}_s"])
        assert figures[f"layer_gap_{key}"] >= 1.0
    assert PlanReader(str(plan)).header.model == "llama3-70b"
    code, out, _ = run(capsys, "compile", SMALL, "--gpus", 8, "-o", plan, "--model", "gpt-9")
    assert code == 2 and "llama3-70b, llama3-8b or none" in _
    code, out, _ = run(capsys, "validate", plan)
    assert code == 0 and "valid" in out
    code, out, _ = run(capsys, "inspect", plan, "--rank", 2)
    assert code == 0 and "stage" in out
    code, out, _ = run(capsys, "inspect", plan, "--json")
    assert code == 0 and len(json.loads(out)["ranks"]) == 8
    # Device memory per rank and pass: the plan's memory account, in the table, the JSON and --rank's view.
    from fcp_compiler.format.memory import rank_peak_bytes

    account = rank_peak_bytes(PlanReader(str(plan)).rank(2))
    code, out, _ = run(capsys, "inspect", plan, "--json", "--memory")
    row = json.loads(out)["ranks"][2]
    assert code == 0 and (row["peak_fwd_gib"], row["peak_bwd_gib"]) == (
        round(account["fwd"] / 2 ** 30, 3), round(account["bwd"] / 2 ** 30, 3))
    code, out, _ = run(capsys, "inspect", plan, "--memory")
    assert code == 0 and "device memory, backward: at most" in out
    code, out, _ = run(capsys, "inspect", plan, "--rank", 2)
    assert f"backward {account['bwd'] / 2 ** 30:.2f} GiB" in out and "kernel calls" in out
    code, out, _ = run(capsys, "inspect", plan, "--rank", 2, "--json")
    assert code == 0 and json.loads(out)["peak_bytes"] == account


def test_validate_exits_one_naming_the_invariant(tmp_path, capsys):
    plan = tmp_path / "p.fcp"
    assert run(capsys, "compile", SMALL, "--gpus", 8, "-o", plan, "-q")[0] == 0
    reader = PlanReader(str(plan))
    broken = tmp_path / "broken.fcp"
    broken.write_bytes(rebuild_plan(reader, token_cap=100))
    code, _, err = run(capsys, "validate", broken)
    assert code == 1 and "invariant 4 (memory)" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("content,args,message", [
    ("[1, 2, -3]", [], "length -3"),
    ("[1, 0]", [], "length 0"),
    ("[1.5, 2]", [], "length 1.5"),
    ("[]", [], "empty"),
    ('{"mask": "diag", "sequences": [5]}', [], "'diag'"),
    ("{nope", [], "not valid JSON"),
    ("[4096, 4096]", ["--gpus", "0"], "--gpus 0"),
    ("[4096, 4096]", ["--block-size", "100"], "--block-size 100"),
    ("[4096, 4096]", ["--block-size", "0"], "--block-size 0"),
    ("[4096, 4096]", ["--token-cap", "10"], "token cap 10"),
    ("[4096, 4096]", ["--token-tolerance", "1.5"], "--token-tolerance 1.5"),
    ("[4096, 4096]", ["--token-tolerance", "nan"], "'--token-tolerance': 'nan' is not a finite decimal number"),
    ("[4096, 4096]", ["--profile", "tpu"], "'tpu'"),
    ("[4096, 4096]", ["--gpus", "two"], "'two'"),
    ("[4096, 4096]", ["--memory-budget", "lots"], "--memory-budget 'lots'"),
    ("[4096, 4096]", ["--memory-budget", "-1"], "--memory-budget -1.0"),
    ("[65536, 65536]", ["--memory-budget", "0.5"], "--memory-budget 0.50 GiB cannot be met"),
])
def test_bad_input_is_one_line_exit_two_and_no_plan(tmp_path, capsys, content, args, message):
    batch = tmp_path / "b.json"
    batch.write_text(content)
    plan = tmp_path / "p.fcp"
    argv = ["compile", batch, "-o", plan] + (args if "--gpus" in args else ["--gpus", "2"] + args)
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not plan.exists() and not list(tmp_path.glob(".p.fcp*"))


def test_missing_batch_file(tmp_path, capsys):
    code, _, err = run(capsys, "compile", tmp_path / "none.json", "--gpus", 2)
    assert code == 2 and "does not exist" in err


def test_trace_generators_fill_exactly(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert run(capsys, "trace", "lognormal", "--gpus", 4, "--tokens-per-gpu", 1000, "--seed", 1, "-o", out)[0] == 0
    assert sum(json.loads(out.read_text())["sequences"]) == 4000
    hist = tmp_path / "h.csv"
    hist.write_text('range,number\n"[1, 100]",5\n"[101, 1000]",3\n')
    assert run(capsys, "trace", "histogram", hist, "--gpus", 2, "--tokens-per-gpu", 5000, "-o", out)[0] == 0
    assert sum(json.loads(out.read_text())["sequences"]) == 10000
    lengths = tmp_path / "l.txt"
    lengths.write_text("100\n200\n300\n")
    assert run(capsys, "trace", "file", lengths, "--gpus", 3, "--tokens-per-gpu", 700, "-o", out)[0] == 0
    assert sum(json.loads(out.read_text())["sequences"]) == 2100


def test_console_script_runs_in_a_subprocess(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "cli.py"), "compile", str(SMALL), "--gpus", "0"],
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("fcp: error: --gpus 0")


def _options(command, path=()):
    """Every option of every command: (command path, click option)."""
    subcommands = getattr(command, "commands", None)
    if subcommands:
        for name, sub in subcommands.items():
            yield from _options(sub, (*path, name))
        return
    for param in command.params:
        if param.param_type_name == "option":
            yield " ".join(path), command, param


def test_every_option_says_what_it_does_and_its_default_and_flags_take_no_value(capsys):
    import click
    import typer

    from cli import app

    for path, command, option in _options(typer.main.get_command(app)):
        if option.opts == ["--help"]:
            continue
        text = option.get_help_record(click.Context(command, info_name=path))[1]
        assert option.help, f"fcp {path} {option.opts[0]} has no description"
        if not option.is_flag and not option.required:
            assert "[" in text, f"fcp {path} {option.opts[0]} shows no default: {text!r}"
    from cli import main

    for args in (["compile", "--help"], ["trace", "lognormal", "--help"], ["simulate", "--help"]):
        assert main(args) == 0
        out = capsys.readouterr().out
        assert "<bool>" not in out and "--help" in out


def test_usage_and_input_errors_share_one_prefix(capsys, tmp_path):
    from cli import main

    batch = tmp_path / "b.json"
    batch.write_text('{"mask": "diagonal", "sequences": [100]}')
    assert main(["compile", str(batch), "--gpus", "x"]) == 2
    assert capsys.readouterr().err.startswith("fcp: error: ")
    assert main(["compile", str(batch), "--gpus", "2", "-o", str(tmp_path / "p.fcp")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fcp: error: ") and "must be one of causal, full, sliding_window" in err


def test_the_summary_inspect_and_the_header_agree_on_stages_and_rounds(capsys, tmp_path):
    from cli import main

    plan_path, stats_path = tmp_path / "p.fcp", tmp_path / "s.json"
    assert main(["compile", str(SMALL), "--gpus", "8", "-o", str(plan_path), "--stats",
                 str(stats_path)]) == 0
    summary = capsys.readouterr().out
    header, stats = PlanReader(plan_path).header, json.loads(stats_path.read_text())
    assert main(["inspect", str(plan_path)]) == 0
    inspected = capsys.readouterr().out.splitlines()[0]
    stages = f"{header.num_fwd_stages}/{header.num_bwd_stages}"
    for name in ("num_rounds", "num_fwd_rounds", "num_bwd_rounds", "num_fwd_stages", "num_bwd_stages", "coalesce",
                 "bwd_coalesce"):
        assert stats[name] == getattr(header, name), name
    assert f"stages fwd/bwd {stages}" in inspected and f"{header.num_rounds} pull rounds" in inspected
    table_header, table_row = summary.splitlines()[1:3]
    columns = dict(zip(re.split(r"\s{2,}", table_header.strip()), table_row.split()))
    assert columns["stages fwd/bwd"] == stages and columns["pull rounds"] == str(header.num_rounds)
    assert f"fwd {header.num_fwd_rounds} (at least" in summary and f"bwd {header.num_bwd_rounds} (at least" in summary


def test_every_compile_option_is_documented_in_usage():
    """The README says every option is in docs/USAGE.md: each of fcp compile's is in its options table."""
    import typer

    from cli import app

    usage = (Path(__file__).resolve().parents[1] / "docs" / "USAGE.md").read_text()
    table = usage[usage.index("## `fcp compile` options"):usage.index("## Compile statistics")]
    command = typer.main.get_command(app).commands["compile"]
    flags = {opt for param in command.params for opt in param.opts if opt.startswith("--") and opt != "--help"}
    missing = sorted(flag for flag in flags if f"`{flag}" not in table and f"/`{flag}" not in table)
    assert not missing, missing


LONG = "y" * 10_000  # a user string a message must not echo whole


@pytest.fixture(scope="module")
def plain_and_kinds(tmp_path_factory):
    from fcp_compiler import compile_plan
    from fcp_compiler.format.inputs import BatchSpec

    folder = tmp_path_factory.mktemp("plans")
    plain, kinds = folder / "plain.fcp", folder / "kinds.fcp"
    lengths = [1900, 700, 333, 1200, 64, 90, 517, 250]
    compile_plan(lengths, 8, block_size=128).write(plain)
    compile_plan(BatchSpec(sequences=lengths, layers={"global": "causal",
                                                      "local": {"kind": "sliding_window", "window": 96}},
                           layer_mix={"global": 1, "local": 3}), 8, block_size=128).write(kinds)
    return plain, kinds


@pytest.mark.parametrize("args", [
    ["inspect", "KINDS", "--kind", LONG], ["simulate", "KINDS", "--kind", LONG],
    ["simulate", "PLAIN", "--kind", LONG], ["simulate", "PLAIN", "--model", LONG],
    ["compile", SMALL, "--gpus", LONG, "-o", "OUT"], ["compile", SMALL, f"--gpus={LONG}", "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--memory-budget", LONG, "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--node-fan-out", LONG, "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--model", LONG, "-o", "OUT"],
    ["diff", "PLAIN", "PLAIN", "--fail-on", LONG], ["diff", "PLAIN", "PLAIN", "--tolerance", LONG],
    ["compare", SMALL, "--gpus", 8, "--methods", LONG], ["sweep", SMALL, "--gpus", 8, "--block-size", LONG],
    ["validate", "PLAIN", LONG], ["validate", f"--{LONG}"], [LONG],
    ["compile", SMALL, "--gpus", 8, "--mask", LONG, "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--layer-masks", LONG, "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--layer-masks", f"a={LONG}", "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--layer-masks", f"{LONG}=causal", "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--layer-mix", LONG, "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--layer-masks", "a=causal,b=full", "--layer-mix", f"a={LONG}", "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--layer-masks", "a=causal,b=full", "--layer-mix", f"a=1,b=2,{LONG}=3", "-o",
     "OUT"],
    ["compile", SMALL, "--gpus", 8, "--profile", LONG, "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--planner", LONG, "-o", "OUT"],
    ["compile", SMALL, "--gpus", 8, "--layout", LONG, "-o", "OUT"],
    ["simulate", "PLAIN", "--profile", LONG],
], ids=lambda args: "-".join(arg.name if isinstance(arg, Path) else str(arg)[:12] for arg in args))
def test_an_echoed_user_value_is_cut_to_a_sane_length(tmp_path, capsys, plain_and_kinds, args):
    """A 10,000-character --kind (or any option's value, or a stray argument) is echoed by its first 60 characters,
    an ellipsis and its length, in one line (issue 65, N7)."""
    plain, kinds = plain_and_kinds
    given = [{"PLAIN": plain, "KINDS": kinds, "OUT": tmp_path / "p.fcp"}.get(arg, arg) for arg in args]
    code, out, err = run(capsys, *given)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search(r"y{50,60}'?\.\.\. \(10,00[02] characters\)", err), err
    assert "y" * 61 not in err and len(err) < 400, err
    assert not (tmp_path / "p.fcp").exists()


MASKS_VALID = "valid: causal, full or sliding_window:W (W >= 1)"


@pytest.mark.parametrize("args,shown,valid", [
    (["--layer-masks", "a=bogus"], "--layer-masks a='bogus': mask kind 'bogus' must be one of", MASKS_VALID),
    (["--layer-masks", "a=causal,b=sliding_window:x"], "--layer-masks b='sliding_window:x': the window must be",
     "a positive integer, e.g. sliding_window:4096"),
    (["--mask", "bogus"], "--mask 'bogus': mask kind 'bogus' must be one of", MASKS_VALID),
    (["--layer-masks", "a=causal,b=full", "--layer-mix", "a=1,b=x"], "--layer-mix b='x': a layer count must be",
     "an integer from 0 to 100000, e.g. full_attention=18"),
])
def test_a_bad_mask_of_a_layer_kind_reads_name_equals_value(tmp_path, capsys, args, shown, valid):
    """--layer-masks a=bogus is quoted as the user wrote it, a='bogus', not 'a= 'bogus'' (issue 65, N7); --mask
    and --layer-mix read alike; each says what is valid."""
    code, _, err = run(capsys, "compile", SMALL, "--gpus", 8, "-o", tmp_path / "p.fcp", *args)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert shown in err and "= '" not in err, err
    assert valid in err, err


@pytest.mark.parametrize("name", ["p" * 300, "p" * 300 + ".json", f"{'d' * 300}/profile.json"])
@pytest.mark.parametrize("command", ["compile", "simulate"])
def test_a_profile_name_too_long_for_a_path_is_bad_input_not_a_write(tmp_path, capsys, plain_and_kinds, command,
                                                                     name):
    """A 300-character --profile is no preset and no file it can read: one line naming the cut value and what is
    valid (a preset or a readable JSON file), not "cannot write" with the name whole (issue 65, N7)."""
    plain, _ = plain_and_kinds
    args = [SMALL, "--gpus", 8, "-o", tmp_path / "p.fcp"] if command == "compile" else [plain]
    code, _, err = run(capsys, command, *args, "--profile", name)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "write" not in err and name not in err and len(err) < 400, err
    assert re.search(rf"'{name[:60]}'\.\.\. \({len(name)} characters\)", err), err
    assert "File name too long" in err and "presets are a100, b200, h100, h200" in err, err
    assert "or give a readable profile JSON file" in err, err
    assert not (tmp_path / "p.fcp").exists()


def test_a_file_that_fails_to_read_is_not_reported_as_a_write(tmp_path, capsys, monkeypatch):
    """An OSError no check foresaw, here reading the batch, reaches main(): it names the file and the reason in
    one line, and does not claim a write (it said "cannot write" for every OSError, reads too)."""
    import errno

    import fcp_compiler.format.inputs as inputs

    def failing(path, what):
        raise OSError(errno.EIO, "Input/output error", str(path))
    monkeypatch.setattr(inputs, "read_input_text", failing)
    code, _, err = run(capsys, "compile", SMALL, "--gpus", 8, "-o", tmp_path / "p.fcp")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "write" not in err and f"{str(SMALL)!r}: Input/output error" in err, err
    assert not (tmp_path / "p.fcp").exists()


def test_a_layer_mix_naming_more_kinds_than_a_plan_holds_is_refused_by_count(tmp_path, capsys):
    """A --layer-mix of 3,000 entries is refused by its count (at most 8 kinds), not echoed whole."""
    mix = ",".join(f"k{idx}=1" for idx in range(3000))
    code, _, err = run(capsys, "compile", SMALL, "--gpus", 8, "-o", tmp_path / "p.fcp", "--layer-masks",
                       "a=causal,b=full", "--layer-mix", mix)
    assert code == 2 and err.count("\n") == 1 and len(err) < 200, err
    assert "--layer-mix names 3,000 layer kinds; give 1 to 8" in err, err
