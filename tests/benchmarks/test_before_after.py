"""``benchmarks before_after`` on the loss kernel (interpret mode): a copy of this tree's kernels is bit for bit the
same, a copy with its ``dlogits`` scaled by 1.001 is not, and a tree without the loss kernel is a one-line error
before anything runs, as is a mistyped tree."""

import json
import pathlib
import shutil

import pytest

from benchmarks import before_after

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tree(tmp_path: pathlib.Path, name: str) -> pathlib.Path:
    tree = tmp_path / name
    shutil.copytree(ROOT / "kernels", tree / "kernels")
    (tree / "hybrid_jax").mkdir()
    shutil.copy(ROOT / "hybrid_jax" / "kernels.py", tree / "hybrid_jax" / "kernels.py")
    return tree


def _bitwise_same(tree: pathlib.Path, out: pathlib.Path) -> bool:
    before_after.main(["--tree", str(tree), "--only", "loss_300m", "--smoke", "--rounds", "1", "--repeats", "1",
                       "--out", str(out)])
    figures = json.loads((out / "before_after.json").read_text())["figures"]
    result = figures["shapes"]["loss_300m"]
    assert result["before_fwd_ms"] > 0 and result["after_fwd_ms"] > 0
    return result["bitwise_same"]


def test_loss_kernel_against_another_tree(tmp_path, capsys):
    assert _bitwise_same(_tree(tmp_path, "same"), tmp_path / "same_out")
    changed = _tree(tmp_path, "changed")
    source = changed / "kernels" / "cross_entropy.py"
    text = source.read_text()
    assert "d = (jnp.exp(x - lse[:, None])" in text
    source.write_text(text.replace("d = (jnp.exp(x - lse[:, None])", "d = (1.001 * jnp.exp(x - lse[:, None])"))
    assert not _bitwise_same(changed, tmp_path / "changed_out")
    (changed / "kernels" / "cross_entropy.py").unlink()
    with pytest.raises(SystemExit):
        _bitwise_same(changed, tmp_path / "gone_out")
    assert "has no kernels/cross_entropy.py" in capsys.readouterr().err
    assert not (tmp_path / "gone_out").exists()  # refused before anything ran
    with pytest.raises(SystemExit):  # a mistyped --tree
        _bitwise_same(tmp_path / "chnaged", tmp_path / "typo_out")
    assert "no kernels/ folder there" in capsys.readouterr().err
