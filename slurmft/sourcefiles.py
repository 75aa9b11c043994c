"""The local files a data source names, and whether a plain-text file is text: torch-free, login side and job alike.

A source's ``path`` is one file or a glob (``/data/corpus/*.txt.gz``: a corpus is many files), matched in sorted
order so that every reader (``slurmft validate``, the record of the prepared data, the prepare job) sees the same
files in the same order. Plain text (``.txt``, ``.txt.gz``, or ``format: text`` on a column of another file kind)
is read by the ``datasets`` library's ``text`` builder, which takes any bytes: an empty file becomes no document,
and a binary file becomes documents of mojibake that train without an error. So the files are looked at first
(:func:`text_file_problem`): empty, NUL bytes, not UTF-8, or a ``.gz`` that is not gzip, each refused with the
source and the file named, by ``validate`` before anything is queued and again by the job.
"""

from __future__ import annotations

import codecs
import csv
import glob
import gzip
import io
import json
import os
import zlib
from pathlib import Path
from typing import IO, Any

GLOB_CHARS = "*?["
TEXT_SUFFIXES = (".txt", ".txt.gz")
#: data file kinds named by two suffixes (a compressed file of one kind)
COMPOUND_SUFFIXES = (".txt.gz", ".jsonl.zst")
#: bytes read from the start of each text file to tell text from binary
SNIFF_BYTES = 64 * 1024


def suffix_of(path: str | Path) -> str:
    """A data file's kind by its name: ``.txt.gz`` for a gzipped text file, ``.jsonl.zst`` for zstandard-compressed
    JSON lines, else the last suffix, lower-cased."""
    name = str(path).lower()
    return next((s for s in COMPOUND_SUFFIXES if name.endswith(s)), Path(name).suffix)


def is_glob(path: str) -> bool:
    """A source path holding a pattern (``*``, ``?``, ``[``) rather than one file's name."""
    return any(c in path for c in GLOB_CHARS)


def files_of(path: str) -> list[Path]:
    """The files ``path`` names: the one file, or every file its glob matches, sorted (empty: none)."""
    expanded = os.path.expanduser(path)
    if not is_glob(path):
        return [Path(expanded)] if Path(expanded).is_file() else []
    return [Path(p) for p in sorted(glob.glob(expanded, recursive=True)) if Path(p).is_file()]


def is_text(path: str, fmt: str) -> bool:
    """A plain-text source: ``format: text``, or ``.txt``/``.txt.gz`` files (which are always plain text); a glob
    whose pattern does not end in a suffix (``corpus/*.gz``, ``corpus/*``) by the files it matches."""
    if fmt == "text" or suffix_of(path) in TEXT_SUFFIXES:
        return True
    if not is_glob(path) or suffix_of(path) in (".json", ".jsonl", ".jsonl.zst", ".csv", ".parquet"):
        return False
    files = files_of(path)
    return bool(files) and all(suffix_of(f) in TEXT_SUFFIXES for f in files)


