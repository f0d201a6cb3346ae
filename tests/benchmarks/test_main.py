"""python -m benchmarks: the help lists every part, a part gets its flags as main(argv), and config overrides take
the field's type."""

import argparse
import types

import pytest

from benchmarks import __main__ as cli
from benchmarks import configs


def test_help_lists_every_part(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    for part in [*cli.PARTS, "run"]:
        assert f"\n  {part} " in text


def test_a_part_gets_its_flags(monkeypatch):
    seen = []
    fake = types.SimpleNamespace(main=lambda argv=None: seen.append(argv), __file__="fake.py")
    monkeypatch.setattr(cli.importlib, "import_module", lambda name: fake)
    assert cli.main(["kernels", "--only", "gdn_anchor", "--help"]) == 0
    assert seen == [["--only", "gdn_anchor", "--help"]]
    with pytest.raises(SystemExit):
        cli.main(["nonsense"])


def test_run_refuses_unknown_parts():
    with pytest.raises(SystemExit):
        cli.run(["kernels --only gdn_anchor", "nonsense --x"])


def test_config_overrides_take_the_fields_type():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config")
    args, overrides = configs.parse(ap, ["--config", "configs/demo.py", "--config.train.micro_batch_size=4",
                                         "--config.train.zero1=true", "--config.train.lr=0.5"])
    config = configs.load(configs.CONFIG_DIR / "demo.py", overrides)
    assert (config.train.micro_batch_size, config.train.zero1, config.train.lr) == (4, True, 0.5)
    with pytest.raises(SystemExit, match="unknown config key"):
        configs.load(configs.CONFIG_DIR / "demo.py", ["train.nonsense=1"])
    with pytest.raises(SystemExit):
        configs.parse(ap, ["--bogus"])
