"""The batch loss with every sequence split over the mesh's ``context`` axis (sequence parallelism), exact.

The batch's ``[B, T+1]`` windows arrive split over the batch axes only. The inputs ``[:, :-1]``, targets ``[:, 1:]``
and segment ids ``[:, :-1]`` (each ``[B, T]``) are split on time too (``mesh.token_spec``: a local slice per
device), and one ``jax.shard_map`` over the whole mesh runs the model on each device's ``[B_local, T/n]`` part
(``HybridLM.features(..., context="context")``: the recurrent mixers' affine state prefix, the short convs' halo,
MLA's gathered latent: ``hybrid_jax.parallel``) and the chunked cross-entropy on its tokens; the mean over devices is
the batch's mean (every device holds as many tokens). ``jax.grad`` of this function transposes the collectives; the
parameters enter replicated (gathered over ``fsdp`` at the boundary when split there).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from hybrid_jax.data.pipeline import Batch
from hybrid_jax.train.step import mesh as mesh_lib
from hybrid_jax.train.step.loss import model_loss


def context_batch_loss(params: dict, graphdef: nnx.GraphDef, batch: Batch, chunk_size: int,
                       mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None) -> jax.Array:
    """Mean next-token cross-entropy of the model ``(graphdef, params)`` on ``batch`` (``[B, T+1]`` windows, documents
    kept apart when it has segment ids) with each sequence split over ``mesh``'s ``context`` axis (``mesh`` None: the
    one set by ``jax.set_mesh``). ``T`` must be a multiple of the axis size, each part at least the short convs'
    ``conv_size - 1`` tokens. Returns a float32 scalar."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    axes = tuple(mesh.axis_names)
    tokens = mesh_lib.token_spec()
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    parts = (inputs, targets) if batch.segment_ids is None else (inputs, targets, batch.segment_ids[:, :-1])

    def local(params: dict, inputs: jax.Array, targets: jax.Array, segment_ids: jax.Array | None = None
              ) -> jax.Array:
        loss = model_loss(nnx.merge(graphdef, params), inputs, targets, segment_ids, chunk_size=chunk_size,
                          context=mesh_lib.CONTEXT)
        return jax.lax.pmean(loss, axes)

    # check_vma=False: the kernels' scans start from states made inside them (zeros, or the [0 | I] of
    # parallel.recurrence), which the varying-axes check would have to be told about, op by op
    run = jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), *([tokens] * len(parts))),
                        out_specs=PartitionSpec(), check_vma=False)
    return run(params, *parts)