def text_file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a plain-text corpus file (None: it can): empty, binary, not UTF-8."""
    try:
        if suffix_of(path) == ".txt.gz":
            with gzip.open(path, "rb") as fh:
                head = fh.read(SNIFF_BYTES)
        else:
            with open(path, "rb") as fh:
                head = fh.read(SNIFF_BYTES)
    except (OSError, EOFError, zlib.error) as exc:
        return f"cannot be read ({type(exc).__name__}: {exc})"
    if not head:
        return "is empty"
    if len(head) < SNIFF_BYTES and not head.strip():
        return "holds only whitespace"
    nul = head.find(b"\x00")
    if nul >= 0:
        return f"is binary, not text (a NUL byte at offset {nul})"
    try:  # incremental: a character cut at the end of the sample is not an error
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text (byte {exc.start}: {head[exc.start:exc.start + 1]!r})"
    return None


def read_documents(files: list[Path], documents: str, limit_bytes: int) -> tuple[list[str], bool]:
    """The documents of plain-text files as the job's ``datasets`` text builder splits them (``documents``: ``file``,
    one per file; ``blank_line``, one per block between blank lines), blank ones dropped, read up to ``limit_bytes``
    in all; and whether that was every file whole (``validate`` counts tokens from a corpus up to that size)."""
    docs: list[str] = []
    read = 0
    for f in files:
        opener = gzip.open if suffix_of(f) == ".txt.gz" else open
        with opener(f, "rt", encoding="utf-8", errors="replace") as fh:
            text = fh.read(max(0, limit_bytes - read) + 1)
        read += len(text)
        if read > limit_bytes:
            return docs, False
        parts = [text] if documents == "file" else text.split("\n\n")
        docs += [d.strip("\r\n") for d in parts if d.strip()]
    return docs, True


def source_problems(path: str, fmt: str, where: str, files: list[Path] | None = None) -> list[str]:
    """Every local file of a plain-text source that cannot be read, or the glob that matches nothing; each message
    names the source (``where``) and the file. ``files``: these of its files only (a prepare array task checks the
    files it reads; ``validate`` checked them all before the array was queued)."""
    files = files_of(path) if files is None else files
    if not files:
        what = "matches no file" if is_glob(path) else "does not exist"
        return [f"{where}: {path!r} {what} (give a .txt/.txt.gz file or a glob of them, or a data file with "
                "format: text)"]
    kinds = sorted({suffix_of(f) for f in files})
    if len(kinds) > 1 and not set(kinds) <= set(TEXT_SUFFIXES):  # .txt and .txt.gz are one kind: text
        return [f"{where}: {path!r} matches files of several kinds ({', '.join(kinds)}); one source holds one kind "
                "(give a source per kind)"]
    if kinds[0] not in TEXT_SUFFIXES:
        return []  # a data file with format: text: its column is checked with the rows
    out = []
    for f in files:
        problem = text_file_problem(f)
        if problem:
            out.append(f"{where}: {f} {problem}; remove it from the corpus (or narrow the glob)")
    return out


def read_rows(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` rows (all with None) of a local data file, the way ``datasets`` reads it (``validate``'s
    checks of the columns and formats; a ``.jsonl.zst`` file decompressed as it is read)."""
    suffix = suffix_of(path)
    rows: list[dict[str, Any]] = []
    if suffix == ".json":  # a JSON array (or {"key": [...]}) like datasets reads; else JSON lines
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            data = None
        if isinstance(data, dict):  # {"data": [...]}-style: the one list-valued key
            lists = [v for v in data.values() if isinstance(v, list)]
            data = lists[0] if len(lists) == 1 else [data]
        if isinstance(data, list):
            return [r for r in data if isinstance(r, dict)][:limit]
    if suffix in (".jsonl", ".json", ".jsonl.zst"):
        with _open_text(path) as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"line {n} is not valid JSON ({exc.msg})") from None
                    if not isinstance(row, dict):
                        raise ValueError(f"line {n} is not a JSON object")
                    rows.append(row)
                    if limit and len(rows) >= limit:
                        break
        return rows
    if suffix == ".csv":
        with path.open(encoding="utf-8", newline="") as fh:
            for row in csv.DictReader(fh):
                rows.append(dict(row))
                if limit and len(rows) >= limit:
                    break
        return rows
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # only called when importable

        table = pq.ParquetFile(path)
        for batch in table.iter_batches(batch_size=limit or 1024):
            rows += batch.to_pylist()
            if limit and len(rows) >= limit:
                break
        return rows[:limit] if limit else rows
    raise ValueError(f"{suffix or 'no suffix'} is not a data file slurmft reads")


def _open_text(path: Path) -> IO[str]:
    """A data file's text: ``.jsonl.zst`` through zstandard's streaming reader (the package ``datasets`` needs for
    them too: a clear error when it is missing), else the file itself."""
    if suffix_of(path) != ".jsonl.zst":
        return path.open(encoding="utf-8")
    try:
        import zstandard
    except ImportError:
        raise ValueError(f"{path.name} is zstandard-compressed and the zstandard package is not installed here: "
                         "pip install 'slurmft[zstd]' (where slurmft runs, and in the job's Python)") from None
    return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(path.open("rb"), read_across_frames=True,
                                                                       closefd=True),
                            encoding="utf-8")
