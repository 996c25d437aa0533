"""Names a deployment's processes agree on (kept free of heavy imports: the replica admin commands
only need these and Ray)."""

DEFAULT_NAMESPACE = "treeserve"  # Ray namespace of a deployment
COORDINATOR = "coordinator"  # the coordinator actor's name in that namespace

# What `Coordinator.check_engine` says of an engine a front could not drain
ENGINE_ANSWERS = "answers"  # it answers (or is busy): the front reads on
ENGINE_UNREACHABLE = "unreachable"  # it does not answer for now, and is not known dead
ENGINE_DEAD = "dead"  # it died: the coordinator dropped its replica, and the ids of its requests are free
ENGINE_UNKNOWN = "unknown"  # the coordinator has no replica with that engine (dropped or retired before)


def engine_actor_name(verifier: str) -> str:
    return f"engine:{verifier}"
