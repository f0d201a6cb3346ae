"""Megatron-LM's indexed datasets as a source: files written by megatron-core read back through ours token for token
and document for document, ours read by megatron-core, the same batches as our format of the same documents, and a
one-line error for each way the files can be wrong."""

import struct
import types
import warnings

import numpy as np
import pytest

from hybrid_jax.data import DataStream
from hybrid_jax.data.megatron import MegatronWriter, open_megatron
from hybrid_jax.data.prepare import Documents, prepare
from hybrid_jax.data.shards import read_documents
from hybrid_jax.data.source import DatasetError, TokenWindows, open_source
from hybrid_jax.prepare import main as prepare_main
from tests.data.util import sample_documents, small_config, tiny_hf_tokenizer


def megatron_indexed_dataset() -> types.ModuleType:
    """megatron-core's ``megatron.core.datasets.indexed_dataset`` (the package warns that Transformer Engine and Apex
    are absent: not used here); skips when megatron-core is not installed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                   reason="megatron-core is not installed: pip install --no-deps megatron-core==0.19.2")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The same 80 documents (a 300-id BPE tokenizer) as our shards and, through the CLI, as a Megatron pair."""
    tmp = tmp_path_factory.mktemp("megatron")
    docs = sample_documents(80, seed=4)
    tokenizer = tiny_hf_tokenizer(tmp, docs)
    prepare(Documents(iter(docs), None), tokenizer, tmp / "ours", shard_tokens=1000, progress=False)
    (tmp / "docs.jsonl").write_text("".join(__import__("json").dumps({"text": t}) + "\n" for t in docs))
    prepare_main(["--input", str(tmp / "docs.jsonl"), "--tokenizer", str(tokenizer), "--output",
                  str(tmp / "meg" / "text_document"), "--format", "megatron", "--workers", "1"])
    return dict(ours=tmp / "ours", megatron=str(tmp / "meg" / "text_document"), tmp=tmp)


def _documents(rng: np.random.Generator, n: int, high: int) -> list[list[np.ndarray]]:
    """``n`` documents of 1-3 sequences (as --split-sentences writes them) of 0-40 random ids below ``high``."""
    return [[rng.integers(0, high, rng.integers(0, 40)) for _ in range(rng.integers(1, 4))] for _ in range(n)]


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_a_pair_written_by_megatron_core_reads_back_token_for_token_and_document_for_document(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    indexed = megatron_indexed_dataset()
    docs = _documents(np.random.default_rng(0), 60, 65000 if dtype == "uint16" else 128_000)
    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=getattr(np, dtype))
    for doc in docs:
        for sentence in doc:
            builder.add_item(torch.from_numpy(sentence))
        builder.end_document()
    builder.finalize(str(tmp_path / "d.idx"))

    source = open_source(str(tmp_path / "d"), "megatron")
    stream = np.concatenate([s for d in docs for s in d])
    assert (source.format, source.num_tokens, source.num_documents) == ("megatron", stream.size, len(docs))
    whole = TokenWindows(source, stream.size, 128_000)  # one window: the whole token stream
    np.testing.assert_array_equal(whole[0], stream)
    lengths = [sum(s.size for s in d) for d in docs]
    document_of_token = np.repeat(np.arange(len(docs)), lengths)
    distinct = np.concatenate([[0], np.cumsum(np.diff(document_of_token) > 0)])  # empty documents take no number
    np.testing.assert_array_equal(whole.segment_ids(0), distinct)
    windows = TokenWindows(source, 17, 128_000)  # a window's documents, counted from its first token
    for w in (0, 5, len(windows) - 1):
        np.testing.assert_array_equal(windows[w], stream[17 * w : 17 * w + 17])
        np.testing.assert_array_equal(windows.segment_ids(w), distinct[17 * w : 17 * w + 17] - distinct[17 * w])


@pytest.mark.filterwarnings("ignore:Could not determine rank")
def test_a_pair_written_by_prepare_reads_back_through_megatron_core(prepared):
    indexed = megatron_indexed_dataset()
    theirs = indexed.IndexedDataset(prepared["megatron"])
    ours = read_documents(prepared["ours"])  # each document with its EOS, as --append-eod writes it
    assert len(theirs) == len(ours) == 80 and theirs.index.dtype == np.uint16  # 300 ids: uint16, as Megatron picks
    np.testing.assert_array_equal(theirs.document_indices, np.arange(81))
    for i, doc in enumerate(ours):
        np.testing.assert_array_equal(theirs[i], doc)
    source = open_megatron(prepared["megatron"])
    assert source.eod_id == 2 and "ends in token 2 (EOD: written with --append-eod)" in source.describe()


