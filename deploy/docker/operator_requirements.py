"""Print the operator's requirements, as pyproject pins them, one a line (the Dockerfile's
`operator` stage installs these and nothing else: no torch, no CUDA, no Ray).

    python operator_requirements.py pyproject.toml > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

# What kvrelay_operator imports beyond the standard library (yaml comes with kubernetes);
# tests/operator/test_operator_image.py checks the operator imports nothing else.
OPERATOR_DISTRIBUTIONS = ("kopf", "kubernetes", "prometheus-client")


def requirement_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def operator_requirements(pyproject: Path) -> list[str]:
    """The pinned requirements of OPERATOR_DISTRIBUTIONS from `pyproject`'s dependencies.

    Raises:
        SystemExit: one of them is not a dependency any more.
    """
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    found = {requirement_name(d): d for d in deps}
    missing = [name for name in OPERATOR_DISTRIBUTIONS if name not in found]
    if missing:
        raise SystemExit(f"{pyproject} no longer depends on {', '.join(missing)}")
    return [found[name] for name in OPERATOR_DISTRIBUTIONS]


if __name__ == "__main__":
    print(
        "\n".join(
            operator_requirements(Path(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml"))
        )
    )
