"""`python -m kvrelay_operator`: the operator alone, as its pods run it.

`kvrelay operator` runs the same thing, but the `kvrelay` command imports the engine's
arguments (and with them torch, about 300 MB) before it reads its subcommand; the operator
needs only the CRD, planner and Kubernetes code, so its pods start here.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvrelay_operator.app import add_operator_arguments, run_operator


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvrelay_operator",
        description="kvrelay's Kubernetes operator: KVRelayService -> a KubeRay RayCluster "
        "per worker revision, the router, pool sizing and drained scale-down.",
    )
    parser.add_argument("--log-level", default="INFO", help="python log level (default INFO)")
    add_operator_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return run_operator(args)


if __name__ == "__main__":
    sys.exit(main())
