"""Tokenizers behind one small interface, picked from the file's content.

* SentencePiece ``.model`` (a protobuf; Llama-2, the tokenizer of FLA's models): ``sentencepiece``.
* tiktoken BPE rank file (lines ``<base64 token> <rank>``; Llama-3, Primus's configs): ``tiktoken`` with the
  Llama-3 split pattern and its 256 special tokens after the ranks (128,000 + 256 = 128,256 ids; bos
  ``<|begin_of_text|>`` = 128000, eos ``<|end_of_text|>`` = 128001).
* Hugging Face ``tokenizer.json``: ``tokenizers``; bos/eos come from a ``tokenizer_config.json`` beside it
  when there is one, else from the usual token names.

``encode`` never adds bos/eos and treats special-token text inside documents as plain text.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Protocol

_WHAT_TO_PASS = (
    "pass a SentencePiece .model (e.g. Llama-2 tokenizer.model), a tiktoken BPE rank file "
    "(e.g. Llama-3 tokenizer.model) or a Hugging Face tokenizer.json (or a directory holding one)"
)


class Tokenizer(Protocol):
    vocab_size: int  # number of ids, special tokens included
    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class SentencePieceTokenizer:
    def __init__(self, path: str):
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.vocab_size = self._sp.vocab_size()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise ValueError(f"SentencePiece model {path} defines no EOS token")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL = 256
_LLAMA3_NAMED_SPECIAL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
    "<|eot_id|>", "<|python_tag|>",
]


def llama3_special_tokens() -> list[str]:
    """The 256 Llama-3 special tokens, in id order after the BPE ranks."""
    named = len(_LLAMA3_NAMED_SPECIAL)
    return _LLAMA3_NAMED_SPECIAL + [f"<|reserved_special_token_{2 + i}|>" for i in range(LLAMA3_NUM_SPECIAL - named)]


class TiktokenTokenizer:
    def __init__(self, path: str):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        ranks = load_tiktoken_bpe(path)
        specials = {tok: len(ranks) + i for i, tok in enumerate(llama3_special_tokens())}
        self._enc = tiktoken.Encoding(Path(path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=specials)
        self.vocab_size = len(ranks) + len(specials)
        self.bos_id = specials["<|begin_of_text|>"]
        self.eos_id = specials["<|end_of_text|>"]

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids))


_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>", "[SEP]")


class HFTokenizer:
    def __init__(self, path: str):
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        named = _special_names(Path(path).with_name("tokenizer_config.json"))
        self.bos_id = self._find(named.get("bos_token"), _BOS_NAMES)
        self.eos_id = self._find(named.get("eos_token"), _EOS_NAMES)
        if self.eos_id is None:
            raise ValueError(f"{path}: no EOS token found (looked for {', '.join(_EOS_NAMES)}); "
                             "put a tokenizer_config.json with eos_token beside it")

    def _find(self, configured: str | None, names: tuple[str, ...]) -> int | None:
        for name in (configured, *names) if configured else names:
            if (i := self._tok.token_to_id(name)) is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _special_names(config_path: Path) -> dict[str, str]:
    """``bos_token``/``eos_token`` of an HF ``tokenizer_config.json`` (plain or ``{"content": ...}``) if present."""
    if not config_path.is_file():
        return {}
    cfg = json.loads(config_path.read_text())
    out = {}
    for key in ("bos_token", "eos_token"):
        value = cfg.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def resolve_path(path: str | Path) -> Path:
    """The tokenizer file for ``path``: the file itself, or ``tokenizer.json``/``tokenizer.model`` in a directory."""
    p = Path(path).expanduser()
    if p.is_dir():
        for name in ("tokenizer.json", "tokenizer.model"):
            if (p / name).is_file():
                return p / name
        raise FileNotFoundError(f"tokenizer directory {p} holds no tokenizer.json or tokenizer.model: {_WHAT_TO_PASS}")
    if not p.is_file():
        raise FileNotFoundError(f"tokenizer file {str(path)!r} not found: {_WHAT_TO_PASS}")
    return p


def file_sha256(path: str | Path) -> str:
    """sha256 hex digest of the tokenizer file at ``path`` (file or directory, as :func:`resolve_path`)."""
    with open(resolve_path(path), "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def detect_kind(path: Path) -> str:
    """``"hf"``, ``"tiktoken"`` or ``"sentencepiece"`` from the first bytes of the file."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.lstrip().startswith(b"{"):
        return "hf"
    first = head.split(b"\n", 1)[0].split()
    if len(first) == 2 and first[1].isdigit():
        try:
            base64.b64decode(first[0], validate=True)
            return "tiktoken"
        except ValueError:
            pass
    return "sentencepiece"


_KINDS = {"hf": HFTokenizer, "tiktoken": TiktokenTokenizer, "sentencepiece": SentencePieceTokenizer}


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Open the tokenizer at ``path`` (file or directory), choosing the library from the file's content."""
    file = resolve_path(path)
    kind = detect_kind(file)
    try:
        return _KINDS[kind](str(file))
    except Exception as e:  # each library raises its own types for a corrupt file
        raise ValueError(f"cannot read {file} as a {kind} tokenizer ({e}): {_WHAT_TO_PASS}") from e


def check_vocab(model_vocab_size: int, tokenizer_vocab_size: int, *, what: str = "the tokenizer") -> None:
    """Raise unless the model's embedding table covers every id of the tokenizer."""
    if model_vocab_size < tokenizer_vocab_size:
        raise ValueError(
            f"model.vocab_size={model_vocab_size} is smaller than the {tokenizer_vocab_size} ids of {what}: "
            f"set --config.model.vocab_size={tokenizer_vocab_size} (or larger, e.g. padded to a multiple of 128)"
        )
