"""kvrelay's public APIs: gRPC (kvrelay.v1.Generation) and OpenAI-compatible HTTP."""
