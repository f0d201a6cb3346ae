"""Tokenizers: chosen from the file content, the published ids of Llama-2/Llama-3, clear errors."""

import pytest

from hybrid_jax.data.tokenizer import check_vocab, detect_kind, load_tokenizer
from tests.data.util import sample_documents, tiny_hf_tokenizer


def test_hf_tokenizer_json(tmp_path):
    docs = sample_documents(50)
    path = tiny_hf_tokenizer(tmp_path, docs)
    assert detect_kind(path) == "hf"
    tok = load_tokenizer(tmp_path)  # a directory resolves to its tokenizer.json
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (300, 1, 2)
    for doc in docs[:5]:
        ids = tok.encode(doc)
        assert tok.eos_id not in ids and tok.decode(ids) == doc
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": {"content": "<unk>"}}')
    assert load_tokenizer(path).eos_id == 0  # tokenizer_config.json beside it wins


def test_llama2_sentencepiece(shared_data):
    path = shared_data / "tokenizers" / "llama2" / "tokenizer.model"
    assert detect_kind(path) == "sentencepiece"
    tok = load_tokenizer(path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (32000, 1, 2)
    assert tok.encode("Hello world") == [15043, 3186]
    assert tok.decode([15043, 3186]) == "Hello world"


def test_llama3_tiktoken(shared_data):
    path = shared_data / "tokenizers" / "llama3" / "tokenizer.model"
    assert detect_kind(path) == "tiktoken"
    tok = load_tokenizer(path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (128256, 128000, 128001)
    assert tok.encode("Hello world") == [9906, 1917]
    ids = tok.encode("<|end_of_text|> I'm 12345")  # special-token text in a document is plain text
    assert max(ids) < 128000 and tok.decode(ids) == "<|end_of_text|> I'm 12345"
    assert tok.decode([128000, 9906]) == "<|begin_of_text|>Hello"


def test_errors_say_what_to_pass(tmp_path):
    with pytest.raises(FileNotFoundError, match="SentencePiece .model"):
        load_tokenizer(tmp_path / "missing.model")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model"):
        load_tokenizer(tmp_path)
    (tmp_path / "junk.model").write_bytes(b"\x00\x01not a tokenizer")
    with pytest.raises(ValueError, match="cannot read .* sentencepiece tokenizer"):
        load_tokenizer(tmp_path / "junk.model")
    with pytest.raises(ValueError, match="vocab_size=32000"):
        check_vocab(512, 32000)
    check_vocab(32000, 32000)
