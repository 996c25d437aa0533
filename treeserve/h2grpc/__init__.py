"""gRPC on sockets for the one hot call of a serving step (VerifyStream), without grpcio's threads:
`server.DirectServer` (a second port of the verifier) and `client.DirectStreamSession` (what the
orchestrator's engine loop uses against it). The wire is plain gRPC over cleartext HTTP/2, so
either end also works with grpcio's. See docs/internals.md, "The direct port"."""
