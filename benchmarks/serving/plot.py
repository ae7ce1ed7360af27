"""The sweep's PNG: output tok/s, TTFT p50 and ITL p99 against concurrency, one line per
server. Run as a script by the vLLM peer venv's Python, which has matplotlib, so that the
project's venv needs none: `python plot.py RESULTS.json OUT.png`. Importing this module
imports no matplotlib."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

PANELS = (
    ("output_throughput", "output tok/s (higher is better)"),
    ("median_ttft_ms", "TTFT p50, ms (lower is better)"),
    ("p99_itl_ms", "ITL p99, ms (lower is better)"),
)


def plot_command(python: Path, results_json: Path, png: Path) -> list[str]:
    return [str(python), str(Path(__file__).resolve()), str(results_json), str(png)]


def render(python: Path, results_json: Path, png: Path) -> None:
    """Draw `png` from `results_json` (serve_compare.py's --result-json) with `python`."""
    done = subprocess.run(
        plot_command(python, results_json, png), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"plotting with {python} failed: {done.stderr.strip()[-500:]}")


def _draw(data: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display here
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4.2))
    for server in data["servers"]:
        points = sorted(server["points"], key=lambda p: p["concurrency"])
        if not points:
            continue
        xs = [p["concurrency"] for p in points]
        # kvrelay solid, peers dashed: the comparison reads at a glance.
        style = "-" if server["family"] == "kvrelay" else "--"
        for ax, (key, _) in zip(axes, PANELS, strict=True):
            ax.plot(xs, [p[key] for p in points], style, marker="o", label=server["name"])
    for ax, (_, title) in zip(axes, PANELS, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["concurrencies"], [str(c) for c in data["concurrencies"]])
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(data.get("title", "serving comparison"), fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python plot.py RESULTS.json OUT.png")
    _draw(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
