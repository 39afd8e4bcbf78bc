"""KV connectors, scheduler side (vLLM's KVConnectorBase_V1 split by role): see base.py."""
