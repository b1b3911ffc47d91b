"""The documentation: the site builds strictly, and README stays short with the Quickstart CI runs.

mkdocs-material comes with the test extra (pip install -e '.[test]'); without it the build test fails
saying so. A strict build fails on a broken link or anchor, and on a nav entry whose page is missing.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 260
# the Quickstart's first command: install, build the demo bundle and generate with it
DEMO_COMMAND = "pip install -q -e '.[build]' && speccompile generate --prompt \"def parse_args(argv):\""


def test_docs_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2: not a docs problem
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def quickstart_commands(readme: str) -> list[str]:
    """The fenced code blocks of README's Quickstart section, in order, each as its stripped text."""
    section = re.search(r"^## Quickstart\n(.*?)(?=^## |\Z)", readme, re.MULTILINE | re.DOTALL)
    assert section, "README has no '## Quickstart' section"
    body = section.group(1)
    assert body.lstrip().startswith("```"), "the Quickstart must start with its commands"
    return [block.strip() for block in re.findall(r"^```[a-z]*\n(.*?)^```", body, re.MULTILINE | re.DOTALL)]


def ci_test_command() -> str:
    """The command .ci/run ends with: what CI runs after setting up the machine."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")][-1]


def test_readme_is_short_and_its_quickstart_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    lines = readme.count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
    commands = quickstart_commands(readme)
    assert len(commands) >= 2, f"the Quickstart has {len(commands)} command blocks, not two"
    first, second = commands[:2]
    assert first == DEMO_COMMAND
    assert second == ci_test_command()
