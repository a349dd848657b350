"""JAX's own test files through jitserve's IFRT proxy, compared with local runs (``runner``)."""
