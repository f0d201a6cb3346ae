"""Bad input, each one line before anything is built (or at the first batch, for what only the data shows): a
prepared dataset that disagrees with its manifest, config values that cannot train, a config file that cannot be
loaded."""

import json
import subprocess
import sys

import pytest

from hybrid_jax.data.prepare import Documents, prepare
from hybrid_jax.data.shards import DatasetError
from hybrid_jax.train.config_checks import ConfigError
from hybrid_jax.train.loop import train
from tests.conftest import REPO
from tests.data.util import sample_documents, tiny_hf_tokenizer
from tests.faults.conftest import run_config


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prepared")
    tokenizer = tiny_hf_tokenizer(tmp, sample_documents(60, seed=1))
    prepare(Documents(iter(sample_documents(200, seed=2)), None), tokenizer, tmp / "tokens", shard_tokens=2000,
            progress=False)
    return tmp / "tokens"


def _damaged_copy(prepared, tmp_path, damage):
    import shutil

    data = shutil.copytree(prepared, tmp_path / "data")
    manifest = json.loads((data / "manifest.json").read_text())
    damage(data, manifest)
    (data / "manifest.json").write_text(json.dumps(manifest))
    return data


def _train(data, workdir, **model):
    config = run_config(workdir)
    config.data.update(dict(source="tokens", path=str(data)))
    config.model.update({"vocab_size": 320, **model})
    train(config, log=lambda *_: None)


def _truncate(data, manifest):
    shard = data / manifest["shards"][1]["tokens"]
    shard.write_bytes(shard.read_bytes()[:-40])


DAMAGE = {  # item 8: Grain tracebacks of 123-142 lines at the first batch (and a workdir left), or a KeyError
    "shard deleted": (lambda d, m: (d / m["shards"][0]["tokens"]).unlink(),
                      r"data.path: .*shard-00000.bin is missing: .* is incomplete; prepare it again"),
    "shard truncated": (_truncate, r"shard-00001.bin holds [\d,]+ tokens but the manifest lists [\d,]+: it was "
                                   r"truncated or changed; prepare .* again"),
    "num_tokens changed": (lambda d, m: m.update(num_tokens=m["num_tokens"] + 5),
                           r"manifest.json: num_tokens=[\d,]+ but its shards hold [\d,]+; prepare the dataset again"),
    "no vocab_size": (lambda d, m: m.pop("vocab_size"), r"manifest.json lacks or garbles vocab_size: prepare"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_dataset_that_disagrees_with_its_manifest_is_one_line_before_any_workdir(prepared, tmp_path, case):
    damage, message = DAMAGE[case]
    data = _damaged_copy(prepared, tmp_path, damage)
    with pytest.raises(ConfigError, match=message) as e:
        _train(data, tmp_path / "run")
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_ids_beyond_the_vocabulary_its_manifest_claims_are_one_line_not_nan_skips(prepared, tmp_path):
    """Item 8: a manifest ``vocab_size`` below the real ids gave NaN skips and "lower train.lr"."""
    data = _damaged_copy(prepared, tmp_path, lambda d, m: m.update(vocab_size=200))
    with pytest.raises(DatasetError, match=r"window \d+ holds token id 2\d\d, not below model.vocab_size=200; the "
                                           r"data was prepared with another tokenizer than its manifest says"):
        _train(data, tmp_path / "run", vocab_size=200)


BAD_VALUES = [  # item 13: 147 lines from JAX, values that passed, a key silently ignored
    ({"model.pattern": "*-S-", "model.hidden_size": 63},
     r"^model: model.hidden_size=63 x model.mamba2.expand=2 = 126 is not a multiple of model.mamba2.head_dim=16$"),
    ({"model.pattern": "*-G-K-S-", "model.num_layers": 4}, r"^model.num_layers=4 has no effect beside "
                                                           r"model.pattern='\*-G-K-S-' \(8 sublayers\)"),
    ({"train.lr": float("inf")}, r"^train.lr=inf must be a finite number >= 0$"),
    ({"train.restore_step": -3}, r"^train.restore_step=-3 must be >= 0$"),
]


@pytest.mark.parametrize("overrides,message", BAD_VALUES, ids=[list(o)[-1] for o, _ in BAD_VALUES])
def test_config_values_that_cannot_train_are_one_line(tmp_path, overrides, message):
    config = run_config(tmp_path / "run")
    for key, value in overrides.items():
        section, name = key.split(".")
        config[section][name] = value
    with pytest.raises(ConfigError, match=message):
        train(config, log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_a_config_file_that_cannot_be_loaded_is_one_line(tmp_path):
    """Item 13: a missing file (56 lines), a syntax error (54), no get_config ("unknown config key 'module'")."""
    (tmp_path / "syntax.py").write_text("def get_config(:\n")
    (tmp_path / "empty.py").write_text("X = 1\n")
    cases = {tmp_path / "missing.py": "no such file (the configs are in configs/, e.g. configs/demo.py)",
             tmp_path / "syntax.py": "line 1: invalid syntax",
             tmp_path / "empty.py": "defines no get_config(): a config file is a Python module whose get_config() "
                                    "returns the run's ConfigDict (see configs/demo.py)"}
    for path, message in cases.items():
        out = subprocess.run([sys.executable, "-m", "hybrid_jax.train", "--config", str(path)], capture_output=True,
                             text=True, cwd=REPO, timeout=120)
        assert out.returncode == 1 and out.stderr.strip().splitlines() == [f"error: --config {path}{':' if
                                                                            'defines' not in message else ''} "
                                                                           f"{message}"], out.stderr[-2000:]


@pytest.mark.parametrize("line,message", [
    (b'{"text": broken\n', r"docs.jsonl:2: not a JSON object \(Expecting value at column 10\)"),
    (b'{"text": "caf\xe9"}\n', r"docs.jsonl:2: not UTF-8 text \(byte 0xe9 at column 14\); convert the file to UTF-8"),
])
def test_prepare_names_the_file_and_line_of_a_broken_document(tmp_path, line, message):
    """Item 13: prepare's errors on a broken or non-UTF-8 jsonl named neither file nor line, and left an empty
    output directory."""
    from hybrid_jax.prepare import main

    docs = tmp_path / "docs.jsonl"
    docs.write_bytes(b'{"text": "fine"}\n' + line)
    tokenizer = tiny_hf_tokenizer(tmp_path, sample_documents(20, seed=1))
    with pytest.raises(SystemExit, match=message):
        main(["--input", str(docs), "--tokenizer", str(tokenizer), "--output", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
