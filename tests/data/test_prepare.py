"""prepare: token counts, shard/manifest format, overwrite and interruption rules, every input kind."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybrid_jax.data import DataStream, load_tokenizer
from hybrid_jax.data.prepare import Documents, open_documents, prepare
from hybrid_jax.data.shards import read_documents, read_manifest
from hybrid_jax.prepare import main
from tests.data.util import sample_documents, small_config, tiny_hf_tokenizer

DOCS = sample_documents(60)


@pytest.fixture
def tokenizer(tmp_path):
    return tiny_hf_tokenizer(tmp_path, DOCS)


def _write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return path


def _expected(tokenizer_path, docs):
    tok = load_tokenizer(tokenizer_path)
    return [tok.encode(d) + [tok.eos_id] for d in docs]


def test_counts_match_the_tokenizer_plus_one_eos_per_document(tmp_path, tokenizer):
    # Two parquet files through a glob, two worker processes, shards of ~300 tokens.
    for i, part in enumerate((DOCS[:25], DOCS[25:])):
        pq.write_table(pa.table({"id": list(range(len(part))), "text": part}), tmp_path / f"part-{i}.parquet")
    docs = open_documents(str(tmp_path / "part-*.parquet"))
    assert docs.total == len(DOCS)
    m = prepare(docs, tokenizer, tmp_path / "out", workers=2, shard_tokens=300, progress=False)
    expected = _expected(tokenizer, DOCS)
    assert m["num_documents"] == len(DOCS)
    assert m["num_tokens"] == sum(len(e) for e in expected)
    assert len(m["shards"]) > 3 and sum(s["num_tokens"] for s in m["shards"]) == m["num_tokens"]
    assert (m["vocab_size"], m["eos_id"]) == (300, 2)
    assert m["tokenizer"]["sha256"] == __import__("hashlib").sha256(tokenizer.read_bytes()).hexdigest()
    assert read_manifest(tmp_path / "out") == {k: v for k, v in m.items() if k != "seconds"}
    got = read_documents(tmp_path / "out")
    assert [d.tolist() for d in got] == expected  # document order kept across workers and shards


def test_jsonl_limit_and_cli(tmp_path, tokenizer, capsys):
    src = _write_jsonl(tmp_path / "docs.jsonl", DOCS)
    args = ["--input", str(src), "--tokenizer", str(tokenizer), "--output", str(tmp_path / "out"), "--workers", "1"]
    main([*args, "--limit-docs", "7"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_documents"] == 7
    assert summary["num_tokens"] == sum(len(e) for e in _expected(tokenizer, DOCS[:7]))
    with pytest.raises(SystemExit, match="--force"):
        main(args)
    main([*args, "--force"])
    assert read_manifest(tmp_path / "out")["num_documents"] == len(DOCS)


def test_a_failed_run_leaves_nothing_it_created(tmp_path, tokenizer):
    """Issue 47 item 13: a failed prepare left an empty output directory (and an interrupted one its shards)."""
    def failing():
        yield from DOCS * 2  # more than one task of documents
        raise KeyboardInterrupt

    out = tmp_path / "new" / "out"
    with pytest.raises(KeyboardInterrupt):
        prepare(Documents(failing(), None), tokenizer, out, progress=False)
    assert not out.exists()  # it created the folder: gone again
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    with pytest.raises(KeyboardInterrupt):
        prepare(Documents(failing(), None), tokenizer, existing, force=True, progress=False)
    assert sorted(p.name for p in existing.iterdir()) == ["notes.txt"]  # what was there stays, nothing of ours
    prepare(Documents(iter(DOCS), None), tokenizer, out, progress=False)
    cfg = small_config(**{"data.source": "tokens", "data.path": str(out), "model.vocab_size": 300})
    assert next(DataStream.open(cfg)).tokens.shape == (4, 17)


def test_tfds_data_source(tmp_path, tokenizer):
    tfds = pytest.importorskip("tensorflow_datasets")

    class TinyText(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = tfds.features.FeaturesDict({"text": tfds.features.Text()})
            return tfds.core.DatasetInfo(builder=self, features=features)

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            yield from enumerate({"text": d} for d in DOCS)

    TinyText(data_dir=str(tmp_path / "tfds"), file_format="array_record").download_and_prepare()
    docs = open_documents("tfds:tiny_text", tfds_data_dir=str(tmp_path / "tfds"))
    assert docs.total == len(DOCS)
    prepare(docs, tokenizer, tmp_path / "out", progress=False)
    got = sorted(d.tolist() for d in read_documents(tmp_path / "out"))  # TFDS stores examples shuffled
    assert got == sorted(_expected(tokenizer, DOCS))


def test_input_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no input file matches"):
        open_documents(str(tmp_path / "*.parquet"))
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="Hugging Face dataset name"):
            open_documents("HuggingFaceFW/fineweb-edu")
    _write_jsonl(tmp_path / "docs.jsonl", ["x"])
    with pytest.raises(ValueError, match=r"docs.jsonl:1 has no .body. field \(set --text-column\)"):
        next(open_documents(str(tmp_path / "docs.jsonl"), text_column="body").texts)


def test_bad_text_columns_are_one_line_errors_and_null_texts_are_counted(tmp_path, tokenizer, capsys):
    path = tmp_path / "in.parquet"
    run = lambda *extra: main(["--input", str(path), "--tokenizer", str(tokenizer), "--output",
                               str(tmp_path / "out"), "--workers", "1", "--force", *extra])
    pq.write_table(pa.table({"id": [1, 2], "body": ["a b", "c"]}), path)
    with pytest.raises(SystemExit, match=rf"^error: {path} has no column 'text' \(its columns: id, body\); name the "
                                         "text column with --text-column$"):
        run()
    with pytest.raises(SystemExit, match=rf"^error: {path}: column 'id' holds int64, not text"):
        run("--text-column", "id")
    pq.write_table(pa.table({"text": [DOCS[0], None, DOCS[1], None]}), path)
    run()
    captured = capsys.readouterr()
    assert "note: 2 documents with a null text were left out" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["null_texts_skipped"] == 2
    assert [d.tolist() for d in read_documents(tmp_path / "out")] == _expected(tokenizer, DOCS[:2])  # no empty ones
    _write_jsonl(tmp_path / "docs.jsonl", [3, "x"])
    with pytest.raises(SystemExit, match=r"^error: .*docs.jsonl: document 0 is a int \(3\), not text"):
        main(["--input", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tokenizer), "--output",
              str(tmp_path / "out2"), "--workers", "1"])
