"""rmm-jax: the citation-driven memory reranker of Reflective Memory Management in JAX."""
__version__ = "0.1.0"
