"""The whole HybridLM: logits, features + tied embedding, causality, intermediates, gradients, remat, 300M GDN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.model import HybridLM, tied_logits
from hybrid_jax.model.plan import REMAT_MODES as REMAT
from tests.conftest import load_config

B, T = 2, 40


def demo_cfg(**overrides):
    cfg = load_config("demo").model
    cfg.update(overrides)
    return cfg


def tokens(cfg, shape=(B, T), seed=0):
    return jax.random.randint(jax.random.key(seed), shape, 0, cfg.vocab_size, dtype=jnp.int32)


def jitted(model: HybridLM, fn):
    """``tokens -> fn(model, tokens)`` jitted once (the model's state is an argument, not a constant)."""
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda s, toks: fn(nnx.merge(graphdef, s), toks))
    return lambda toks: f(state, toks)


def _value_and_grad(model: HybridLM):
    """``(jitted (params, rest, tokens) -> (next-token loss, grads of every Param), (params, rest))`` of ``model``."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, r, toks):
        logits = nnx.merge(graphdef, p, r)(toks[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], axis=-1))

    return jax.jit(jax.value_and_grad(loss)), (params, rest)


def loss_and_grad(model: HybridLM):
    """A jitted ``tokens -> (next-token loss, grads of every Param)`` for ``model``."""
    f, state = _value_and_grad(model)
    return lambda toks: f(*state, toks)


def compiled_loss_and_grad(model: HybridLM, toks: jax.Array):
    """``(a call of loss_and_grad on toks, compiled once; that compile's temporary bytes: what the backward keeps)``."""
    f, state = _value_and_grad(model)
    c = f.lower(*state, toks).compile()
    return (lambda: c(*state, toks)), c.memory_analysis().temp_size_in_bytes


def capture(model: HybridLM, toks: jax.Array) -> dict[str, jax.Array]:
    """Every sown intermediate of ``model(toks)`` as ``{dotted path: array}`` (one call: one value per name)."""
    _, intms = jitted(model, lambda m, t: nnx.capture(m, nnx.Intermediate)(t))(toks)
    return flat(intms)


def flat(intms: nnx.State) -> dict[str, jax.Array]:
    return {".".join(map(str, path)): v.get_value()[0] for path, v in nnx.to_flat_state(intms)}


@pytest.fixture(scope="module")
def demo():
    cfg = demo_cfg()
    return cfg, HybridLM(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def demo_forward(demo):
    """The demo model as one compiled function: ``tokens -> (logits, features, intermediates)``."""

    def forward(m: HybridLM, toks: jax.Array):
        logits, intms = nnx.capture(m, nnx.Intermediate)(toks)
        return logits, m.features(toks), flat(intms)

    return jitted(demo[1], forward)


@pytest.fixture(scope="module")
def demo_grads(demo):
    return loss_and_grad(demo[1])(tokens(demo[0], (B, T + 1)))


def test_logits_and_features(demo, demo_forward):
    cfg, model = demo
    toks = tokens(cfg)
    logits, feats, _ = demo_forward(toks)
    assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())
    assert feats.shape == (B, T, cfg.hidden_size)
    np.testing.assert_allclose(feats @ model.embedding.T, logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(tied_logits(feats, model.embedding), logits, rtol=1e-6, atol=1e-6)
    assert model.embedding.dtype == jnp.float32 and model.embedding.shape == (cfg.vocab_size, cfg.hidden_size)
    # Untrained logits are near uniform: loss ~ log(V).
    lse = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, toks[..., None], -1)[..., 0]
    assert abs(float(lse.mean()) - np.log(cfg.vocab_size)) < 0.3


def test_demo_model_is_causal(demo, demo_forward):
    cfg, _ = demo
    toks = tokens(cfg)
    ref = demo_forward(toks)[0]
    scale = float(jnp.abs(ref).max())
    for t in (3, 17, T - 1):
        out = demo_forward(toks.at[:, t].set((toks[:, t] + 1) % cfg.vocab_size))[0]
        np.testing.assert_allclose(out[:, :t], ref[:, :t], atol=1e-6 * scale, rtol=0)
        assert float(jnp.abs(out[:, t] - ref[:, t]).max()) > 1e-3 * scale


def test_sown_intermediates(demo, demo_forward):
    cfg, model = demo
    logits, _, intms = demo_forward(tokens(cfg))
    shapes = {path: tuple(v.shape) for path, v in intms.items()}
    D, g, k, s = cfg.hidden_size, cfg.gdn, cfg.kda, cfg.mamba2
    nh = s.expand * D // s.head_dim
    expected = {f"layers.{i}.output": (B, T, D) for i in range(8)}
    expected.update({
        "layers.2.mixer.g": (B, T, g.num_value_heads),
        "layers.2.mixer.beta": (B, T, g.num_value_heads),
        "layers.2.mixer.final_state": (B, g.num_value_heads, g.key_head_dim, g.value_head_dim),
        "layers.4.mixer.g": (B, T, k.num_value_heads, k.key_head_dim),
        "layers.4.mixer.beta": (B, T, k.num_value_heads),
        "layers.4.mixer.final_state": (B, k.num_value_heads, k.key_head_dim, k.value_head_dim),
        "layers.6.mixer.dt": (B, T, nh),
        "layers.6.mixer.final_state": (B, nh, s.state_dim, s.head_dim),
    })
    assert shapes == expected  # no attention map unless asked for
    assert all(float(intms[f"layers.{i}.mixer.g"].max()) < 0 for i in (2, 4))  # log decays are negative
    assert float(intms["layers.6.mixer.dt"].min()) > 0
    # The last output is the residual stream that the final norm and the tied embedding turn into the logits.
    np.testing.assert_allclose(tied_logits(model.final_norm(intms["layers.7.output"]), model.embedding), logits,
                               rtol=1e-5, atol=1e-5)
    assert nnx.state(model, nnx.Intermediate) == nnx.State({})  # nothing is left on the module


def test_attention_map_on_request():
    cfg = demo_cfg(pattern="*-")
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    model.layers[0].self_attention.capture_attention = True
    att = capture(model, tokens(cfg, (1, 12)))["layers.0.self_attention.attention"]
    assert att.shape == (1, cfg.mla.num_heads, 12, 12)
    np.testing.assert_allclose(att.sum(-1), 1.0, rtol=1e-5)
    assert float(jnp.triu(att, 1).max()) == 0.0


def test_demo_forward_backward(demo_grads):
    """Gradients are finite, float32, and reach every parameter."""
    loss, grads = demo_grads
    assert np.isfinite(float(loss))
    for path, g in nnx.to_flat_state(grads):
        g = np.asarray(g[...])
        assert g.dtype == np.float32 and np.isfinite(g).all() and np.abs(g).max() > 0, path


def test_remat_changes_memory_not_numbers():
    """``full`` keeps the least for the backward, ``dots`` (the projections' outputs too) more, ``none`` the most; the
    loss and gradients are the same."""
    toks = tokens(demo_cfg(), (B, T + 1))
    remat = {mode: HybridLM(demo_cfg(pattern="*-G-", remat=mode), rngs=nnx.Rngs(0)) for mode in REMAT}
    assert [layer.remat for layer in remat["mixer"].layers] == [True, False, True, False]
    assert all(layer.remat for layer in remat["full"].layers) and all(layer.remat for layer in remat["dots"].layers)
    runs = {mode: compiled_loss_and_grad(remat[mode], toks) for mode in ("none", "dots", "full")}
    temp = {mode: bytes_ for mode, (_, bytes_) in runs.items()}
    assert temp["full"] < temp["dots"] < temp["none"], temp
    loss, grads = runs["none"][0]()
    for mode in ("dots", "full"):
        loss_r, grads_r = runs[mode][0]()
        np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), grads_r, grads)
    with pytest.raises(ValueError, match="remat"):
        HybridLM(demo_cfg(remat="some"), rngs=nnx.Rngs(0))


