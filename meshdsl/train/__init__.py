"""Training: optimizers written to give the same update under every layout, the compiled train
step, data, and the training loop behind ``meshdsl train``."""
