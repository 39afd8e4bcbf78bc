"""Process groups and collectives for tensor/pipeline parallelism (issue #11)."""
