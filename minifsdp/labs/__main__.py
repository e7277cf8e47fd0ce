"""``python -m minifsdp.labs NN [FILE] [--start] [--reference] [--hint [K]]``: start lab NN,
check it, or ask for its next graded hint.

Exit status 0 when the check passes, 1 otherwise, so a lab check can run in a script or CI.
"""

from __future__ import annotations

import argparse
import sys

from minifsdp.labs import LAB_IDS, REFERENCE, check, hint, start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minifsdp.labs", description=__doc__)
    p.add_argument("lab", choices=LAB_IDS, help="the chapter's lab")
    p.add_argument("file", nargs="?", help="your file (default: labs/mine/labNN_*.py)")
    p.add_argument("--start", action="store_true", help="copy the skeleton to labs/mine/")
    p.add_argument("--reference", action="store_true", help="check the package's own code")
    p.add_argument("--world-sizes", default=None, help="e.g. 2,3 (default: the lab's)")
    p.add_argument("--hint", nargs="?", type=int, const=0, default=None, metavar="K",
                   help="show the next graded hint (or hint K again)")
    a = p.parse_args(argv)
    if a.hint is not None:
        hint(a.lab, a.hint or None)
        return 0
    if a.start:
        start(a.lab)
        return 0
    sizes = tuple(int(x) for x in a.world_sizes.split(",")) if a.world_sizes else None
    report = check(a.lab, REFERENCE if a.reference else a.file, world_sizes=sizes)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
