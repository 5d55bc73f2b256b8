"""How good a model is: held-out loss and bits per byte, downstream tasks inside
training, and `python -m jaxmoe.eval`, the lm-evaluation-harness backend."""
