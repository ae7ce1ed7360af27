"""Ray workers: an engine on its own thread, as an actor, in prefill / decode pools."""
