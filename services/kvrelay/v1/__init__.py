"""Generated protobuf / gRPC code for kvrelay.v1 (`make proto` regenerates; do not edit)."""