def test_batches_from_the_megatron_pair_equal_those_of_our_format(prepared):
    def stream(source, path, position=0):
        config = small_config(**{"data.source": source, "data.path": str(path), "model.vocab_size": 300,
                                 "data.document_mask": True})
        return DataStream.open(config, position=position)

    ours, theirs = stream("tokens", prepared["ours"]), stream("megatron", prepared["megatron"])
    for _ in range(30):  # more than an epoch of 4-window batches: the permutations agree across epochs too
        a, b = next(ours), next(theirs)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.segment_ids, b.segment_ids)
    resumed = stream("megatron", prepared["megatron"], position=theirs.position)
    np.testing.assert_array_equal(next(resumed).tokens, next(ours).tokens)


def _other_bin(tmp_path) -> bytes:
    """The .bin of another (shorter) dataset."""
    writer = MegatronWriter(str(tmp_path / "other"), 300)
    writer.add(np.arange(50, dtype=np.uint32), np.asarray([50]))
    writer.finish()
    return (tmp_path / "other.bin").read_bytes()


BROKEN = {  # name: (the .idx and .bin bytes -> broken ones, the line it must say)
    "truncated bin": (lambda i, b, other: (i, b[:-6]), r"text\.bin holds [\d,]+ uint16 tokens but text\.idx lists "
                                                      r"[\d,]+: the \.bin is truncated or belongs to another index"),
    "another dataset's bin": (lambda i, b, other: (i, other), r"the \.bin is truncated or belongs to another index"),
    "truncated idx": (lambda i, b, other: (i[:-8], b), r"holds [\d,]+ bytes but its header \(80 sequences, 81 "
                                                       r"document entries\) needs [\d,]+: it is truncated or damaged"),
    "version 2": (lambda i, b, other: (i[:9] + struct.pack("<Q", 2) + i[17:], b), r"index version 2; only version 1"),
    "float dtype": (lambda i, b, other: (i[:17] + bytes([7]) + i[18:], b), r"dtype code 7 \(float32, not a token type"),
    "unknown dtype": (lambda i, b, other: (i[:17] + bytes([9]) + i[18:], b), r"code 9 \(not one Megatron defines\)"),
    "multimodal": (lambda i, b, other: (i + bytes(80), b), r"is a multimodal index \(a mode byte per sequence\)"),
    "not megatron": (lambda i, b, other: (b"NOTMEGATR" + i[9:], b), r"does not start with Megatron's b'MMIDIDX"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_pair_is_one_line(prepared, tmp_path, case):
    change, message = BROKEN[case]
    with open(prepared["megatron"] + ".idx", "rb") as i, open(prepared["megatron"] + ".bin", "rb") as b:
        idx, bin_ = change(i.read(), b.read(), _other_bin(tmp_path) if "another" in case else None)
    (tmp_path / "text.idx").write_bytes(idx)
    (tmp_path / "text.bin").write_bytes(bin_)
    with pytest.raises(DatasetError, match=message) as e:
        open_source(str(tmp_path / "text"), "megatron")
    assert "\n" not in str(e.value)


def test_paths_and_ids_beyond_the_vocabulary_are_one_line(prepared, tmp_path):
    from hybrid_jax.train.config_checks import ConfigError
    from hybrid_jax.train.loop import train
    from tests.train.common import tiny_config

    with pytest.raises(DatasetError, match=r"text_document\.bin names a file of a Megatron dataset: give its path "
                                           r"prefix without \.bin"):
        open_source(prepared["megatron"] + ".bin")
    with pytest.raises(FileNotFoundError, match=r"nowhere\.idx not found: data\.path takes a Megatron dataset's"):
        open_source(str(tmp_path / "nowhere"), "megatron")
    windows = TokenWindows(open_source(prepared["megatron"]), 17, 200)  # every window is checked as it is read
    with pytest.raises(DatasetError, match=r"window \d+ holds token id 2\d\d, not below model.vocab_size=200; a "
                                           r"Megatron dataset records no vocabulary: set model.vocab_size"):
        [windows[w] for w in range(len(windows))]
    config = tiny_config(str(tmp_path / "run"))  # at the start, from its first tokens: before any workdir
    config.data.update(dict(source="megatron", path=prepared["megatron"]))
    config.model.vocab_size = 200
    with pytest.raises(ConfigError, match=r"^data\.path: .*text_document holds token id 2\d\d, not in \[0, "
                                          r"model\.vocab_size=200\); a Megatron dataset records no vocabulary") as e:
        train(config, log=lambda *_: None)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()
