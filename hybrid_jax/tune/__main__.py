"""``python -m hybrid_jax.tune``: see :mod:`hybrid_jax.tune`."""

from hybrid_jax.tune.cli import main

main()
