"""What a run tells: the console (``progress.py``), metrics.jsonl and TensorBoard (``metrics.py``), the validation
loss on held-out windows (``heldout_loss.py``)."""
