"""Model building blocks. Each parameter carries a `weight_loader` so sharding lives with its layer."""
