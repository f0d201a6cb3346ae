"""benchmarks/kernels.py --trace: a profiler trace of a forward+backward function, summarized per op."""

import jax
import jax.numpy as jnp

from benchmarks.kernels import trace_fwd_bwd


def test_trace_fwd_bwd_counts_each_call_of_the_traced_function(tmp_path):
    def loss(x, w):
        with jax.named_scope("projection"):
            return jnp.tanh(x @ w).sum()

    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    x, w = jnp.ones((64, 32)), jnp.full((32, 16), 0.01)
    summary = trace_fwd_bwd(fwd_bwd, x, w, tmp_path / "case", calls=3)
    assert (tmp_path / "case" / "step_hlo.txt").read_text().startswith("HloModule")
    assert summary["calls"] == 3 and summary["busy_ms"] > 0
    dots = [op for op in summary["ops"] if "dot" in op["name"] or "dot" in op["scope"]]
    assert dots and all(op["count"] % 3 == 0 for op in dots)  # every call of the step, no more, no fewer
    assert any("projection" in op["scope"] for op in summary["ops"])
