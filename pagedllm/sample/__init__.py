"""Token sampling from logits: penalties, temperature, top-k/top-p/min-p, seeded sampling."""
