"""The repository keeps its promises to a reader: README commands == CI, pins agree."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands():
    block = re.search(r"<!-- commands -->\s*```bash\n(.*?)```", (ROOT / "README.md").read_text(),
                      re.S)
    assert block, "README.md must hold the setup and test commands in the marked block"
    return [ln for ln in block.group(1).splitlines() if ln and not ln.startswith("#")]


def test_ci_runs_exactly_the_readme_commands():
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln and not ln.startswith(("#", "set ", "cd "))]
    assert ci == _readme_commands()
    assert len(ci) == 2


def test_environment_yml_pins_match_pyproject():
    pyproject = (ROOT / "pyproject.toml").read_text()
    pins = dict(re.findall(r'"(torch|torchvision)==([\d.]+)"', pyproject))
    env = dict(re.findall(r"(torch|torchvision)==([\d.]+)", (ROOT / "environment.yml").read_text()))
    assert pins == env and set(pins) == {"torch", "torchvision"}
