"""The router: admission, routing, and the prefill -> relay -> decode orchestration."""
