"""The exploration notebook runs top to bottom on CPU (random init of the demo config, no network) and saves its
figures as PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "explore_layers.ipynb"
FIGURES = ("activation_norms", "recurrent_states", "gates", "attention", "next_token")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_explore_notebook_executes_and_saves_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    figures = tmp_path / "figures"
    monkeypatch.setenv("HYBRID_JAX_FIGURES", str(figures))
    monkeypatch.setenv("HYBRID_JAX_WORKDIR", "")
    monkeypatch.setenv("HYBRID_JAX_LENGTH", "32")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    for name in FIGURES:
        path = figures / f"{name}.png"
        assert path.read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
        assert path.stat().st_size > 10_000, f"{path} is suspiciously small (an empty figure?)"
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    shown = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(shown) == len(FIGURES), "every figure is also displayed in the notebook"
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "recurrent sublayers [(2, 'gdn'), (4, 'kda'), (6, 'mamba2')]" in text
    assert "MLA sublayers [0]" in text
