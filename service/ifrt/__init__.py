"""JAX's IFRT proxy protocol: unmodified JAX programs run on jitserve (``server``)."""