def test_bfloat16_compute_path():
    cfg = demo_cfg(dtype="bfloat16")
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    toks = tokens(cfg, (B, T + 1))
    assert model.embedding.dtype == jnp.float32  # float32 master weights
    graphdef, state = nnx.split(model)
    shapes = jax.eval_shape(lambda s, t: (nnx.merge(graphdef, s)(t), nnx.merge(graphdef, s).features(t)), state, toks)
    assert shapes[0].dtype == jnp.float32 and shapes[1].dtype == jnp.bfloat16
    loss, grads = loss_and_grad(model)(toks)
    assert abs(float(loss) - np.log(cfg.vocab_size)) < 0.3
    assert all(g.dtype == np.float32 and np.isfinite(g).all() for g in map(np.asarray, jax.tree.leaves(grads)))


def test_300m_gdn_forward_backward():
    """The 300M GDN config: 12 GDN and 12 MLP sublayers (abstract), and at its widths and vocabulary a loss near
    log V with finite gradients of sane size (its first GDN and MLP sublayers, float32)."""
    cfg = load_config("zebra_300m_gdn").model
    abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0)))
    assert len(jax.tree.leaves(nnx.state(abstract, nnx.Param))) == 12 * (7 + 3) + 2
    cfg.update(dict(dtype="float32", num_layers=2))
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    loss, grads = loss_and_grad(model)(tokens(cfg, (1, 33)))
    assert abs(float(loss) - np.log(cfg.vocab_size)) < 0.5
    leaves = [np.asarray(g, np.float64) for g in jax.tree.leaves(grads)]
    assert len(leaves) == 7 + 3 + 2
    assert all(np.isfinite(g).all() for g in leaves)
    gnorm = np.sqrt(sum((g * g).sum() for g in leaves))
    assert 0 < gnorm < 1e3


