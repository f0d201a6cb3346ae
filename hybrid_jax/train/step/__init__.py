"""The jitted train step and what it is made of: the mesh and sharding rules (``mesh.py``), the optimizer
(``optim.py``) and its learning-rate schedule (``schedule.py``), the chunked cross-entropy (``loss.py``), the train
state and the step itself (``train_step.py``). A run assembles them through
:func:`hybrid_jax.train.trainer.build_trainer`."""
