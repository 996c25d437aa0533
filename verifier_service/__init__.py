"""The Verifier service: owns the target model, verifies token trees for many sequences at once.

Modules, each with one job:
  limits     the configured limits
  sequences  the sequence table and the idempotent commit rule
  results    per-node answers computed next to the logits (argmax, seeded samples, the walk)
  engine     every operation on the model and the table (single-threaded)
  batcher    who runs the model: continuous batching of Verify items, serial Prefill/Commit/Release
  servicer   the gRPC edge: decode, validate, hand over, encode
  pool       the RPC thread pool (the most recently idle thread takes the next call)
  metrics    Prometheus counters and histograms (with each Verify call's time split by stage)
  client     a typed client for the orchestrator
  cli        `treeserve verifier`
"""
import treeserve  # noqa: F401,E402  (first: gRPC core settings before anything loads grpc)
