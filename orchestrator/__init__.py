"""The control plane: Ray actors (coordinator, one engine per verifier replica), acceptance and
commits, the committed-token log, adaptive speculation and the public Generation service."""
import treeserve  # noqa: F401,E402  (first: gRPC core settings before anything loads grpc)
import os as _os

# Ray reads these when it is imported. Engine logs are per request and step: show every line
# instead of folding similar lines together; no token authentication inside the cluster (keep it
# on a private network, see docs/deploy.md); no usage reports.
_os.environ.setdefault("RAY_DEDUP_LOGS", "0")
_os.environ.setdefault("RAY_AUTH_MODE", "disabled")
_os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # never phone home (the demo runs offline)
