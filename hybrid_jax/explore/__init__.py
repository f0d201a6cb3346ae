"""Look inside a model: run a text through it, capture what every sublayer computes, and plot it.

Needs the ``notebook`` extra (matplotlib; treescope for the module tree in the notebook).

The notebook ``notebooks/explore_layers.ipynb`` is a few calls into this module::

    model, config = load_model(workdir)               # a checkpoint (hybrid_jax.load), or a random init of a config
    tokens = prompt_tokens(config, text)              # [T] int32 (a mock-chain sequence when there is no tokenizer)
    trace = run(model, tokens)                        # logits, residual stream, mixer internals, attention maps
    activation_norms(trace); recurrent_states(trace); effective_memory(g); next_token_table(trace, config)
    plot_*(...) -> matplotlib Figure;  save_figure(fig, directory, name) -> PNG path

What is measured (all for one sequence, batch 1):

* Activation norms: the RMS over channels of the residual stream after each sublayer (and of the embedding), and
  of each sublayer's update ``f(norm(x))``, averaged over positions. ``[L+1]`` and ``[L]``.
* Recurrent state ``S_t`` of every GDN / KDA / Mamba2 layer at every position, read out of the layer's own kernel:
  querying the recurrence with the unit vectors ``q = e_i`` (scale 1) returns row ``i`` of ``S_t``, so one
  batched kernel call with ``K`` probes gives ``S_t [T,HV,K,V]``; its last step equals the sown ``final_state``.
  The layer's q/k/v are the sown output of its short convolution, split as the mixer splits them.
* Effective memory ``m_t = sum_{s<=t} prod_{r=s+1..t} exp(g_r)`` (``m_t = exp(g_t) m_{t-1} + 1``): how many past
  tokens the decay alone lets through to ``t``, in tokens (``1 / (1 - a)`` for a constant decay ``a``; KDA's
  per-channel decay is averaged over channels). It ignores the delta rule's erasing, which the state norm shows.
* Gates: the per-token decay ``exp(g)`` (GDN, KDA channel mean, Mamba2 ``exp(dt * A)``), beta (GDN/KDA) and
  Mamba2's step ``dt``. MLA attention maps ``[H,T,T]`` (softmax probabilities, causal).
"""

from hybrid_jax.explore.capture import (
    RecurrentLayer,
    Trace,
    activation_norms,
    chain_probs,
    effective_memory,
    load_model,
    next_token_probs,
    next_token_table,
    prompt_tokens,
    recurrent_layer,
    recurrent_states,
    resolve_workdir,
    run,
    state_trajectory,
    target_probs,
    token_labels,
    tokenizer_of,
)
from hybrid_jax.explore.plots import (
    plot_activation_norms,
    plot_attention,
    plot_gates,
    plot_next_token,
    plot_recurrent_states,
    save_figure,
)

__all__ = ["RecurrentLayer", "Trace", "activation_norms", "chain_probs", "effective_memory", "load_model",
           "next_token_probs", "next_token_table", "plot_activation_norms", "plot_attention", "plot_gates",
           "plot_next_token", "plot_recurrent_states", "prompt_tokens", "recurrent_layer", "recurrent_states",
           "resolve_workdir", "run", "save_figure", "state_trajectory", "target_probs", "token_labels",
           "tokenizer_of"]
