"""Print pyproject's direct dependencies pinned at their floors (``name[extras]==floor``), one a line, for pip.

torch is left out: its build (CPU or CUDA) is the caller's choice, so the caller pins it.
"""

import re
import sys
from pathlib import Path

SKIP = {"torch"}


def floors(pyproject: str) -> list[str]:
    block = re.search(r"^dependencies = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    pins = []
    for spec in re.findall(r'"([^"]+)"', block):
        m = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,\s]*)", spec)
        if not m:
            sys.exit(f"dependency without a >= floor: {spec!r}")
        if m.group(1) not in SKIP:
            pins.append(f"{m.group(1)}{m.group(2) or ''}=={m.group(3)}")
    return pins


if __name__ == "__main__":
    print("\n".join(floors((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())))
