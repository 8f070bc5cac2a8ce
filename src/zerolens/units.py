"""Bytes everywhere inside zerolens; in what people read, 1024-based units (B, KiB, MiB, GiB, TiB,
PiB), and 10^n-based ones (MB, GB, TB, PB) only beside a source that quotes them (the ZeRO paper's GB)."""
KiB = 1024
MiB = 1024 ** 2
GiB = 1024 ** 3
TiB = 1024 ** 4
PiB = 1024 ** 5

BINARY_UNITS = (("B", 1), ("KiB", KiB), ("MiB", MiB), ("GiB", GiB), ("TiB", TiB), ("PiB", PiB))
DECIMAL_UNITS = (("B", 1), ("kB", 10**3), ("MB", 10**6), ("GB", 10**9), ("TB", 10**12), ("PB", 10**15))
COUNT_UNITS = (("", 1), ("K", 10**3), ("M", 10**6), ("B", 10**9), ("T", 10**12))


def unit_of(n: float, units=BINARY_UNITS) -> tuple[str, float]:
    """The largest unit of `units` that `n` reaches one of (the smallest for anything below it)."""
    label, unit = units[0]
    for label_, unit_ in units:
        if abs(n) >= unit_:
            label, unit = label_, unit_
    return label, unit


def three_digits(value: float) -> str:
    """Three significant digits: 1.23, 12.3, 123 (and 1023 where a unit runs up to 1024)."""
    if value == 0:
        return "0"
    return f"{value:.0f}" if abs(value) >= 99.95 else f"{value:.1f}" if abs(value) >= 9.995 else f"{value:.2f}"


def size(n: float, units=BINARY_UNITS) -> str:
    """A size in a sentence, its own unit and three significant digits: "512 B", "1.50 KiB", "118 MiB"."""
    label, unit = unit_of(n, units)
    return f"{three_digits(n / unit)} {label}"


def count(n: float) -> str:
    """A count of parameters, three significant digits: "12", "526K", "1.31B", "1.00T"."""
    label, unit = unit_of(n, COUNT_UNITS)
    if unit == 1:
        return f"{n:,.0f}"
    if n / unit >= 999.95 and unit < COUNT_UNITS[-1][1]:  # rounds to 1000: the next unit's 1.00
        label, unit = next(u for u in COUNT_UNITS if u[1] == unit * 1000)
    return f"{three_digits(n / unit)}{label}"
