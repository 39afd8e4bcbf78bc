"""Expert-parallel load balancing (EPLB): the placement policy (pure numpy, `policy.py`)."""
