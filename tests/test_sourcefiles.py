"""Plain-text sources on the login side (slurmft/sourcefiles.py, slurmft/formats.py, slurmft/plan/checks.py):
which files a source names, which of them are refused before any job, and how a text source is told from chat."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from cli_runner import cli
from test_checks import jsonl, write_run

from slurmft import formats, sourcefiles
from slurmft.config import DatasetSource
from slurmft.errors import ConfigError

PROSE = "The river rose in the night. By morning the bridge was gone.\n"


@pytest.fixture(scope="module")
def bare_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's config and tokenizer with its chat template removed: a base model, as pretraining meets it."""
    out = tmp_path_factory.mktemp("base-model") / "model"
    out.mkdir()
    for f in tiny_model.iterdir():
        if f.suffix == ".json":
            out.joinpath(f.name).write_bytes(f.read_bytes())
    conf = json.loads((out / "tokenizer_config.json").read_text())
    conf.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(conf))
    assert not list(out.glob("*.jinja"))
    return out


def test_text_file_problems(tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_text(PROSE + "é" * 40000)  # two-byte characters across the 64 KiB sample's end are not an error
    zipped = tmp_path / "good.txt.gz"
    zipped.write_bytes(gzip.compress(PROSE.encode()))
    assert sourcefiles.text_file_problem(good) is None
    assert sourcefiles.text_file_problem(zipped) is None
    cases = {"empty.txt": (b"", "is empty"), "blank.txt": (b" \n\n\t\n", "holds only whitespace"),
             "binary.txt": (b"ELF\x02\x01\x00\x00rest", "is binary, not text (a NUL byte at offset 5)"),
             "latin1.txt": ("caf\xe9 noir".encode("latin-1"), "is not UTF-8 text (byte 3: b'\\xe9')"),
             "fake.txt.gz": (PROSE.encode(), "cannot be read (BadGzipFile"),
             "empty.txt.gz": (gzip.compress(b""), "is empty")}
    for name, (data, words) in cases.items():
        (tmp_path / name).write_bytes(data)
        problem = sourcefiles.text_file_problem(tmp_path / name)
        assert problem is not None and problem.startswith(words), (name, problem)


def test_a_glob_names_its_files_sorted_and_one_kind(tmp_path: Path) -> None:
    for name in ("b.txt", "a.txt", "c.txt.gz", "d.jsonl"):
        (tmp_path / name).write_bytes(gzip.compress(PROSE.encode()) if name.endswith(".gz") else PROSE.encode())
    assert [f.name for f in sourcefiles.files_of(str(tmp_path / "*.txt"))] == ["a.txt", "b.txt"]
    assert sourcefiles.files_of(str(tmp_path / "nothing*.txt")) == []
    assert sourcefiles.source_problems(str(tmp_path / "*.txt*"), "auto", "data.datasets[0].path") == []
    assert sourcefiles.is_text(str(tmp_path / "*.txt*"), "auto")
    (mixed,) = sourcefiles.source_problems(str(tmp_path / "*"), "auto", "data.datasets[0].path")
    assert "matches files of several kinds (.jsonl, .txt, .txt.gz)" in mixed


def test_guanaco_text_keeps_its_chat_detection_unless_format_text() -> None:
    guanaco = {"text": "### Human: Hi?### Assistant: Hello."}
    plain = {"text": PROSE}
    auto, text = DatasetSource(path="x.jsonl"), DatasetSource(path="x.jsonl", format="text")
    assert formats.detect_format(auto, ["text"], guanaco, "src") == ("guanaco", "text")
    assert formats.detect_format(text, ["text"], guanaco, "src") == ("text", "text")
    assert formats.detect_format(DatasetSource(path="/c/*.txt"), ["text"], guanaco, "src") == ("text", "text")
    with pytest.raises(ConfigError, match="set format: text to train on every token"):
        formats.detect_format(auto, ["text"], plain, "src")
    renamed = DatasetSource(path="x.jsonl", format="text", columns={"text": "body"})
    assert formats.detect_format(renamed, ["text"], plain, "src") == ("text", "text")


def test_bad_text_input_is_refused_before_any_job(tmp_path: Path, bare_model: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's four: an empty file, a binary file, format text without a text column, a glob matching nothing;
    each names its source and file, all in one report, and submit writes no run directory."""
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text(PROSE)
    (tmp_path / "corpus" / "b.txt").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    columns = jsonl(tmp_path / "rows.jsonl", [{"body": PROSE}])
    sources = [{"path": str(tmp_path / "empty.txt")}, {"path": str(tmp_path / "corpus" / "*.txt")},
               {"path": str(columns), "format": "text"}, {"path": str(tmp_path / "nowhere" / "*.txt.gz")}]
    path = write_run(tmp_path, bare_model, columns, data={"datasets": sources})
    for command in ("validate", "submit"):
        code, _, err = cli([command, str(path)], capsys)
        assert code == 2 and "Traceback" not in err, err
        for expected in [
            f"data.datasets[0].path: {tmp_path / 'empty.txt'} is empty",
            f"data.datasets[1].path: {tmp_path / 'corpus' / 'b.txt'} is binary, not text (a NUL byte at offset 7)",
            "data.datasets[2] (rows.jsonl): format 'text' needs the column(s) ['text'], but the columns are ['body'] "
            "(name the column that holds it with columns: {text: YOUR_COLUMN}",
            f"data.datasets[3].path: '{tmp_path / 'nowhere' / '*.txt.gz'}' matches no file",
        ]:
            assert expected in err, f"{expected!r} not in:\n{err}"
        assert "4 problem(s)" in err
    assert not (tmp_path / "run").exists()


def test_a_text_corpus_validates_on_a_base_model_and_counts_its_steps(tmp_path: Path, bare_model: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Plain text alone needs no chat template; the documents (per file, or per blank-line block) are counted."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text((PROSE * 30 + "\n") * 4)
    (corpus / "b.txt.gz").write_bytes(gzip.compress((PROSE * 5).encode()))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bare_model / "tokenizer.json"))
    for documents in ("file", "blank_line"):
        path = write_run(tmp_path, bare_model, corpus, data={"datasets": [
            {"path": str(corpus / "a.txt"), "documents": documents}], "max_seq_length": 64})
        code, out, err = cli(["validate", str(path)], capsys)
        assert code == 0, err
        assert "packed sequences per epoch" in out and "chat template" not in err, (out, err)
        docs, _ = sourcefiles.read_documents([corpus / "a.txt"], documents, 1 << 20)
        tokens = sum(len(tok.encode(d).ids) + 1 for d in docs)  # the EOS after each document
        assert f"data: ~{tokens:,} tokens per epoch (estimated from the files)" in out, out
    path = write_run(tmp_path, bare_model, corpus, data={"datasets": [{"path": str(corpus / "a.txt")},
                                                                      {"path": str(corpus / "*.gz")}]})
    code, out, err = cli(["validate", str(path)], capsys)
    assert code == 0 and "tokens per epoch" in out, err
    docs, complete = sourcefiles.read_documents([corpus / "a.txt"], "blank_line", 1 << 20)
    assert complete and len(docs) == 4 and docs[0] == (PROSE * 30).strip("\n")


@pytest.mark.parametrize(("extra", "words"), [
    ({"dpo": {}}, "plain text (format text, or a .txt file) trains by language modelling"),
    ({"train": {"max_steps": 5, "sft": {"packing_strategy": "wrapped"}}}, "each document would attend to the ones"),
])
def test_what_cannot_keep_documents_apart_is_refused(tmp_path: Path, bare_model: Path, extra: dict,
                                                     words: str, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a.txt").write_text(PROSE)
    path = write_run(tmp_path, bare_model, tmp_path / "a.txt", **extra)
    code, _, err = cli(["validate", str(path)], capsys)
    assert code == 2 and words in err, err


def _zst(path: Path, rows: list[dict]) -> Path:
    import zstandard

    path.write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    return path


def test_jsonl_zst_files_are_read_as_json_lines_and_their_column_checked(tmp_path: Path, bare_model: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A glob of .jsonl.zst files (the issue's ``/data/corpus/*.jsonl.zst``): validate reads their rows decompressed,
    as the job's datasets does, and refuses one without the text column as it refuses a .jsonl."""
    (tmp_path / "corpus").mkdir()
    rows = [{"body": PROSE * n, "id": n} for n in (1, 3, 5)]
    for i in range(2):
        _zst(tmp_path / "corpus" / f"part{i}.jsonl.zst", rows)
    assert sourcefiles.suffix_of(tmp_path / "corpus" / "part0.jsonl.zst") == ".jsonl.zst"
    assert sourcefiles.read_rows(tmp_path / "corpus" / "part0.jsonl.zst", None) == rows
    assert sourcefiles.read_rows(tmp_path / "corpus" / "part0.jsonl.zst", 2) == rows[:2]
    glob = str(tmp_path / "corpus" / "*.jsonl.zst")
    path = write_run(tmp_path, bare_model, tmp_path, data={"datasets": [
        {"path": glob, "format": "text", "columns": {"text": "body"}}], "max_seq_length": 64})
    code, out, err = cli(["validate", str(path)], capsys)
    assert code == 0 and "chat template" not in err, err
    path = write_run(tmp_path, bare_model, tmp_path, data={"datasets": [{"path": glob, "format": "text"}]})
    code, _, err = cli(["validate", str(path)], capsys)
    assert code == 2 and "format 'text' needs the column(s) ['text'], but the columns are ['body', 'id']" in err, err
