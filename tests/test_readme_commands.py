"""The README's two opening commands, and CI running exactly the second one."""

import subprocess
from pathlib import Path

from tests.helpers.readme import fenced_block, top_commands

REPO = Path(__file__).resolve().parents[1]


def test_readme_opens_with_the_demo_and_the_test_command():
    demo, test = top_commands()
    assert demo == "pip install -e . && python -m lora_runtime.demo"
    # The test command sets up everything the tests need, system packages included.
    assert test.startswith("bash scripts/install_test_deps.sh && ")
    assert test.endswith('pip install -e ".[test]" && python -m pytest -q -n 2 --dist loadgroup')


def test_ci_runs_exactly_the_readme_test_command():
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[-1] == top_commands()[1]
    assert all(line.startswith(("set ", "cd ")) for line in lines[:-1]), lines


def _install_deps(path_dir: Path) -> subprocess.CompletedProcess:
    """The install script with PATH set to ``path_dir`` alone."""
    return subprocess.run(["/bin/bash", str(REPO / "scripts" / "install_test_deps.sh")],
                          env={"PATH": str(path_dir)}, capture_output=True, text=True, timeout=60)


def test_install_script_does_nothing_when_prometheus_is_there(tmp_path):
    fake = tmp_path / "prometheus"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    done = _install_deps(tmp_path)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done


def test_install_script_without_apt_says_what_to_install(tmp_path):
    done = _install_deps(tmp_path)  # neither prometheus nor apt-get on PATH
    assert done.returncode == 1
    assert "prometheus" in done.stderr and "apt-get is not available" in done.stderr, done.stderr


def test_fenced_block_reads_the_block_under_its_heading():
    text = "# t\n\n## A\n\nsome words\n\n```\none\ntwo\n```\n\n## B\n\n```\nthree\n```\n"
    assert fenced_block("## A", text) == "one\ntwo\n"
    assert fenced_block("## B", text) == "three\n"
    assert top_commands("# t\n\n    first\n    second\n\nprose\n    later\n") == ["first", "second"]
