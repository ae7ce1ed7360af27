"""KV connectors: move prefilled KV blocks from a prefill worker to a decode worker."""
