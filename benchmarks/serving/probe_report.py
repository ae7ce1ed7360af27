"""Summary of the workers' memory probes (services/kvrelay/worker/memory_probe.py): per worker,
what changed between its first line after the warm-up and its last, to tell a leak (memory in
use, objects, tensors, a per-request structure that does not come back) from memory glibc
keeps free. Reads the probe's JSON lines; starts and changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MIB = 2**20
# (label, how to read it from a probe line, divisor to MiB or 1 for counts)
_SCALARS = (
    ("RSS MiB", ("smaps_kb", "Rss"), 1024),
    ("anon MiB", ("smaps_kb", "Anonymous"), 1024),
    ("heap in use MiB (uordblks+hblkhd)", None, MIB),
    ("heap free kept MiB (fordblks)", ("mallinfo2", "fordblks"), MIB),
    ("heap mmap MiB (hblkhd)", ("mallinfo2", "hblkhd"), MIB),
    ("threads", ("threads",), 1),
    ("gc objects", ("census", "objects"), 1),
    ("tensors", ("census", "tensors"), 1),
    ("tensor MiB", ("census", "tensor_bytes"), MIB),
)


def read_probe(path: Path) -> list[dict[str, Any]]:
    """The probe's lines that parse (a line cut short by the process's end is left out)."""
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return lines


def _value(line: dict[str, Any], keys: tuple[str, ...] | None, divisor: int) -> float | None:
    if keys is None:  # memory glibc has handed out: small chunks in use plus mmap'd ones
        info = line.get("mallinfo2") or {}
        if "uordblks" not in info:
            return None
        return (info["uordblks"] + info["hblkhd"]) / divisor
    obj: Any = line
    for key in keys:
        if not isinstance(obj, dict) or key not in obj:
            return None
        obj = obj[key]
    return float(obj) / divisor


def summarize(lines: list[dict[str, Any]], label: str, warm_up_s: float) -> list[str]:
    """`label`'s probe: each quantity at the first line from `warm_up_s` after its first
    line, at its last, and the change; then the sizes that changed, the object types that
    grew most, and tracemalloc's top growth (when traced)."""
    if not lines:
        return [f"{label}: no probe lines"]
    t0 = lines[0]["t"]
    warm = next((line for line in lines if line["t"] - t0 >= warm_up_s), lines[-1])
    last = lines[-1]
    span_min = (last["t"] - warm["t"]) / 60
    out = [f"{label}: {len(lines)} probe lines; warm at {(warm['t'] - t0) / 60:.1f} min, "
           f"last {span_min:.1f} min later"]  # fmt: skip
    for name, keys, divisor in _SCALARS:
        a, b = _value(warm, keys, divisor), _value(last, keys, divisor)
        if a is not None and b is not None:
            out.append(f"  {name:<36}{a:>12.1f}{b:>12.1f}{b - a:>+12.1f}")
    sizes_a, sizes_b = warm.get("sizes") or {}, last.get("sizes") or {}
    for name in sorted(set(sizes_a) | set(sizes_b)):
        a, b = sizes_a.get(name), sizes_b.get(name)
        if a != b or name.startswith("heap trim"):
            out.append(f"  size {name:<31}{a!s:>12}{b!s:>12}")
    types_a = (warm.get("census") or {}).get("types") or {}
    types_b = (last.get("census") or {}).get("types") or {}
    grew = sorted(((types_b[k] - types_a.get(k, 0), k) for k in types_b), reverse=True)[:5]
    out.append("  most grown types: " + ", ".join(f"{k} {d:+d}" for d, k in grew))
    for stat in (last.get("tracemalloc") or [])[:5]:
        where = " <- ".join(reversed(stat["where"][-2:]))
        out.append(
            f"  traced {stat['size_diff'] / 1024:+9.1f} KiB {stat['count_diff']:+6d}  {where}"
        )
    return out


def probe_report(directory: Path, roles: dict[int, str], warm_up_s: float) -> str:
    """Every worker's summary (`summarize`), named by its role where `roles` (pid -> role)
    knows it."""
    sections = ["{:-^80}".format(" workers' memory probes (warm -> last, change) ")]
    for path in sorted(directory.glob("memory-*.jsonl")):
        pid = int(path.stem.split("-", 1)[1])
        sections += summarize(read_probe(path), roles.get(pid, f"pid {pid}"), warm_up_s)
    if len(sections) == 1:
        sections.append(f"no probe files in {directory}")
    return "\n".join(sections)
