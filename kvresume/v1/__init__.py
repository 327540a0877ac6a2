"""Generated protobuf and gRPC modules of proto/kvresume/v1 (committed; never edit by hand)."""
