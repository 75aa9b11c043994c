"""slurmft.units: the one home of byte/size/duration words and the peak RSS (each output pinned as users see it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from slurmft import units as U


def test_parse_size_decimal_and_binary_units() -> None:
    assert U.parse_size("5GB") == 5 * 10**9
    assert U.parse_size("500MB") == 500 * 10**6
    assert U.parse_size("1.5TB") == 1_500_000_000_000
    assert U.parse_size("64 KB") == 64_000
    assert U.parse_size("1GiB") == U.GiB == 2**30
    assert U.parse_size("2GiB") == 2**31
    assert U.parse_size("  512 MiB \n") == 512 * U.MiB  # blanks around are ignored
    assert U.parse_size("7B") == 7


@pytest.mark.parametrize("text", ["64G", "500M", "1.5T", "5 parsecs", "GB", "-1GB", "", "5gb"])
def test_parse_size_rejects_what_is_not_a_size(text: str) -> None:
    # Slurm's memory suffixes (64G, 500M, 1.5T) are not sizes: --mem goes to Slurm as written.
    with pytest.raises(ValueError, match=r"is not a size like 5GB or 500MB"):
        U.parse_size(text)


def test_parse_size_rejects_zero() -> None:
    with pytest.raises(ValueError, match=r"size '0GB' must be positive"):
        U.parse_size("0GB")


def test_size_re_is_what_the_config_accepts() -> None:
    assert U.SIZE_RE.match("5GB") and U.SIZE_RE.match("1.5 TiB")
    assert not U.SIZE_RE.match(" 5GB") and not U.SIZE_RE.match("64G")


def test_decimal_gb_the_estimates_words() -> None:
    assert U.decimal_gb(0) == "0 MB"
    assert U.decimal_gb(512 * 10**6) == "512 MB"
    assert U.decimal_gb(999_999_999) == "1,000 MB"  # below 1 GB stays in MB
    assert U.decimal_gb(U.GB) == "1.0 GB"
    assert U.decimal_gb(U.GiB) == "1.1 GB"  # exactly 1 GiB, in decimal GB
    assert U.decimal_gb(88.67e9) == "88.7 GB"
    assert U.decimal_gb(10**12) == "1.00 TB"
    assert U.decimal_gb(2.1e15) == "2,100.00 TB"
    assert U.decimal_gb(-3 * U.GB) == "-3.0 GB"


def test_decimal_bytes_consolidations_words() -> None:
    assert U.decimal_bytes(0) == "0 B"
    assert U.decimal_bytes(999) == "999 B"
    assert U.decimal_bytes(1000) == "1.00 KB"
    assert U.decimal_bytes(U.GiB) == "1.07 GB"  # exactly 1 GiB
    assert U.decimal_bytes(5 * 10**9) == "5.00 GB"
    assert U.decimal_bytes(1.2e12) == "1.20 TB"
    assert U.decimal_bytes(3e15) == "3000.00 TB"


def test_binary_bytes_the_status_words() -> None:
    assert U.binary_bytes(None) == "-"
    assert U.binary_bytes(0) == "0 B"
    assert U.binary_bytes(1023) == "1023 B"
    assert U.binary_bytes(1024) == "1.0 KiB"
    assert U.binary_bytes(U.GiB) == "1.0 GiB"  # exactly 1 GiB
    assert U.binary_bytes(5_000_000) == "4.8 MiB"
    assert U.binary_bytes(2.5 * 2**40) == "2.5 TiB"
    assert U.binary_bytes(3 * 2**50) == "3072.0 TiB"  # nothing above TiB


def test_fmt_duration() -> None:
    assert U.fmt_duration(None) == "-"
    assert U.fmt_duration(0) == "0s"
    assert U.fmt_duration(12.4) == "12s"
    assert U.fmt_duration(59.6) == "1m00s"  # rounded
    assert U.fmt_duration(185) == "3m05s"
    assert U.fmt_duration(3600) == "1h00m"
    assert U.fmt_duration(3725) == "1h02m"
    assert U.fmt_duration(90000) == "25h00m"  # no days


def test_fmt_age() -> None:
    assert U.fmt_age(None) == "-"
    assert U.fmt_age(0) == "0s"
    assert U.fmt_age(-5) == "0s"  # a clock a little ahead is "just now"
    assert U.fmt_age(42.9) == "42s"  # floored
    assert U.fmt_age(59.9) == "59s"
    assert U.fmt_age(300) == "5m"
    assert U.fmt_age(3 * 3600 + 59 * 60) == "3h"
    assert U.fmt_age(2 * 86400 + 1) == "2d"


def test_peak_rss_bytes_grows_with_a_touched_buffer() -> None:
    before = U.peak_rss_bytes()
    assert before > 1 * U.MiB
    buf = bytearray(64 * U.MiB)  # zero-filled: resident
    after = U.peak_rss_bytes()
    del buf
    assert after >= before and after >= 64 * U.MiB


def test_units_is_ground_and_stdlib_only() -> None:
    """Both sides import it before torch: no slurmft module and nothing outside the standard library."""
    import sys

    tree = ast.parse(Path(U.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names - {"__future__"} <= set(sys.stdlib_module_names)
