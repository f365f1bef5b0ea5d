"""Every README code block that can run on CPU runs, and says what it shows.

- The two set-up commands: the test command is the one `.ci/run` runs.
- The quick start's `$ fcp ...` commands run from a fresh folder, and their printed output is today's (all but the
  compile-time line, which is a measurement).
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
        if shown:  # a command shown without output is only run
            assert _measured_lines_out(done.stdout.splitlines()) == _measured_lines_out(shown), command
    assert (tmp_path / "plan.fcp").is_file() and (tmp_path / "timeline.json").is_file()


def test_the_library_block_runs_as_written():
    (block,) = _blocks("python", "from fcp_compiler import")
    namespace: dict = {}
    exec(compile(block, "README.md (library)", "exec"), namespace)
    assert namespace["program"].rank == 3 and namespace["plan"].stats["num_ranks"] == 8


def test_the_training_loop_runs_as_written_and_trains_like_one_process():
    torch = pytest.importorskip("torch")
    import dataclasses

    import numpy as np
    from runtime_harness import run_ranks
    from test_train_example import example

    (block,) = _blocks("python", "PlanningCollate(")
    config = dataclasses.replace(example.Config(), block_size=4096)

    def task(rank, world):
        # The block as written, from the repository root, in a fresh namespace: every name it uses it defines.
        os.chdir(ROOT)
        namespace = {"__name__": "readme_block"}
        exec(compile(block, "README.md (train with fcp)", "exec"), namespace)
        return {name: value.detach().numpy().copy() for name, value in namespace["model"].state_dict().items()}

    reference = example.train_reference(config)["state"]
    for state in run_ranks(2, task, timeout=300):
        for name, value in reference.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-5, err_msg=name)


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
