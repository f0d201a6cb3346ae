"""hybrid_jax.explore on a random init of the demo config (every sublayer kind): captured values line up with the
model, the state trajectories with the sown final states, and the derived quantities with their definitions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from hybrid_jax import explore  # noqa: E402
from hybrid_jax.data.mock import SUCCESSOR_PROBS  # noqa: E402
from hybrid_jax.model import tied_logits  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.py"
T = 24


@pytest.fixture(scope="module")
def setup():
    model, config = explore.load_model(config=CONFIG, seed=1)
    tokens = explore.prompt_tokens(config, length=T)
    trace = explore.run(model, tokens)
    return model, config, trace, explore.recurrent_states(trace)


def test_trace_lines_up_with_the_model(setup):
    model, _, trace, _ = setup
    assert trace.plan == "*-G-K-S-" and trace.kinds == ["mla", "mlp", "gdn", "mlp", "kda", "mlp", "mamba2", "mlp"]
    assert trace.logits.shape == (T, 512)
    features = model.final_norm(trace.residual[-1])  # logits = final_norm(stream after the last sublayer) @ E^T
    np.testing.assert_allclose(trace.logits, np.asarray(tied_logits(features, model.embedding)), rtol=1e-5, atol=1e-6)
    assert len(trace.residual) == len(trace.kinds) + 1 == len(trace.updates) + 1
    for i, update in enumerate(trace.updates):  # x_{i+1} = x_i + f(norm(x_i))
        np.testing.assert_allclose(trace.residual[i + 1] - trace.residual[i], update, atol=1e-6)
    norms = explore.activation_norms(trace)
    np.testing.assert_allclose(norms["residual"][-1], np.sqrt((trace.residual[-1] ** 2).mean(-1)).mean(), rtol=1e-6)
    assert all(not block.capture_attention for block in trace.mixers if hasattr(block, "capture_attention"))


def test_attention_maps_are_causal_distributions(setup):
    _, _, trace, _ = setup
    assert sorted(trace.attention) == [0]
    maps = trace.attention[0]
    assert maps.shape == (4, T, T)
    np.testing.assert_allclose(maps.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.triu(maps, k=1) == 0)


def test_state_trajectory_ends_at_the_sown_state_and_is_causal(setup):
    model, _, trace, layers = setup
    assert [(layer.index, layer.kind) for layer in layers] == [(2, "gdn"), (4, "kda"), (6, "mamba2")]
    prefix = explore.run(model, trace.tokens[: T // 2])
    for layer in layers:
        final = trace.internals[layer.index]["final_state"]
        assert layer.states.shape == (T, *final.shape)
        np.testing.assert_allclose(layer.states[-1], final, rtol=1e-4, atol=1e-6)
        # the state after the first T/2 tokens is what a run on those tokens alone ends with
        np.testing.assert_allclose(layer.states[T // 2 - 1], prefix.internals[layer.index]["final_state"],
                                   rtol=1e-4, atol=1e-6)
        assert layer.state_norm.shape == layer.memory.shape == layer.decay.shape == (T, final.shape[0])
        assert np.all((layer.decay > 0) & (layer.decay < 1))
    assert layers[0].beta.shape == (T, 4) and layers[2].beta is None and layers[2].dt.shape == (T, 8)


def test_effective_memory_matches_its_closed_form():
    a = np.array([0.9, 0.5])
    g = np.log(np.broadcast_to(a, (50, 2)))
    m = explore.effective_memory(g)
    t = np.arange(1, 51)[:, None]
    np.testing.assert_allclose(m, (1 - a**t) / (1 - a), rtol=1e-12)  # -> 1 / (1 - a): 10 and 2 tokens
    np.testing.assert_allclose(explore.effective_memory(np.zeros((7, 3, 2)))[-1], 7.0)  # no decay: every token


def test_next_token_probabilities(setup):
    _, config, trace, _ = setup
    probs = explore.next_token_probs(trace)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(explore.target_probs(trace), probs[np.arange(T - 1), trace.tokens[1:]])
    table = explore.next_token_table(trace, config, k=3)
    assert [p for _, p in table] == sorted(probs[-1])[::-1][:3]
    assert sum(label.endswith("*") for label, _ in explore.next_token_table(trace, config, k=512)) == 4
    # the prompt is a sequence of the mock chain: every transition is one of the chain's successors
    assert set(explore.chain_probs(trace.tokens, config)) <= set(SUCCESSOR_PROBS)


def test_plots_have_one_row_per_layer(setup, tmp_path: Path):
    _, config, trace, layers = setup
    assert len(explore.plot_recurrent_states(layers).axes) == 2 * 3
    assert len(explore.plot_attention(trace).axes) == 4 + 1  # four heads and the colour bar
    path = explore.save_figure(explore.plot_next_token(trace, config), tmp_path / "figs", "next")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_text_prompts_use_the_run_tokenizer(shared_data: Path):
    from hybrid_jax.config import load_config_file

    config = load_config_file(CONFIG)
    config.model.vocab_size = 32000
    config.data.tokenizer = str(shared_data / "tokenizers" / "llama2" / "tokenizer.model")
    tokens = explore.prompt_tokens(config, "The quick brown fox")
    assert tokens.tolist() == [1, 450, 4996, 17354, 1701, 29916]  # bos, then Llama-2's pieces
    logits = np.full((len(tokens), 32000), -10.0, np.float32)
    logits[-1, 450] = 10.0  # after "fox": " The", almost surely
    trace = explore.Trace(tokens=tokens, plan="", kinds=[], logits=logits, residual=[], updates=[], internals=[])
    (label, p), *_ = explore.next_token_table(trace, config, k=2)
    assert label == "'The'" and p > 0.99


def test_figures_name_heads_tokens_and_colours(setup, tmp_path, monkeypatch):
    """Issue 49 item 4: head colours without a legend, attention maps without token ticks or colour bar, x axes in
    positions; and a relative workdir looked up from where Jupyter was started."""
    _, config, trace, layers = setup
    labels = [str(t) for t in trace.tokens]  # the demo has no tokenizer: token ids
    assert trace.labels == labels and all(layer.labels == labels for layer in layers)
    states = explore.plot_recurrent_states(layers)
    legend = states.axes[1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [f"head {h}" for h in range(layers[0].state_norm.shape[1])]
    assert [t.get_text() for t in states.axes[0].get_xticklabels()] == labels
    attention = explore.plot_attention(trace)
    assert any(ax.get_label() == "<colorbar>" for ax in attention.axes)
    assert [t.get_text() for t in attention.axes[0].get_yticklabels()] == labels[::2]  # 24 tokens, at most 16 ticks

    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "runs")  # Jupyter's kernel runs in the notebook's folder...
    monkeypatch.setenv("PWD", str(tmp_path))  # ...started from the folder the user typed the path in
    assert explore.resolve_workdir("runs/demo") == run
    with pytest.raises(FileNotFoundError, match=r"workdir runs/nowhere not found; tried .*runs/runs/nowhere, "):
        explore.resolve_workdir("runs/nowhere")
