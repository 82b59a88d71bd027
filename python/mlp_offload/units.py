"""Human-friendly numbers for the command line: sizes, counts, rates.

    parse_size("200GiB") == 200 * 2**30     parse_size("1.5TB") == 1.5e12
    parse_count("70B") == 70e9              parse_count("70e9") == 70e9
    parse_rate("6.5") == 6.5e9 (GB/s)       parse_rate("800MB/s") == 8e8

Errors are ConfigError with a message that shows an accepted form.
"""

import decimal
import math
import re

from mlp_offload.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
    "t": 1e12, "tb": 1e12, "p": 1e15, "pb": 1e15,
    "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40, "pib": 2 ** 50,
}
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"


# Sizes and counts end up in int64 fields of the engine and the planner.
MAX_INT = 2 ** 63 - 1


def _split(text, what, example):
    m = re.fullmatch(_NUMBER + r"\s*([A-Za-z/]*)", str(text).strip())
    if not m:
        raise ConfigError(f"bad {what} {text!r} (e.g. {example})")
    value = float(m.group(1))
    if not math.isfinite(value):
        raise ConfigError(f"bad {what} {text!r}: too large")
    if what != "count" and re.fullmatch(r"[KMGTP]i?b(/s)?", m.group(2)):
        # Case is otherwise free ("gb" is GB), but "Gb" is how gigabits are
        # written (network links): 8 times less than GB, never guessed.
        unit = m.group(2).split("/")[0]
        raise ConfigError(f"bad {what} {text!r}: {unit!r} reads as bits; give bytes "
                          f"({unit[0]}B or {unit[0]}iB)")
    return m.group(1), value, m.group(2).lower()


def _to_int(value, text, what):
    if value > MAX_INT:
        raise ConfigError(f"bad {what} {text!r}: too large (at most {MAX_INT:.3g})")
    return int(round(value))


def has_unit(text):
    """Whether a number as parse_size, parse_rate or parse_count take it
    ends in a unit ("3.5TB", not "3.5" or "1e9"); False for any other text."""
    m = re.fullmatch(_NUMBER + r"\s*([A-Za-z/]*)", str(text).strip())
    return bool(m and m.group(2))


def parse_size(text):
    """Bytes from '200GiB', '1.5TB', '512MB', '4096', '1e9' (int)."""
    _, value, unit = _split(text, "size", "200GiB, 1.5TB, 512MB, 4096")
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"bad size {text!r}: unknown unit {unit!r} "
                          f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    return _to_int(value * _SIZE_UNITS[unit], text, "size")


def parse_count(text):
    """A count from '70e9', '70B', '1.5M', '100000' (int)."""
    number, value, unit = _split(text, "count", "70e9, 70B, 1.5M, 100000")
    if unit not in _COUNT_UNITS:
        raise ConfigError(f"bad count {text!r}: unknown suffix {unit!r} (K, M, B, T)")
    scale = int(_COUNT_UNITS[unit])
    # 1.5M is whole, 1.5 is not: a count is never rounded silently. Checked
    # on the decimal text, exactly (1.1B is whole; its float is not).
    exact = decimal.Decimal(number) * scale
    if exact != exact.to_integral_value():
        raise ConfigError(f"bad count {text!r}: not a whole number")
    return _to_int(value * scale, text, "count")


def parse_rate(text):
    """Bytes/s from '6.5' (GB/s), '6.5GB/s', '800MB/s', '2GiB/s'."""
    _, value, unit = _split(text, "bandwidth", "6.5 (GB/s), 800MB/s")
    if unit.endswith("/s"):
        unit = unit[:-2]
    if unit == "":
        return value * 1e9
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"bad bandwidth {text!r}: unknown unit {unit!r}")
    return value * _SIZE_UNITS[unit]


def format_bytes(n):
    """'1.2 GB' style (decimal units, as drives are sold)."""
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_count(n):
    """'70B', '1.5M', '950' style."""
    n = float(n)
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}" if n == math.floor(n) else f"{n:.3g}"
