"""megatrain_jax: train LMs larger than GPU memory on one GPU."""
