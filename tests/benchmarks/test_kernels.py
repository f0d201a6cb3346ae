"""benchmarks/kernels.py: --trace (a profiler trace of a forward+backward, per op) and the --variant report."""

import jax
import jax.numpy as jnp

from benchmarks.kernels import trace_fwd_bwd
from hybrid_jax.kernels.tooling.problems import Problem


def test_trace_fwd_bwd_counts_each_call_of_the_traced_function(tmp_path):
    def loss(x, w):
        with jax.named_scope("projection"):
            return jnp.tanh(x @ w).sum()

    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    x, w = jnp.ones((64, 32)), jnp.full((32, 16), 0.01)
    summary = trace_fwd_bwd(fwd_bwd, x, w, tmp_path / "case", calls=3)
    assert (tmp_path / "case" / "step_hlo.txt").read_text().startswith("HloModule")
    assert summary["steps"] == 3 and summary["busy_ms"] > 0
    dots = [op for op in summary["ops"] if "dot" in op["name"] or "dot" in op["scope"]]
    assert dots and all(op["count"] % 3 == 0 for op in dots)  # every call of the step, no more, no fewer
    assert any("projection" in op["scope"] for op in summary["ops"])


def test_each_variant_is_printed_when_timed_traced_into_its_own_folder_and_a_failing_one_recorded(tmp_path, capsys):
    """``run`` prints a variant's line as soon as it is timed (a part's time limit then loses only the variant it
    stops in), records a failing variant instead of failing the shape, and with ``trace`` traces the table config into
    DIR/SHAPE and each variant into DIR/SHAPE_VARIANT (commas made underscores), each summary beside its times."""
    from benchmarks.kernels import run

    s = Problem("gdn", 1, 64, 1, 1, 16, 16, name="tiny_gdn")
    res = run(s, repeats=1, xla_timing=False, interpret=True, variants=("chunk=24", "block_v=16,block_v_bwd=16"),
              trace=str(tmp_path))
    assert "power of two" in res["variants"]["chunk=24"]["error"]
    variant = res["variants"]["block_v=16,block_v_bwd=16"]
    assert res["ok"] and variant["ok"] and variant["trace"]["steps"] == 3 and res["trace"]["steps"] == 3
    for folder in ("tiny_gdn", "tiny_gdn_block_v=16_block_v_bwd=16"):
        assert (tmp_path / folder / "step_hlo.txt").read_text().startswith("HloModule")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny_gdn ")]
    assert [line.split(": ")[0] for line in lines] == ["tiny_gdn chunk=24", "tiny_gdn block_v=16,block_v_bwd=16",
                                                       "tiny_gdn block_v=16,block_v_bwd=16"]
    assert "FAILED ValueError" in lines[0] and lines[1].endswith(": trace") and "fwd+bwd" in lines[2]
