"""Sequence (context) parallelism: one sequence split over the ``context`` mesh axis, exact.

Every function here runs inside a ``jax.shard_map`` that splits the time axis over a named mesh axis (``axis``,
``"context"`` in training): shard ``i`` of ``n`` holds tokens ``[i T/n, (i+1) T/n)`` of every sequence. They use
only collectives (``all_gather``, ``ppermute``, ``psum``) and our kernels, so ``jax.grad`` transposes them (the
recurrences' Pallas form, ``kernels/recurrent/context.py``, under its own VJP):

* ``recurrence``: GDN, KDA and Mamba2's SSD (GLA) as an affine prefix over the shards (each shard's final state is
  ``M S_in + S_local``);
* ``shards``: the axis' index and size, the previous shard's last tokens (the short convs' halo), the global
  positions and segment ids;
* MLA (``hybrid_jax.model.mla``) gathers its compressed latent and attends with ``kernels.attention``'s ``q_offset``
  (a shard's queries over the whole sequence's keys);
* ``hybrid_jax.train.step.context_loss``: the model's loss under such a ``shard_map``.
"""
