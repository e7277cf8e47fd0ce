"""Count a ``pytest -v`` log's outcomes and name the failures, also of a run cut short.

    python benchmarks/summarize_pytest.py runs/gpu_check/pytest.log

Reads the per-test lines that ``-v`` prints as each test ends (with xdist: ``[gw3] [ 12%]
PASSED tests/test_x.py::test_y``; without: ``tests/test_x.py::test_y PASSED [ 12%]``), so a
run stopped at its deadline still says what it finished. Prints Markdown.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
XDIST = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (" + "|".join(OUTCOMES) + r") (\S+)")
PLAIN = re.compile(r"^(\S+::\S.*?) (" + "|".join(OUTCOMES) + r")\b")
FINAL = re.compile(r"^=+ (.*\d+ (passed|failed|error|skipped).*) =+$")


def parse(text: str) -> tuple[dict[str, str], str | None]:
    """``({test id: outcome}, pytest's own final line or None)``; a test's last outcome wins
    (an ERROR in teardown after a PASSED counts as ERROR)."""
    results, final = {}, None
    for line in text.splitlines():
        m = XDIST.match(line)
        if m:
            outcome, test = m.groups()
        else:
            m = PLAIN.match(line)
            if not m:
                f = FINAL.match(line.strip())
                final = f.group(1) if f else final
                continue
            test, outcome = m.groups()
        if results.get(test) not in ("FAILED", "ERROR"):
            results[test] = outcome
    return results, final


def markdown(results: dict[str, str], final: str | None) -> str:
    counts = Counter(results.values())
    lines = [", ".join(f"{counts[o]} {o.lower()}" for o in OUTCOMES if counts[o])
             or "no test finished", ""]
    lines.append(f"pytest's own summary: {final}" if final else
                 "pytest printed no summary line (stopped at the deadline?)")
    bad = sorted(t for t, o in results.items() if o in ("FAILED", "ERROR"))
    if bad:
        lines += ["", "Failed or errored:", ""] + [f"- `{t}` ({results[t]})" for t in bad]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    text = Path(argv[0]).read_text(errors="replace") if Path(argv[0]).exists() else ""
    print(markdown(*parse(text)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
