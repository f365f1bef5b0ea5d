"""Every README code block that can run on CPU runs, and says what it shows.

- The two set-up commands: the test command is the one `.ci/run` runs.
- The quick start's `$ fcp ...` commands run from a fresh folder, and their printed output is today's (all but the
  compile-time line, which is a measurement), exactly: a command shown without output prints nothing, and "..."
  marks output left out.
- The library block runs as written.
- The training loop runs as written on forked gloo ranks, with the example's model and data, and trains to the same
  weights as the single-process reference.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.S | re.M)
FCP = Path(sys.executable).parent / "fcp"


def _blocks(language: str, containing: str) -> list[str]:
    found = [body for lang, body in BLOCKS if lang == language and containing in body]
    assert found, f"no {language or 'plain'} block of the README contains {containing!r}"
    return found


def test_the_readme_opens_with_the_two_setup_commands_and_ci_runs_the_second():
    assert BLOCKS[0][0] == "bash"
    commands = [line for line in BLOCKS[0][1].splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and "fcp compile traces/" in commands[0] and commands[1].endswith("python -m pytest")
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def _console(block: str) -> list[tuple[str, list[str]]]:
    """Each `$ command` of a console block with the output lines shown under it."""
    runs: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            runs.append((line[2:], []))
        else:
            runs[-1][1].append(line)
    return runs


def _measured_lines_out(lines: list[str]) -> list[str]:
    return [line for line in lines if not line.startswith("  compile ")]


def test_the_quick_start_commands_run_and_print_what_the_readme_shows(tmp_path):
    (tmp_path / "traces").symlink_to(ROOT / "traces")
    (block,) = _blocks("", "$ fcp compile")
    for command, shown in _console(block):
        argv = shlex.split(command)
        assert argv[0] == "fcp"
        done = subprocess.run([str(FCP), *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}: {done.stderr}"
        if shown != ["..."]:  # "..." elides the output; otherwise what is shown is all it prints (or nothing)
            assert _measured_lines_out(done.stdout.splitlines()) == _measured_lines_out(shown), command
    assert (tmp_path / "plan.fcp").is_file() and (tmp_path / "timeline.json").is_file()


def test_the_library_block_runs_as_written():
    (block,) = _blocks("python", "from fcp_compiler import")
    namespace: dict = {}
    exec(compile(block, "README.md (library)", "exec"), namespace)
    assert namespace["program"].rank == 3 and namespace["plan"].stats["num_ranks"] == 8


def _training_block() -> str:
    section = README[README.index("## Train with fcp"):]
    return re.search(r"^```python\n(.*?)^```", section, re.S | re.M).group(1)


def test_the_training_block_is_at_most_20_lines():
    assert len(_training_block().splitlines()) <= 20


# The precision the README states for its own recipe: HF's loss computes in float32 whatever the model's dtype.
_RECIPE_PRECISION = re.search(r"within (\S+)\s+relative\s+of\s+one\s+process,\s+in\s+float32\s+and\s+in\s+float64",
                              README)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_training_script_runs_as_written_from_any_directory_and_trains_like_one_process(tmp_path, dtype):
    """The block saved as train.py in an empty folder and run by two processes with the environment torchrun gives
    them: every rank gets tokens, and each step's loss shares sum to the loss of HF's own attention in one process
    on the same documents, within the precision the README states for the recipe as written, in float32 and with
    the model in float64 (`torch.set_default_dtype` before the model is built)."""
    pytest.importorskip("transformers")
    from hf_harness import readme_reference_losses
    from runtime_harness import free_port

    assert _RECIPE_PRECISION, "the README states no precision for its training recipe"
    bound = float(_RECIPE_PRECISION.group(1))
    script = tmp_path / "train.py"
    block = _training_block()
    if dtype == "float64":
        block = block.replace("torch.manual_seed(0)", "torch.set_default_dtype(torch.float64); torch.manual_seed(0)", 1)
    script.write_text(block)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env={**env, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    shares: dict[int, float] = {}
    for out, _ in outputs:
        for step, rank, tokens, share in re.findall(r"step (\d+) rank (\d+): (\d+) tokens, loss share (\S+)", out):
            assert int(tokens) > 0, f"rank {rank} got no tokens"
            shares[int(step)] = shares.get(int(step), 0.0) + float(share)
    assert sorted(shares) == [0, 1, 2]
    reference = readme_reference_losses(dtype)
    for step, loss in enumerate(reference):
        assert abs(shares[step] - loss) <= bound * loss, (step, shares[step], loss)


def _trainer_block() -> str:
    section = README[README.index("## Train with the Hugging Face Trainer"):]
    return re.search(r"^```python\n(.*?)^```", section, re.S | re.M).group(1)


def test_the_trainer_block_is_at_most_20_lines_and_runs_as_written_on_4_ranks(tmp_path):
    """The Trainer block saved as a script in an empty folder and run by four processes with torchrun's environment
    (DP 2 x CP 2 on gloo): it trains its steps and logs each step's loss (rank 0 prints the Trainer's log lines).
    Its parity with the Trainer in one process is tests/test_trainer.py's."""
    pytest.importorskip("accelerate")
    from runtime_harness import free_port

    block = _trainer_block()
    assert len(block.splitlines()) <= 20
    script = tmp_path / "train_trainer.py"
    script.write_text(block)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "4",
           "LOCAL_WORLD_SIZE": "4", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(4)]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0, 0], [err[-2000:] for _, err in outputs]
    losses = [float(loss) for loss in re.findall(r"'loss': '?([0-9.]+)", outputs[0][0])]
    steps = int(re.search(r"max_steps=(\d+)", block).group(1))
    assert len(losses) == steps and all(0 < loss < 10 for loss in losses), outputs[0][0][-2000:]


def test_the_repo_stands_alone_no_file_or_help_points_outside_it():
    """Users have the repository only: no doc, source file or help text names a path above it."""
    import os

    outside = re.compile("[.][.]/" + "shared")  # spelled so that this file does not match itself
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [name for name in subfolders if name not in (".git", ".venv", "__pycache__", ".pytest_cache")
                         and not name.endswith(".egg-info")]  # build output, not the repository
        for name in files:
            path = Path(folder, name)
            if path.suffix in (".py", ".md", ".toml", ".json", ".txt", ".cfg", ".sh", ""):
                assert not outside.search(path.read_text(errors="replace")), \
                    f"{path.relative_to(ROOT)} points outside the repository"
    assert (ROOT / "docs" / "DESIGN.md").is_file()


def test_the_results_page_holds_todays_figures_each_table_under_the_command_that_regenerates_it():
    """docs/RESULTS.md stays a page of today's figures (the history is in git): 400 lines at most. Above its marker
    every table is benchmarks/results.py's (the page says so first); below it every table has, in its section above
    it, the command that regenerates it (a benchmark script or an fcp command)."""
    text = (ROOT / "docs" / "RESULTS.md").read_text()
    assert len(text.splitlines()) <= 400
    generated, marker, kept = text.partition("<!-- Everything below is kept by benchmarks/results.py")
    assert marker and "Generated by `python benchmarks/results.py`" in generated.split("\n## ")[0]
    unnamed = []
    for section in re.split(r"^#+ ", kept, flags=re.MULTILINE):
        lines = section.splitlines()
        for index, line in enumerate(lines):
            if line.startswith("|---") and not re.search(r"`(python benchmarks/\w+\.py|fcp \w+)[^`]*`",
                                                         "\n".join(lines[:index])):
                unnamed.append(lines[0])
    assert not unnamed, unnamed
