"""Exported tokenizer files: ``AutoTokenizer`` on the export encodes as our tokenizer (no bos added)
on text with single spaces; runs of spaces may tokenize differently (transformers vs SentencePiece)."""

import json

import pytest

pytest.importorskip("transformers")

from transformers import AutoTokenizer  # noqa: E402

from hybrid_jax.data.tokenizer import load_tokenizer  # noqa: E402
from hybrid_jax.export.writer import write_tokenizer  # noqa: E402


@pytest.mark.parametrize("name", ["llama2", "llama3"])
def test_exported_tokenizer_encodes_like_ours(name, shared_data, tmp_path):
    path = shared_data / "tokenizers" / name / "tokenizer.model"
    write_tokenizer(str(path), tmp_path)
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(tmp_path)
    with open(shared_data / "eval" / "ARC-Easy-test.jsonl") as f:
        rows = [json.loads(next(f)) for _ in range(30)]
    texts = [f"Question: {r['question']}\nAnswer: {r['choices']['text'][0]}" for r in rows] + ["one\n\ntwo: three"]
    for text in texts:
        assert theirs.encode(text) == ours.encode(text), text
    assert theirs.eos_token_id == ours.eos_id
