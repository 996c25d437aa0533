import treeserve  # noqa: F401,E402  (first: gRPC core settings before anything loads grpc)
