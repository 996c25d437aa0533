"""treeserve: speculative tree decoding for hybrid state-space models, served over gRPC.

Importing the package puts treeserve's gRPC core settings into the environment before anything
loads `grpc` (see `treeserve.grpc_env`); the project's other packages import it first for that."""
from treeserve import grpc_env as _grpc_env

_grpc_env.set_defaults()
