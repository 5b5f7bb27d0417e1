"""Byte sizes: parse what users type (16GiB, 80GB) and print what nvidia-smi shows."""

from __future__ import annotations

import re

from shared.config import ConfigError

UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str, what: str) -> int:
    """Bytes from '16GiB', '80GB', '80 GB', '17179869184' or '1.6e10'. A bare number below
    1 MiB is refused: '--gpu-mem 16' means 16 GiB to a person and 16 bytes to the parser."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in UNITS and unit:
        raise ConfigError(
            f"cannot parse {what} '{text}': give bytes or a size such as 16GiB or 80GB."
        )
    size = int(float(match.group(1)) * UNITS[unit or "b"])
    if not unit and size < 1024**2:
        raise ConfigError(
            f"{what} '{text}' is {size} bytes: give a unit, such as {text}GiB or {text}GB."
        )
    return size


def format_size(n: float) -> str:
    """Binary units, three significant digits: what nvidia-smi and torch.cuda report."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