def test_untied_output_layer():
    """``model.tie_embeddings=False`` adds ``lm_head [V, D]``, drawn after every other parameter (which stay those of
    the tied model), and every logit is made with it: the forward pass, decoding and the training loss."""
    from hybrid_jax.data.pipeline import Batch
    from hybrid_jax.model import count_params
    from hybrid_jax.train.step.train_step import batch_loss

    cfg, untied_cfg = demo_cfg(pattern="G-"), demo_cfg(pattern="G-", tie_embeddings=False)
    tied, untied = HybridLM(cfg, rngs=nnx.Rngs(0)), HybridLM(untied_cfg, rngs=nnx.Rngs(0))
    assert tied.lm_head is None and np.array_equal(tied.output_embedding, tied.embedding)
    head = np.asarray(untied.output_embedding)
    assert head.shape == (cfg.vocab_size, cfg.hidden_size) and head.dtype == np.float32
    assert abs(head.std() - cfg.init_std) < 0.1 * cfg.init_std and not np.allclose(head, untied.embedding)
    shared = nnx.to_pure_dict(nnx.state(untied, nnx.Param))
    assert shared.pop("lm_head").shape == head.shape
    jax.tree.map(np.testing.assert_array_equal, shared, nnx.to_pure_dict(nnx.state(tied, nnx.Param)))
    assert count_params(untied_cfg) - count_params(cfg) == cfg.vocab_size * cfg.hidden_size

    def run(m: HybridLM, t: jax.Array):
        n = jnp.full((B,), t.shape[1] - 1, jnp.int32)
        last = m.prefill(t[:, :-1], n, m.init_cache(B, t.shape[1]))[0]
        graphdef, params = nnx.split(m)
        return m(t[:, :-1]), m.features(t[:, :-1]), last, batch_loss(params, graphdef, Batch(t), chunk_size=7)

    toks = tokens(cfg, (B, 10))
    logits, feats, last, loss = jitted(untied, run)(toks)
    np.testing.assert_allclose(logits, feats @ head.T, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(logits - feats @ untied.embedding.T).max()) > 0.1
    np.testing.assert_allclose(last, logits[:, -1], rtol=1e-5, atol=1e-5)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], axis=-1).mean()
    np.testing.assert_allclose(loss, nll, rtol=1e-5)
