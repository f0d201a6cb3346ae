"""What pip installs: every folder of modules is a listed package."""

import tomllib

from tests.conftest import REPO


def test_every_source_folder_is_an_installed_package():
    """A folder of modules missing from pyproject's package list is left out of a non-editable install; the installed
    tree then fails at import (hybrid_jax.parallel did, on the GPU machine's pip install)."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {p.parent.relative_to(REPO) for root in ("hybrid_jax", "kernels") for p in (REPO / root).rglob("*.py")}
    names = {".".join(("hybrid_jax",) + f.parts if f.parts[0] == "kernels" else f.parts) for f in folders}
    assert names - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
