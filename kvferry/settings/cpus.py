"""Core lists as taskset and /sys write them ("0-2,5"), and the core-lending spec a worker gets
(`--core-lending FILE:SLOT:PARTNER:CPUS`, kvferry/cores.py): parsed with the other settings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def cpu_list(cores: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5", as taskset and /sys write core lists."""
    out: list[str] = []
    run: list[int] = []
    for core in sorted(cores):
        if run and core != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(core)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


def parse_cpu_list(text: str) -> set[int]:
    """"0-2,5" -> {0, 1, 2, 5}; ValueError naming --cpus otherwise."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"cpus: expected core numbers like 0-2,5, got {text!r}") from None
    if not cores or min(cores) < 0:
        raise ValueError(f"cpus: expected core numbers like 0-2,5, got {text!r}")
    return cores


def parse_spec(spec: str) -> tuple[Path, int, int, set[int]]:
    """"FILE:SLOT:PARTNER:CPUS" -> (file, slot, partner slot, partner's cores); ValueError
    naming core_lending otherwise."""
    parts = spec.rsplit(":", 3)
    try:
        path, slot, partner = Path(parts[0]), int(parts[1]), int(parts[2])
        cores = parse_cpu_list(parts[3])
    except (IndexError, ValueError):
        raise ValueError(f"core_lending: expected FILE:SLOT:PARTNER:CPUS (e.g. "
                         f"/dev/shm/f:0:1:1), got {spec!r}") from None
    if slot < 0 or partner < 0 or slot == partner:
        raise ValueError(f"core_lending: slots must be distinct and >= 0, got {slot} and "
                         f"{partner}")
    return path, slot, partner, cores
