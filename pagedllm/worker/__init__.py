"""Worker side: device set-up, the model runner and its persistent request state."""
