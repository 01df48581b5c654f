"""Quantities with units: "12 km", "12000 m" and "12 kilometres" are the same length.

Only what the example needs: length, mass, volume and time, each unit a factor of its dimension's base
unit. No dependency, so the plugin installs anywhere grpo-pipeline runs.
"""
from __future__ import annotations

import re

# unit -> (dimension, size in the dimension's base unit)
UNITS: dict[str, tuple[str, float]] = {
    "mm": ("length", 0.001), "cm": ("length", 0.01), "m": ("length", 1.0), "km": ("length", 1000.0),
    "mg": ("mass", 0.001), "g": ("mass", 1.0), "kg": ("mass", 1000.0),
    "ml": ("volume", 0.001), "l": ("volume", 1.0),
    "s": ("time", 1.0), "min": ("time", 60.0), "h": ("time", 3600.0),
}
ALIASES = {
    "millimeter": "mm", "millimetre": "mm", "centimeter": "cm", "centimetre": "cm", "meter": "m", "metre": "m",
    "kilometer": "km", "kilometre": "km", "milligram": "mg", "gram": "g", "kilogram": "kg", "kilo": "kg",
    "milliliter": "ml", "millilitre": "ml", "liter": "l", "litre": "l", "second": "s", "sec": "s",
    "minute": "min", "mins": "min", "hour": "h", "hr": "h", "hrs": "h",
}
_QUANTITY = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([A-Za-z]+)?\s*\.?\s*$")


def canonical_unit(word: str) -> str | None:
    """"Kilometres" -> "km"; None for a word that is not a known unit."""
    w = word.lower()
    for candidate in (w, w[:-1] if w.endswith("s") else w):
        if candidate in UNITS:
            return candidate
        if candidate in ALIASES:
            return ALIASES[candidate]
    return None


def parse_quantity(text: str) -> tuple[float, str | None] | None:
    """"12 km" -> (12.0, "km"); "12" -> (12.0, None); None if it is not a number with an optional known unit."""
    found = _QUANTITY.match(text.replace(",", ""))
    if not found:
        return None
    value, word = float(found.group(1)), found.group(2)
    if word is None:
        return value, None
    unit = canonical_unit(word)
    return None if unit is None else (value, unit)


def same_quantity(a: tuple[float, str], b: tuple[float, str], rel_tol: float = 1e-6) -> bool:
    """Equal after conversion to the base unit; quantities of different dimensions never are."""
    (va, ua), (vb, ub) = a, b
    if UNITS[ua][0] != UNITS[ub][0]:
        return False
    x, y = va * UNITS[ua][1], vb * UNITS[ub][1]
    return abs(x - y) <= rel_tol * max(abs(x), abs(y), 1e-12)
