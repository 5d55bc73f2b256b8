"""jaxmoe: Mixture-of-Experts language-model training in JAX."""
