"""KV connectors, worker side (vLLM's KVConnectorBase_V1, role WORKER): see base.py."""
