"""Examples built on p2pshard's public API; each opens with how to run it."""
