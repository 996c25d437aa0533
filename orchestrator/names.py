"""Names a deployment's processes agree on (kept free of heavy imports: the replica admin commands
only need these and Ray)."""

DEFAULT_NAMESPACE = "treeserve"  # Ray namespace of a deployment
COORDINATOR = "coordinator"  # the coordinator actor's name in that namespace


def engine_actor_name(verifier: str) -> str:
    return f"engine:{verifier}"
