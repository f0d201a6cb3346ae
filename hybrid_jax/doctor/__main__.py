"""``python -m hybrid_jax.doctor``: see :mod:`hybrid_jax.doctor`."""

from hybrid_jax.doctor.cli import main

raise SystemExit(main())
