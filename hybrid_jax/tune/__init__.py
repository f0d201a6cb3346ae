"""Sweep the recurrent kernels' launches on this GPU at a config's shapes and write a tuning file.

    python -m hybrid_jax.tune [--config configs/X.py] [--budget-s 600] [--out PATH] [--batch 8] [--seq-len T]

For each kernel the config uses (GDN, KDA, or Mamba2's SSD as ``gla``), keyed by its padded head dims ``(K, V)``:
coordinate descent from the built-in table entry over the search space beside the kernels
(``kernels/recurrent/search.py``), one axis at a time, each candidate scored by the launch stages its axis changes
(each stage compiled and timed alone). A candidate that fails to compile (shared memory, registers) is skipped with a
note. A candidate faster than the best so far wins only once its values and gradients match the chunked XLA form
in float32. The search is ``kernels/tooling/sweep.py``, shared with ``python -m benchmarks autotune`` (timings on
FLA-law inputs, the check on inputs with the model's gates). The budget is split across the kernels (time one leaves
goes to the next); after it, the whole op (forward + backward) is timed under the winner and under the built-in
entry, and the built-in entry is kept unless the winner is faster. Written to this GPU's tuning file
(``kernels/tuning_file.cache_path()``) or ``--out``. Without ``--config``: every published config's shapes
(``configs/zebra_*.py``). On CPU (or with ``--interpret``) the kernels run in interpret mode at tiny shapes: a check
of the command, not a tuning.
"""
