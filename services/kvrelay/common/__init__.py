"""What both sides of the wire share: sampling parameters, prompt block hashes, the
incremental detokenizer, the messages between processes and the worker -> router stream's
wire format. It imports nothing from the engine, the workers or the router (docs/
architecture.md section 1), so the router runs without the engine's modules."""
