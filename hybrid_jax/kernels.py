"""hybrid_jax.kernels: chunked recurrent kernels and attention, pure functions on arrays.

Public entry points (shapes ``[batch, time, heads, dim]``; states float32 ``[B,HV,K,V]``)::

    chunk_gated_delta_rule(q, k, v, g, beta, ...)   Gated DeltaNet (scalar decay per head)
    chunk_kda(q, k, v, g, beta, ...)                Kimi Delta Attention (decay per key channel)
    chunk_simple_gla(q, k, v, g, ...)               scalar-gated linear attention (Mamba2 SSD)
    attention(q, k, v, causal=True, ...)            softmax attention, qk dim may differ from v dim

Beside them, five kernels the model uses through the same ``impl`` (``model.kernel_impl``):
``cross_entropy.softmax_grad`` (the loss's log-sum-exp and gradient over a chunk of logits), ``swiglu.swiglu``
(``silu(gate) * up`` on the MLP's ``[gate | up]``, its backward one pass that writes ``d[gate | up]``),
``short_conv.short_conv_silu`` (the short causal conv with SiLU, its backward two kernels: ``dpre`` once per output,
then the input gradient; its output in channel pieces if asked), ``gated_norm.gated_rms_norm`` (the mixers' gated
RMSNorm, one kernel each way, the backward from the inputs) and ``rms_norm.add_rms_norm`` (the residual stream's add
with the RMSNorm after it, one kernel each way). On their Pallas path the recurrent kernels normalise q and k
(``use_qk_l2norm``) with ``l2_norm.l2_norm``, one kernel each way.

``impl`` picks the implementation: ``"auto"`` (Pallas on GPU, XLA elsewhere), ``"xla"`` (chunked pure
JAX), ``"pallas"``, ``"pallas_interpret"`` (the Pallas code interpreted on CPU, for tests), ``"naive"``
(token-by-token recurrence; the ground truth).

Where the code is: the submodules live in the repository's top-level ``kernels/`` folder (installed as
``hybrid_jax/kernels/``). That folder has no ``__init__.py`` on purpose: this module is the package's face and names
the folder as its ``__path__``. A ``kernels/__init__.py`` would make the folder the top-level package ``kernels``
for every Python started in the repository root (``python -m``, ``python -``, pytest), hiding the PyPI package
``kernels`` that transformers imports.
"""

from pathlib import Path

_here = Path(__file__).resolve()
# installed: hybrid_jax/kernels/ beside this file; a source checkout: the top-level kernels/ folder
__path__ = [str(p) for p in (_here.with_suffix(""), _here.parents[1] / "kernels") if p.is_dir()][:1]

from hybrid_jax.kernels.api import attention, chunk_gated_delta_rule, chunk_kda, chunk_simple_gla  # noqa: E402

__all__ = ["attention", "chunk_gated_delta_rule", "chunk_kda", "chunk_simple_gla"]
